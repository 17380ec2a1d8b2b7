"""The engine on the CPU reference path, float32, against Hugging Face transformers on tiny random checkpoints.

Greedy tokens must be identical to HF generate(do_sample=False). Then the invariances: batched == one at a time,
chunked prefill == whole prefill, preempted-and-recomputed == never preempted, and the page allocator's
invariant holds (and every page is back) after each workload.
"""

from __future__ import annotations

import random

import pytest
from checkpoints import engine_logits, hf_greedy, hf_logits, make_checkpoint
from fastqwen import LLM, InvalidRequestError, SamplingParams

NEW_TOKENS = 32

# (tied embeddings, query heads, KV heads): query heads per KV head 1, 2 and 4.
MODELS = {
    "tied-g1": (True, 4, 4),
    "untied-g2": (False, 4, 2),
    "tied-g4": (True, 8, 2),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}
    for name, (tied, heads, kv_heads) in MODELS.items():
        folder = str(tmp_path_factory.mktemp(name))
        made[name] = (
            folder,
            make_checkpoint(folder, tied=tied, num_heads=heads, num_kv_heads=kv_heads, seed=len(made)),
        )
    return made


def random_prompts(seed: int, count: int, low: int = 3, high: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 380) for _ in range(rng.randint(low, high))] for _ in range(count)]


def assert_pool_clean(llm: LLM) -> None:
    """Ownership invariant holds, and once the prefix cache lets go, every page is free."""
    llm.engine.check_invariants()
    if llm.engine.cache is not None:
        llm.engine.cache.reset()
        llm.engine.check_invariants()
    allocator = llm.engine.kv.allocator
    assert allocator.num_free() == allocator.num_total(), "pages leaked after the workload"


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_greedy_matches_hf(checkpoints, model_name, page_size):
    folder, hf_model = checkpoints[model_name]
    prompts = random_prompts(seed=page_size, count=3)
    expected = [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    llm = LLM(folder, dtype="float32", device="cpu", page_size=page_size, num_pages=256)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS), use_tqdm=False)
    for prompt, out, ref in zip(prompts, outputs, expected):
        assert out.token_ids == ref, f"prompt of {len(prompt)} tokens diverges from HF"
        assert out.num_prompt_tokens == len(prompt)
        assert out.num_completion_tokens == len(ref)
        assert out.finish_reason == ("length" if len(ref) == NEW_TOKENS else "stop")
    assert any(len(r) >= NEW_TOKENS for r in expected), "every prompt stopped early: the test compares too little"
    assert_pool_clean(llm)


def test_text_prompt_equals_token_prompt(checkpoints):
    folder, _ = checkpoints["untied-g2"]
    llm = LLM(folder, dtype="float32", device="cpu", num_pages=64)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    from_text, from_ids = llm.generate(["t5 t17 t200 t3", [5, 17, 200, 3]], params, use_tqdm=False)
    assert from_text.token_ids == from_ids.token_ids
    assert from_text.text == " ".join(f"t{t}" for t in from_ids.token_ids if t < 382)


def test_batched_equals_one_at_a_time(checkpoints):
    folder, _ = checkpoints["untied-g2"]
    prompts = random_prompts(seed=11, count=6, low=1, high=60)
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in (1, 5, 33, 17, 2, 40)]
    single = LLM(folder, dtype="float32", device="cpu", page_size=4, num_pages=512, max_num_seqs=1)
    one_by_one = [single.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    # At most 3 at once: the others are admitted as sequences finish, in batches that mix prefill and decode.
    batched = LLM(folder, dtype="float32", device="cpu", page_size=4, num_pages=512, max_num_seqs=3)
    kinds = []
    schedule = batched.engine.scheduler.schedule

    def recording_schedule(*args, **kwargs):
        batch = schedule(*args, **kwargs)
        kinds.append({c.end - c.start > 1 for c in batch.chunks})
        return batch

    batched.engine.scheduler.schedule = recording_schedule
    together = batched.generate(prompts, params, use_tqdm=False)
    assert {True, False} in kinds, "no step mixed a prefill with decodes"
    for a, b, sp in zip(one_by_one, together, params):
        assert a.token_ids == b.token_ids
        assert a.finish_reason == b.finish_reason
        assert len(b.token_ids) <= sp.max_tokens
    assert [len(o.token_ids) for o in together] != [len(together[0].token_ids)] * len(together), (
        "all sequences finished at the same step: the test does not exercise different lengths"
    )
    assert_pool_clean(single)
    assert_pool_clean(batched)


def test_chunked_prefill_equals_whole_prefill(checkpoints):
    folder, _ = checkpoints["tied-g4"]
    prompts = random_prompts(seed=5, count=4, low=30, high=90)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    whole = LLM(folder, dtype="float32", device="cpu", page_size=4, num_pages=512, max_num_batched_tokens=4096)
    chunked = LLM(folder, dtype="float32", device="cpu", page_size=4, num_pages=512, max_num_batched_tokens=13)
    expected = whole.generate(prompts, params, use_tqdm=False)
    got = chunked.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert_pool_clean(whole)
    assert_pool_clean(chunked)


def test_preemption_gives_the_same_outputs(checkpoints):
    folder, _ = checkpoints["untied-g2"]
    prompts = random_prompts(seed=7, count=8, low=10, high=30)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    large = LLM(folder, dtype="float32", device="cpu", page_size=4, num_pages=1024)
    # 8 sequences of up to 60 tokens need up to 120 pages at once; 24 forces repeated preemption.
    small = LLM(folder, dtype="float32", device="cpu", page_size=4, num_pages=24)
    expected = large.generate(prompts, params, use_tqdm=False)
    got = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0, "the small pool never preempted"
    assert large.engine.scheduler.num_preemptions == 0
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert all(len(o.token_ids) == 30 for o in got)
    assert_pool_clean(small)
    assert_pool_clean(large)


def test_request_that_can_never_fit_is_rejected(checkpoints):
    folder, _ = checkpoints["tied-g1"]
    llm = LLM(folder, dtype="float32", device="cpu", page_size=4, num_pages=8, max_model_len=256)
    with pytest.raises(ValueError, match="KV pool"):
        llm.generate([[1] * 20], SamplingParams(max_tokens=100), use_tqdm=False)
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate([[1] * 300], SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[1, 2, 10_000]], use_tqdm=False)
    # Nothing was queued by the failed calls, and the engine still works.
    assert not llm.engine.has_unfinished()
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    assert len(out.token_ids) >= 1
    assert_pool_clean(llm)


def test_context_length_stops_generation(checkpoints):
    folder, hf_model = checkpoints["tied-g1"]
    prompt = random_prompts(seed=3, count=1, low=20, high=20)[0]
    llm = LLM(folder, dtype="float32", device="cpu", page_size=4, num_pages=64, max_model_len=28)
    # max_tokens=None fills the context; asking for more than fits is an error, not a silent cut.
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert out.finish_reason == "length"
    assert len(prompt) + len(out.token_ids) == 28
    with pytest.raises(InvalidRequestError, match="maximum context length") as err:
        llm.generate([prompt], SamplingParams(max_tokens=9), use_tqdm=False)
    assert err.value.param == "max_tokens"


def test_abort_frees_pages(checkpoints):
    folder, _ = checkpoints["untied-g2"]
    llm = LLM(folder, dtype="float32", device="cpu", page_size=4, num_pages=64)
    engine = llm.engine
    rids = [llm.add_request(p, SamplingParams(max_tokens=50, ignore_eos=True)) for p in random_prompts(1, 3)]
    llm.step()
    llm.step()
    allocator = engine.kv.allocator
    assert allocator.num_free() < allocator.num_total()
    for rid in rids:
        assert llm.abort(rid)
    assert not llm.abort(rids[0]), "aborting twice should report an unknown request"
    assert not engine.has_unfinished()
    assert_pool_clean(llm)


def test_sampling_with_temperature_is_seeded_and_valid(checkpoints):
    folder, _ = checkpoints["untied-g2"]
    params = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    prompts = random_prompts(seed=9, count=4)
    runs = []
    for _ in range(2):
        llm = LLM(folder, dtype="float32", device="cpu", num_pages=128, seed=1234)
        runs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert runs[0] == runs[1], "the same engine seed must give the same samples"
    greedy = LLM(folder, dtype="float32", device="cpu", num_pages=128).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )
    assert runs[0] != [o.token_ids for o in greedy], "temperature 1 sampled exactly the greedy tokens"
    assert all(0 <= t < 384 for seq in runs[0] for t in seq)


@pytest.mark.parametrize("model_name", list(MODELS))
def test_logits_match_hf_float32(checkpoints, model_name):
    """A finer check than greedy tokens: every step's logits, with prefill split into chunks, within 1e-4."""
    folder, hf_model = checkpoints[model_name]
    prompt = random_prompts(seed=21, count=1, low=45, high=45)[0]
    llm = LLM(folder, dtype="float32", device="cpu", page_size=8, num_pages=64, max_num_batched_tokens=16)
    tokens, logits = engine_logits(llm, prompt, 12)
    reference = hf_logits(hf_model, prompt, tokens)
    assert logits.shape == reference.shape == (12, 384)
    err = (logits - reference).abs().max().item()
    assert err < 1e-4 * reference.abs().max().item(), f"max |logit difference| {err}"
