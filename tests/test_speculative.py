"""Speculative decoding on the CPU reference path: drafters against brute-force references, greedy outputs equal to
decoding without speculation (wrong drafts included), the target's distribution kept under sampling (chi-square
against Hugging Face's probabilities), no rejected token's KV in the prefix cache (against Hugging Face's keys),
stops, preemption and aborts in the middle of an accepted run, penalties counting the draft tokens before each
verified position (on the reference sampler and on the CUDA sampler's engine side, cpu_graphs), logprobs the target's."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import time

import pytest
import torch
from checkpoints import make_checkpoint
from cpu_graphs import graph_llm, plain_llm
from fastqwen import LLM, SamplingParams
from fastqwen.config import ConfigError, EngineConfig
from fastqwen.engine.llm_engine import GateCredit
from fastqwen.engine.messages import EngineRequest
from fastqwen.ops import _native
from fastqwen.speculative.ngram import NgramIndex
from fastqwen.speculative.suffix import SuffixTree

K = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("spec"))
    # A sharp model (logit_scale): greedy outputs repeat themselves, as real models' do, so the drafters find matches.
    model = make_checkpoint(path, tied=False, seed=5, logit_scale=4.0, max_positions=1024)
    return path, model


def make_llm(path: str, spec: dict | None = None, **knobs) -> LLM:
    knobs = {"dtype": "float32", "device": "cpu", "page_size": 4, **knobs}
    return LLM(path, speculative_config=spec, **knobs)


def prompts(n: int, length: int = 24, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(length)] for _ in range(n)]


def outputs(llm: LLM, prompt_list, params) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompt_list, params, use_tqdm=False)]


class OracleDrafter:
    """Proposes the reference continuation with one token made wrong in half of the drafts: many drafts accepted in
    part, many in full, many rejected at once."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], seed: int = 0):
        self.references = references  # prompt -> its full reference output
        self.rng = random.Random(seed)

    def propose(self, rid, tokens, num_prompt_tokens, limit):
        full = list(tokens[:num_prompt_tokens]) + self.references[tuple(tokens[:num_prompt_tokens])]
        if full[: len(tokens)] != list(tokens):
            return [], 0.0
        draft = full[len(tokens) : len(tokens) + limit]
        if draft and self.rng.random() < 0.5:
            i = self.rng.randrange(len(draft))
            draft[i] = (draft[i] + 1) % 250 + 3
        return draft, float(len(draft))

    def finish(self, rid, tokens, num_prompt_tokens):
        pass


def with_oracle(llm: LLM, prompt_list, reference_outputs) -> LLM:
    llm.engine.speculator.drafter = OracleDrafter({tuple(p): o for p, o in zip(prompt_list, reference_outputs)})
    return llm


class WrongDrafter:
    """Proposes full drafts that the target never draws: each token one past the reference's at its position. Every
    verified position but the first is rejected."""

    def __init__(self, references: dict[tuple[int, ...], list[int]]):
        self.references = references

    def propose(self, rid, tokens, num_prompt_tokens, limit):
        full = list(tokens[:num_prompt_tokens]) + self.references[tuple(tokens[:num_prompt_tokens])]
        draft = [t % 250 + 4 for t in full[len(tokens) : len(tokens) + limit]]
        return draft, float(len(draft))

    def finish(self, rid, tokens, num_prompt_tokens):
        pass


# ---- configuration ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, key",
    [
        ("{not json", "speculative_config"),
        ('{"method": "medusa"}', "method"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 9}', "num_speculative_tokens"),
        ('{"method": "ngram", "lookahead": 2}', "lookahead"),
        ('{"num_speculative_tokens": 2}', "method"),
        ('{"method": "ngram", "synthetic_acceptance_length": 9}', "synthetic_acceptance_length"),
    ],
)
def test_bad_config_is_refused_naming_the_key(value, key):
    with pytest.raises(ConfigError) as error:
        EngineConfig(model="Qwen3-0.6B", load_format="dummy", speculative_config=value)
    assert error.value.field == "speculative_config"
    assert key in str(error.value)


# ---- drafters against brute force -------------------------------------------------------------------------------


def naive_lookup(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        tail = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):  # latest earlier occurrence, followed by a token
            if tokens[end - n : end] == tail:
                return tokens[end : end + k]
    return []


def test_ngram_lookup_matches_brute_force():
    rng = random.Random(1)
    for _ in range(200):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 60))]
        index = NgramIndex(2, 4)
        cut = rng.randrange(len(tokens) + 1)
        index.extend(tokens[:cut])  # built in two steps, as tokens are committed
        index.extend(tokens)
        assert index.lookup(tokens, 3) == naive_lookup(tokens, 2, 4, 3), tokens


def test_suffix_tree_counts_every_substring_and_forgets_removed_sequences():
    rng = random.Random(2)
    sequences = [[rng.randrange(3) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    tree = SuffixTree(depth=5)
    for s in sequences:
        tree.add(s)
    tree.add(sequences[0], sign=-1)
    kept = sequences[1:]

    def count(pattern):
        return sum(
            1 for s in kept for i in range(len(s) - len(pattern) + 1) if s[i : i + len(pattern)] == list(pattern)
        )

    def walk(node, path):
        for token, child in node.children.items():
            assert child.count == count(path + [token]), path + [token]
            walk(child, path + [token])

    walk(tree.root, [])
    for s in kept:  # every substring up to the depth is a path
        for i in range(len(s)):
            node = tree.root
            for token in s[i : i + 5]:
                node = node.children[token]


# ---- greedy: the same tokens, whatever the drafts ---------------------------------------------------------------


@pytest.mark.parametrize("method", ["ngram", "suffix", "oracle"])
def test_greedy_output_is_unchanged(checkpoint, method):
    path, _ = checkpoint
    batch = prompts(4, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=36, ignore_eos=True)
    reference = outputs(make_llm(path), batch, params)
    spec = {"method": "suffix" if method == "suffix" else "ngram", "num_speculative_tokens": K}
    llm = make_llm(path, spec)
    if method == "oracle":
        with_oracle(llm, batch, reference)
    assert outputs(llm, batch, params) == reference
    stats = llm.engine.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0
    if method == "oracle":  # half the drafts are right: many accepted in full, many cut short
        assert stats.spec_accepted_per_position[K - 1] > 0
        assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


# ---- penalties: every verified position counts the draft tokens before it ----------------------------------------

# Penalties that make tokens already drawn likely again (repetition below 1, presence rewarded) with frequency pulling
# the other way: greedy outputs repeat themselves (the drafters find matches), and a count missing or extra at a
# verified position moves its distribution far (test_sampled_tokens_keep_the_target_distribution gives the figure).
PENALTIES = dict(repetition_penalty=0.8, presence_penalty=-1.0, frequency_penalty=0.5)


def sampler_llm(path: str, sampler: str, monkeypatch, spec: dict | None = None, **knobs) -> LLM:
    """An engine on the reference sampler, or on the CUDA sampler's engine side (GpuSampler, its kernel the
    reference on the CPU: cpu_graphs) eager ("gpu") or with decode and verify graph stand-ins ("gpu-graphs")."""
    knobs = {"page_size": 4, **knobs}
    if sampler == "reference":
        return make_llm(path, spec, **knobs)
    if sampler == "gpu":
        return plain_llm(monkeypatch, path, speculative_config=spec, **knobs)
    knobs.setdefault("num_pages", 512)  # (else the engine measures the graphs' device memory)
    llm = graph_llm(monkeypatch, path, speculative_config=spec, **knobs)
    assert spec is None or llm.engine.runner.verify_graphs is not None
    return llm


@pytest.fixture(scope="module")
def penalized(checkpoint):
    """Prompts, greedy parameters with every penalty set, and their outputs without speculation (reference sampler)."""
    path, _ = checkpoint
    batch = prompts(4, seed=16)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, **PENALTIES)
    return batch, params, outputs(make_llm(path), batch, params)


@pytest.mark.parametrize(
    "sampler, method",
    [("reference", m) for m in ("ngram", "suffix", "oracle", "wrong")] + [("gpu", "drafts"), ("gpu-graphs", "drafts")],
)
def test_greedy_output_with_penalties_is_unchanged(checkpoint, penalized, monkeypatch, sampler, method):
    """Greedy requests with repetition, presence and frequency penalties draft like any other and get exactly the
    tokens of decoding without speculation: each verified position is penalized for the draft tokens before it, and
    a rejected token is never counted afterwards. The CUDA sampler's engine side runs the half-wrong oracle, then the
    always-wrong drafter (counts rows per position, kept or freed once the step is recorded)."""
    path, _ = checkpoint
    batch, params, reference = penalized
    references = {tuple(p): o for p, o in zip(batch, reference)}
    spec = {
        "method": "suffix" if method == "suffix" else "ngram",
        "num_speculative_tokens": K,
        "min_acceptance_rate": 0.0,  # (the wrong drafter is never paused)
    }
    llm = sampler_llm(path, sampler, monkeypatch, spec)
    drafters = {
        "oracle": [OracleDrafter(references)],
        "wrong": [WrongDrafter(references)],
        "drafts": [OracleDrafter(references), WrongDrafter(references)],
    }.get(method, [None])  # (ngram, suffix: the configured drafter)
    for drafter in drafters:
        if drafter is not None:
            llm.engine.speculator.drafter = drafter
        before = llm.engine.stats()
        assert outputs(llm, batch, params) == reference
        after = llm.engine.stats()
        assert after.spec_num_drafts > before.spec_num_drafts
        accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
        assert (accepted == 0) if isinstance(drafter, WrongDrafter) else (accepted > 0)
    if method == "suffix":  # again, drafting from the first run's outputs: long accepted runs
        assert outputs(llm, batch, params) == reference
    if sampler == "gpu-graphs":  # verify steps replayed their graphs (forward, then the sampler over every position)
        assert llm.engine.runner.verify_graphs.sampler_replays
    llm.engine.check_invariants()


# A verify step computes its 1 + k positions in one prefill-shaped forward, a decode step one position: float32
# rounding differs between the two (measured on the CPU: at most 3.3e-6 here, 4.5e-6 elsewhere). A logprob read from
# another verified position is off by far more (3.1 measured, every emitted token given its run's first position's).
LOGPROB_TOLERANCE = 1e-4


@pytest.mark.parametrize("sampler", ["reference", "gpu-graphs"])
def test_logprobs_are_the_targets_under_speculation(checkpoint, penalized, monkeypatch, sampler):
    """Greedy requests with penalties asking for logprobs and top_logprobs: with speculation (half-wrong oracle, then
    always-wrong drafter) every token's logprob and its top 3 are those of decoding without it, within the rounding of
    a verify step's forward (each emitted token takes the logprobs of the verified position that drew it)."""
    path, _ = checkpoint
    batch, params, reference = penalized
    params = dataclasses.replace(params, logprobs=3)
    expected = make_llm(path).generate(batch, params, use_tqdm=False)
    assert [o.token_ids for o in expected] == reference
    references = {tuple(p): o for p, o in zip(batch, reference)}
    spec = {"method": "ngram", "num_speculative_tokens": K, "min_acceptance_rate": 0.0}
    llm = sampler_llm(path, sampler, monkeypatch, spec)
    worst = 0.0
    for drafter in (OracleDrafter(references), WrongDrafter(references)):
        llm.engine.speculator.drafter = drafter
        before = llm.engine.stats().spec_num_accepted_tokens
        got = llm.generate(batch, params, use_tqdm=False)
        assert (llm.engine.stats().spec_num_accepted_tokens > before) == isinstance(drafter, OracleDrafter)
        for mine, theirs in zip(got, expected):
            assert mine.token_ids == theirs.token_ids
            assert len(mine.logprobs) == len(theirs.logprobs)
            for a, b in zip(mine.logprobs, theirs.logprobs):
                assert a.token == b.token and len(a.top) == 3
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
                diffs = [abs(a.logprob - b.logprob)] + [abs(x - y) for (_, x), (_, y) in zip(a.top, b.top)]
                worst = max(worst, *diffs)
    assert worst < LOGPROB_TOLERANCE, worst
    if sampler == "gpu-graphs":  # (the verify graphs' sampler wrote the logprobs)
        assert llm.engine.runner.verify_graphs.sampler_replays


@pytest.mark.parametrize("sampler", ["reference", "gpu", "gpu-graphs"])
def test_seeded_sampling_with_every_parameter_is_unchanged(checkpoint, monkeypatch, sampler):
    """Seeded sampled requests with top-k, top-p, min-p, logit_bias, min_tokens and penalties: each draw is a function
    of the seed, the step and the processed logits, so with speculation (half-wrong oracle, always-wrong drafter) every
    token equals decoding without it, when every verified position takes its own step's seed, bans, bias and counts."""
    path, _ = checkpoint
    batch = prompts(6, seed=21)
    params = [
        SamplingParams(
            temperature=0.9,
            top_k=(0, 20)[i % 2],
            top_p=(1.0, 0.9)[i // 2 % 2],
            min_p=0.05 * (i % 3),
            seed=100 + i,
            max_tokens=40,
            min_tokens=10,
            logit_bias={7: 3.0, 11: -2.0},
            **(PENALTIES if i % 2 else {}),
        )
        for i in range(6)
    ]
    reference = outputs(make_llm(path), batch, params)
    references = {tuple(p): o for p, o in zip(batch, reference)}
    spec = {"method": "ngram", "num_speculative_tokens": K, "min_acceptance_rate": 0.0}
    llm = sampler_llm(path, sampler, monkeypatch, spec)
    for drafter in (OracleDrafter(references), WrongDrafter(references)):
        llm.engine.speculator.drafter = drafter
        before = llm.engine.stats().spec_num_accepted_tokens
        assert outputs(llm, batch, params) == reference
        assert (llm.engine.stats().spec_num_accepted_tokens > before) == isinstance(drafter, OracleDrafter)
    if sampler == "gpu-graphs":
        assert llm.engine.runner.verify_graphs.sampler_replays


on_gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and _native.has_cuda_kernels()), reason="needs a GPU and the CUDA kernels"
)


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=[pytest.mark.gpu, on_gpu]), "cpu"])
def test_gpu_sampler_counts_rows_of_a_verify_step(device, graph):
    """The CUDA sampler's counts table through a verify step and the step after it, row by row against counts
    written from the token lists: verified position i's row holds the prompt bits, the output, the draft's first i
    tokens and that position's draw; once the step is recorded, the request keeps the row of its last kept position
    (not rebuilt) and it counts exactly the committed tokens, and the step's other rows are free. Eager (sample) and
    as a graph step (frozen buffers, padded rows, graph_hook); on the CPU the kernel is its reference."""
    from fastqwen.config import GenerationDefaults
    from fastqwen.engine.sampler import GpuSampler
    from fastqwen.engine.verify import DraftRow
    from fastqwen.ops.sampling import sampler_row_layout
    from fastqwen.scheduler import Request

    vocab, dev = 384, torch.device(device)  # (the test checkpoints' vocabulary, as the GPU tests run the kernel)
    sampler = GpuSampler(vocab, max_rows=16, device=dev, eos_token_ids=[0], seed=1)
    if graph:
        sampler.freeze()
    prompt_bit = sampler_row_layout().prompt_bit

    def request(rid: int, **penalties) -> Request:
        params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, **penalties)
        r = Request(rid=rid, prompt_ids=[1, 2, 3, 9], params=params.with_defaults(GenerationDefaults()), arrival=rid)
        r.token_ids += [5, 6, 5]
        return r

    def counted(r: Request, extra) -> list[int]:
        output = r.output_ids + list(extra)
        return [output.count(t) | (prompt_bit if t in r.prompt_ids else 0) for t in range(vocab)]

    def step(rows: list, picks: list[int]) -> None:
        """Greedy draws of `picks` (one per row, far above every other logit, penalties or not)."""
        size = len(rows) + 2 if graph else len(rows)
        logits = torch.zeros(size, vocab)
        logits[range(len(rows)), picks] = 50.0
        logits = logits.to(dev)
        if graph:
            sampler.prepare(rows, pad_to=size)
            sampler.graph_hook(logits, size)
            tokens = sampler.tokens[: len(rows)].tolist()
        else:
            tokens, _ = sampler.sample(logits, rows, lambda t: t.tolist())
        assert tokens == picks

    a, b, c = request(0, **PENALTIES), request(1), request(2, frequency_penalty=0.7)
    draft_a, draft_c = (30, 5, 7), (11, 12)
    rows = [a, *[DraftRow(a, draft_a[:i]) for i in (1, 2, 3)], b, c, *[DraftRow(c, draft_c[:i]) for i in (1, 2)]]
    picks_a, picks_c = [30, 5, 31, 32], [13, 14, 15]  # a keeps 2 draft tokens then 31; c keeps none, then 13
    step(rows, picks_a + [20] + picks_c)
    table = sampler.counts.cpu()
    for r, draft, picks in ((a, draft_a, picks_a), (c, draft_c, picks_c)):
        positions = r.sampler.verified[1]
        assert len(set(positions)) == len(draft) + 1
        for i, slot in enumerate(positions):
            assert table[slot].tolist() == counted(r, draft[:i] + (picks[i],)), (r.rid, i)
    kept_a, kept_c = a.sampler.verified[1][2], c.sampler.verified[1][0]
    a.token_ids += [30, 5, 31]  # what Scheduler.update commits
    b.token_ids += [20]
    c.token_ids += [13]
    step([a, b, c], [40, 41, 5])
    assert (a.sampler.slot, c.sampler.slot) == (kept_a, kept_c)
    table = sampler.counts.cpu()
    assert table[kept_a].tolist() == counted(a, [40]) and table[kept_c].tolist() == counted(c, [5])
    owned = [i for i, owner in enumerate(sampler.slot_owner) if owner is not None and not owner.finished]
    assert sorted(owned) == sorted([kept_a, kept_c])


def test_stops_and_max_tokens_inside_an_accepted_run(checkpoint):
    path, _ = checkpoint
    batch = prompts(4, seed=4)
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    reference = outputs(make_llm(path), batch, long)
    llm = with_oracle(make_llm(path, {"method": "ngram", "num_speculative_tokens": 5}), batch, reference)
    for max_tokens in (2, 7, 11):  # ends inside a draft's reach
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        assert outputs(llm, batch, params) == [r[:max_tokens] for r in reference]
    # A stop token that the oracle drafts several positions ahead: the output ends at its first occurrence.
    for prompt, ref in zip(batch, reference):
        stop = ref[9]
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop])
        (out,) = outputs(llm, [prompt], params)
        assert out == ref[: ref.index(stop, 1) + 1] if stop in ref[1:] else ref
    llm.engine.check_invariants()


def test_preemption_and_abort_in_the_middle(checkpoint):
    path, _ = checkpoint
    batch = prompts(8, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    reference = outputs(make_llm(path), batch, params)
    # 8 requests of 64 tokens in 4-token pages need 128 pages: 70 force preemptions on the way.
    llm = with_oracle(make_llm(path, {"method": "ngram", "num_speculative_tokens": 4}, num_pages=70), batch, reference)
    assert outputs(llm, batch, params) == reference
    assert llm.engine.stats().num_preemptions > 0 and llm.engine.stats().spec_num_accepted_tokens > 0
    # Abort two requests after a few verify steps: their pages come back, the others finish as before.
    engine = llm.engine
    resolved = params.with_defaults(engine.generation_defaults)
    for rid, prompt in enumerate(batch[:4]):
        engine.add(EngineRequest(rid=1000 + rid, prompt_ids=prompt, params=resolved, arrival_time=time.monotonic()))
    for _ in range(4):
        engine.step()
    assert engine.abort(1000) and engine.abort(1001)
    engine.check_invariants()
    while engine.has_unfinished():
        engine.step()
        engine.check_invariants()
    assert engine.kv.allocator.num_free() + engine.cache.evictable_pages() == engine.kv.allocator.num_total()


# ---- the prefix cache holds only accepted tokens' KV ------------------------------------------------------------


def test_prefix_cache_holds_no_rejected_token(checkpoint):
    """Every page in the radix cache holds the K of its tokens as Hugging Face computes them: a rejected draft
    token's KV (written by the verify step at a position the request later fills with another token) must never be
    given to the cache."""
    path, model = checkpoint
    batch = prompts(4, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=45, ignore_eos=True)
    reference = outputs(make_llm(path), batch, params)
    llm = with_oracle(make_llm(path, {"method": "ngram", "num_speculative_tokens": 4}), batch, reference)
    assert outputs(llm, batch, params) == reference
    engine = llm.engine
    assert engine.stats().spec_num_accepted_tokens < engine.stats().spec_num_draft_tokens  # rejections happened
    page_size = engine.kv.page_size
    checked = 0

    def walk(node, tokens, pages):
        nonlocal checked
        for child in node.children.values():
            walk(child, tokens + list(child.key), pages + list(child.pages))
        if node.parent is None or node.children:
            return
        with torch.no_grad():
            cache = model(torch.tensor([tokens]), use_cache=True).past_key_values
        for layer in range(len(model.model.layers)):
            hf_keys = cache.layers[layer].keys[0].transpose(0, 1)  # [T, kv_heads, D]
            ours = engine.kv.k(layer)[torch.tensor(pages)].reshape(len(pages) * page_size, *hf_keys.shape[1:])
            torch.testing.assert_close(ours[: len(tokens)], hf_keys, atol=2e-4, rtol=2e-4)
        checked += len(tokens)

    walk(engine.cache.root, [], [])
    assert checked > sum(len(p) for p in batch)  # the outputs' pages were checked too


# ---- sampling keeps the target's distribution -------------------------------------------------------------------


def penalize(logits: torch.Tensor, prompt: list[int], output: list[int], params: dict) -> torch.Tensor:
    """The three penalties as their definitions state them (sampling_params.py), for the test's expectations."""
    x = logits.clone()
    for t in set(prompt) | set(output):
        x[t] = x[t] / params["repetition_penalty"] if x[t] > 0 else x[t] * params["repetition_penalty"]
    for t in set(output):
        x[t] -= params["presence_penalty"] + params["frequency_penalty"] * output.count(t)
    return x


@pytest.mark.parametrize("penalties, sampler", [(False, "reference"), (True, "reference"), (True, "gpu")])
def test_sampled_tokens_keep_the_target_distribution(checkpoint, monkeypatch, penalties, sampler):
    """Three tokens, top_k = 2 at temperature 1: 8 outcomes whose probabilities Hugging Face's logits give (with
    PENALTIES applied as defined, for the penalized runs). The second and third tokens come from one verify step whose
    draft (the greedy continuation) is right about half the time. Chi-square with 7 degrees of freedom: 24.3 is the
    0.001 quantile; an accepted token past the first mismatch moves the statistic into the hundreds (measured), and
    so does the third token's position not counting the draft token before it (about 1,300 expected, and outcomes
    outside the 8)."""
    path, model = checkpoint
    prompt = prompts(1, seed=9)[0]
    n = 1200
    pen = PENALTIES if penalties else dict(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)

    def top2(output):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + output])).logits[0, -1].double()
        values, ids = penalize(logits, prompt, output, pen).topk(2)
        return ids.tolist(), torch.softmax(values, 0).tolist()

    expected, greedy = {}, []
    ids1, p1 = top2([])
    for a, pa in zip(ids1, p1):
        ids2, p2 = top2([a])
        for b, pb in zip(ids2, p2):
            ids3, p3 = top2([a, b])
            for c, pc in zip(ids3, p3):
                expected[(a, b, c)] = pa * pb * pc
            if not greedy:
                greedy = [ids2[0], ids3[0]]

    class GreedyDraft:
        def propose(self, rid, tokens, num_prompt_tokens, limit):
            return greedy[:limit], 2.0

        def finish(self, rid, tokens, num_prompt_tokens):
            pass

    spec = {"method": "ngram", "num_speculative_tokens": 2, "max_batch_size": 4096, "min_acceptance_rate": 0.0}
    llm = sampler_llm(path, sampler, monkeypatch, spec, max_num_seqs=n, seed=11)
    llm.engine.speculator.drafter = GreedyDraft()
    params = SamplingParams(temperature=1.0, top_k=2, max_tokens=3, ignore_eos=True, **(pen if penalties else {}))
    counts: dict[tuple, int] = {}
    for out in outputs(llm, [prompt] * n, params):
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    stats = llm.engine.stats()
    assert stats.spec_num_drafts > n // 2 and 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert set(counts) <= set(expected)
    chi2 = sum((counts.get(cell, 0) - n * p) ** 2 / (n * p) for cell, p in expected.items())
    assert chi2 < 24.3, (chi2, counts, expected)


# ---- benchmark mode and the suffix cache ------------------------------------------------------------------------


def test_synthetic_acceptance_length(checkpoint):
    path, _ = checkpoint
    spec = {"method": "ngram", "num_speculative_tokens": 3, "synthetic_acceptance_length": 2.5}
    llm = make_llm(path, spec)
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    out = outputs(llm, prompts(2, seed=10), params)
    assert all(len(o) == 120 for o in out)
    stats = llm.engine.stats()
    # Full drafts but for the last steps of each request (max_tokens caps them), and 1.5 accepted per draft.
    assert stats.spec_num_draft_tokens >= 3 * stats.spec_num_drafts - 2 * 3
    assert abs(stats.spec_num_accepted_tokens / stats.spec_num_drafts - 1.5) < 0.05
    # Benchmark mode: requests that rely on sampling's guarantees are refused, naming the field.
    from fastqwen.errors import InvalidRequestError

    for field, extra in (("seed", {"seed": 3}), ("logprobs", {"logprobs": 1})):
        with pytest.raises(InvalidRequestError) as error:
            llm.generate(prompts(1), SamplingParams(max_tokens=4, **extra), use_tqdm=False)
        assert error.value.param == field


def test_replayed_requests_draft_from_the_suffix_cache(checkpoint):
    """The issue's replay test on the CPU path: greedy requests run once, their outputs enter the global suffix
    tree, and the same requests run again with almost every draft accepted."""
    path, _ = checkpoint
    batch = prompts(4, seed=12)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    llm = make_llm(path, {"method": "suffix", "num_speculative_tokens": 5}, enable_prefix_caching=False)
    first = outputs(llm, batch, params)
    before = llm.engine.stats()
    assert outputs(llm, batch, params) == first
    after = llm.engine.stats()
    drafts = after.spec_num_drafts - before.spec_num_drafts
    length = 1 + (after.spec_num_accepted_tokens - before.spec_num_accepted_tokens) / drafts
    assert length >= 3, length


# ---- through the server -----------------------------------------------------------------------------------------


def test_server_streams_accepted_runs_and_exports_the_counters(checkpoint):
    """A real server with --speculative-config: a streamed greedy completion equals the offline output without
    speculation, and /metrics carries vLLM's spec_decode counters."""
    import httpx
    from server_process import ServerProcess

    path, _ = checkpoint
    prompt = prompts(1, seed=14)[0]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    (reference,) = outputs(make_llm(path), [prompt], params)
    spec = '{"method": "suffix", "num_speculative_tokens": 4}'
    server = ServerProcess(path, "--device", "cpu", "--dtype", "float32", "--speculative-config", spec)
    try:
        body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        whole = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
        assert whole["token_ids"] == reference
        text = ""  # the second run drafts from the first one's output: runs of several tokens per delta
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text += httpx.Response(200, content=line[6:]).json()["choices"][0]["text"]
        assert text == whole["text"]
        metrics = httpx.get(server.url + "/metrics").text
        accepted = [
            float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith("fastqwen:spec_decode_num_accepted_tokens_total")
        ]
        assert accepted and accepted[0] > 0, metrics
    finally:
        server.stop()


# ---- the overlap schedule -----------------------------------------------------------------------------------------


def test_overlap_schedule_runs_ahead_only_when_no_request_may_draft():
    """While speculation is on, the next decode step is chosen ahead of this one's tokens only when no running
    request may carry a draft (its draft follows those tokens): requests paused for low acceptance decode with the
    overlap schedule as before; one that may draft stops it, penalties or not (they no longer keep a request from
    drafting)."""
    from fastqwen.config import GenerationDefaults
    from fastqwen.kvcache import PageAllocator
    from fastqwen.scheduler import Request, Scheduler
    from fastqwen.speculative import SpeculativeConfig, Speculator
    from fastqwen.speculative.speculator import ACCEPTANCE_WINDOW

    def request(rid: int) -> Request:
        params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, presence_penalty=0.5)
        params = params.with_defaults(GenerationDefaults())
        return Request(rid=rid, prompt_ids=[5, 6, 7, 8], params=params, arrival=rid)

    def pause(r: Request) -> None:  # a window of rejected drafts
        speculator.propose(r, 2)
        for _ in range(ACCEPTANCE_WINDOW // 2):
            speculator.accepted(r, (1, 1), [2, 2, 2])

    speculator = Speculator(SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2}))
    scheduler = Scheduler(PageAllocator(256), 4, 8, 64, 512, [0], speculator=speculator)
    for rid in range(2):
        scheduler.add(request(rid))
    scheduler.update(scheduler.schedule(), [9, 9])  # prefills
    for r in scheduler.running:
        assert speculator.may_draft(r)
        pause(r)
    decode = scheduler.schedule()
    assert decode.is_decode and not decode.has_drafts
    assert scheduler.schedule_ahead(decode) is not None
    scheduler.update(decode, [9, 9])
    scheduler.add(request(2))  # may draft: its drafts follow its tokens
    scheduler.update(scheduler.schedule(), [9, 9, 9])
    decode = scheduler.schedule()
    assert scheduler.schedule_ahead(decode) is None


def test_requests_near_max_tokens_keep_the_verify_graphs(checkpoint, monkeypatch):
    """Verify graphs take drafts of one length. Near its max_tokens a request's draft is filled up past it (the
    tokens there are computed and dropped, and neither drafted nor accepted in the counters) instead of cut short,
    which ran the whole batch's step eagerly: requests ending at different steps never leave a verify step eager,
    and their greedy outputs are those of decoding without speculation, max_tokens each."""
    path, _ = checkpoint
    batch = prompts(4, seed=21)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (9, 14, 20, 27)]
    reference = outputs(make_llm(path), batch, params)
    assert [len(o) for o in reference] == [9, 14, 20, 27]
    eager_verify_steps = []

    def watch(llm) -> list[int]:
        """Record the verify steps that run eagerly; returns a counter of decode chunks (one per request a step)."""
        runner, scheduler, decodes = llm.engine.runner, llm.engine.scheduler, [0]
        run_eager, update = runner._run_eager, scheduler.update

        def recording(scheduled, *args, **kwargs):
            if scheduled.has_drafts:
                eager_verify_steps.append(len(scheduled.chunks))
            return run_eager(scheduled, *args, **kwargs)

        def counting(scheduled, sampled, **kwargs):
            decodes[0] += sum(c.samples and c.end - c.start == 1 for c in scheduled.chunks)
            return update(scheduled, sampled, **kwargs)

        monkeypatch.setattr(runner, "_run_eager", recording)
        monkeypatch.setattr(scheduler, "update", counting)
        return decodes

    # The outputs' tokens are the prefills' first tokens, one a decode chunk (a verify step's included), and the
    # accepted ones: nothing past max_tokens counted as accepted.
    spec = {"method": "ngram", "num_speculative_tokens": K, "min_acceptance_rate": 0.0}
    llm = sampler_llm(path, "gpu-graphs", monkeypatch, spec)
    llm.engine.speculator.drafter = OracleDrafter({tuple(p): o for p, o in zip(batch, reference)})
    decodes = watch(llm)
    assert outputs(llm, batch, params) == reference
    stats = llm.engine.stats()
    assert llm.engine.runner.verify_graphs.forwards and eager_verify_steps == []
    assert stats.spec_num_accepted_tokens > 0
    assert sum(map(len, reference)) == len(batch) + decodes[0] + stats.spec_num_accepted_tokens
    llm.engine.check_invariants()
    # The same with a benchmark's synthetic acceptance, which accepts whatever is drafted up to its rate.
    spec = {"method": "ngram", "num_speculative_tokens": K, "synthetic_acceptance_length": 3.0}
    llm = sampler_llm(path, "gpu-graphs", monkeypatch, spec)
    decodes = watch(llm)
    lengths = [len(o) for o in outputs(llm, batch, params)]
    stats = llm.engine.stats()
    assert lengths == [9, 14, 20, 27] and eager_verify_steps == []
    assert sum(lengths) == len(batch) + decodes[0] + stats.spec_num_accepted_tokens


def test_requests_paused_for_low_acceptance_keep_the_verify_graphs(checkpoint, monkeypatch):
    """A request paused for low acceptance decodes without a draft; in a step where others draft, it gets a filler
    draft of the graphs' length (never accepted, not counted) so that the step still replays the verify graphs
    instead of running eagerly. Two requests whose drafts are always wrong (paused) beside two whose drafts are right:
    no verify step runs eagerly, fillers were used, greedy outputs equal decoding without speculation, and the
    counters count the real drafts only."""
    path, _ = checkpoint
    batch = prompts(4, seed=22)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    reference = outputs(make_llm(path), batch, params)
    references = {tuple(p): o for p, o in zip(batch, reference)}
    right, wrong = OracleDrafter(references), WrongDrafter(references)

    class Mixed:  # wrong for the first two prompts, right (in part: the oracle's) for the others
        def propose(self, rid, tokens, num_prompt_tokens, limit):
            drafter = wrong if list(tokens[:num_prompt_tokens]) in batch[:2] else right
            return drafter.propose(rid, tokens, num_prompt_tokens, limit)

        def finish(self, rid, tokens, num_prompt_tokens):
            pass

    llm = sampler_llm(path, "gpu-graphs", monkeypatch, {"method": "ngram", "num_speculative_tokens": K})
    engine, runner = llm.engine, llm.engine.runner
    engine.speculator.drafter = Mixed()
    eager_verify_steps, fillers, drafted = [], [0], [0]
    run_eager, launch_replay = runner._run_eager, runner.launch_replay

    def eager(scheduled, *args, **kwargs):
        if scheduled.has_drafts:
            eager_verify_steps.append(len(scheduled.chunks))
        return run_eager(scheduled, *args, **kwargs)

    def replay(scheduled):
        fillers[0] += sum(c.filled_from == 0 for c in scheduled.chunks)
        drafted[0] += sum(bool(c.real_draft) for c in scheduled.chunks)
        return launch_replay(scheduled)

    monkeypatch.setattr(runner, "_run_eager", eager)
    monkeypatch.setattr(runner, "launch_replay", replay)
    assert outputs(llm, batch, params) == reference
    assert eager_verify_steps == [] and fillers[0] > 0
    assert engine.stats().spec_num_drafts == drafted[0]
    engine.check_invariants()


def test_verify_steps_queued_behind_the_host_gate(checkpoint, monkeypatch):
    """With the host gate (ModelRunner.arm_verify), the verify step after the one just launched is queued before its
    drafts exist and opened with its inputs once the host has them; cpu_graphs' StandInHostGate holds what is queued
    behind it until then, as the GPU's stream would. Two requests, one ending early on a stop id (the gate armed for
    two sequences is cancelled: its step runs on padding and is dropped), and one gate opened past its timeout (its
    step ran on padding: collect runs it again): greedy outputs equal decoding without speculation, and the KV
    invariants hold."""
    path, _ = checkpoint
    batch = prompts(2, seed=24)
    plain_params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    first = outputs(make_llm(path), batch, [plain_params] * 2)[0]
    stop = next(t for i, t in enumerate(first) if i >= 16 and t not in first[:i])  # ends request 0 at token i
    params = [dataclasses.replace(plain_params, stop_token_ids=[stop]), plain_params]
    reference = outputs(make_llm(path), batch, params)
    assert len(reference[0]) < 40 and len(reference[1]) == 40
    spec = {"method": "ngram", "num_speculative_tokens": K, "min_acceptance_rate": 0.0}
    monkeypatch.setattr(GateCredit, "COST", 0)  # (the mechanics here; the back-off policy: the test after this one)
    llm = graph_llm(monkeypatch, path, host_gate=True, speculative_config=spec, page_size=4, num_pages=512)
    llm.engine.speculator.drafter = OracleDrafter({tuple(p): o for p, o in zip(batch, reference)})
    runner = llm.engine.runner
    gate = runner._gate
    open_gate, calls = gate.open, [0]

    def third_one_late():
        calls[0] += 1
        gate.time_out_next = calls[0] == 3
        return open_gate()

    monkeypatch.setattr(gate, "open", third_one_late)
    assert outputs(llm, batch, params) == reference
    assert gate.opens >= 5 and gate.timeouts == 1 and runner.num_gate_timeouts == 1
    assert gate.cancels >= 1 and runner.num_gate_cancels == gate.cancels
    assert runner.num_gated_launches == gate.opens + gate.timeouts + gate.cancels
    llm.engine.check_invariants()


def test_sampled_tokens_are_the_same_behind_the_host_gate(checkpoint, monkeypatch):
    """Seeded sampling (temperature 0.8) through verify steps opened behind the host gate draws what the same engine
    draws without it: the gate's sampler rows (GpuSampler.pack_rows) carry each position's seed and step as prepare()
    does."""
    path, _ = checkpoint
    batch = prompts(3, seed=27)
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=40, ignore_eos=True) for i in range(3)
    ]
    spec = {"method": "ngram", "num_speculative_tokens": K, "min_acceptance_rate": 0.0}

    def run(gated: bool):
        monkeypatch.setenv("FASTQWEN_VERIFY_GATE", "1" if gated else "0")
        llm = graph_llm(monkeypatch, path, host_gate=gated, speculative_config=spec, page_size=4, num_pages=512)
        return llm.engine.runner, outputs(llm, batch, params)

    _, reference = run(False)
    runner, out = run(True)
    assert out == reference
    assert runner.num_gate_opens >= 10


def arrivals_every(llm: LLM, batch, params, every: int) -> list[list[int]]:
    """The requests added one every `every` steps while the engine runs; each one's tokens, in arrival order."""
    tokens: dict[int, list[int]] = {}
    pending, steps = list(batch), 0
    while pending or llm.engine.has_unfinished():
        if pending and steps % every == 0:
            tokens[llm.add_request(pending.pop(0), params)] = []
        for update in llm.step():
            tokens[update.request_id] += update.new_token_ids
        steps += 1
    return [tokens[rid] for rid in sorted(tokens)]


def test_an_arrival_waits_one_step_behind_an_armed_gate(checkpoint, monkeypatch):
    """A request arriving while the running batch's next verify step is armed behind the host gate joins one step
    later: that step runs for the batch as armed instead of being cancelled (run on padding) before the arrival's
    prefill. Arrivals every sixth step: no gate cancelled, and the tokens of the engine without the gate (synthetic
    acceptance: the drafts are the outputs)."""
    path, _ = checkpoint
    batch = prompts(20, seed=25)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": K, "synthetic_acceptance_length": 2.0}

    def run(gated: bool):
        monkeypatch.setenv("FASTQWEN_VERIFY_GATE", "1" if gated else "0")
        llm = graph_llm(monkeypatch, path, host_gate=gated, speculative_config=spec, page_size=4, num_pages=512)
        return llm.engine.runner, arrivals_every(llm, batch, params, 6)

    _, reference = run(False)
    runner, out = run(True)
    assert out == reference and all(len(t) == 30 for t in out)
    assert runner.num_gate_opens >= 20 and runner.num_gate_cancels == 0, (
        runner.num_gate_opens,
        runner.num_gate_cancels,
    )


def greedy_behind_the_gate(checkpoint, monkeypatch, seed: int, max_tokens: int):
    """Two greedy requests, their tokens without speculation, and an n-gram engine with the stand-in host gate:
    (llm, batch, params, reference)."""
    path, _ = checkpoint
    batch = prompts(2, seed=seed)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    reference = outputs(make_llm(path), batch, params)
    spec = {"method": "ngram", "num_speculative_tokens": K, "min_acceptance_rate": 0.0}
    llm = graph_llm(monkeypatch, path, host_gate=True, speculative_config=spec, page_size=4, num_pages=512)
    return llm, batch, params, reference


def test_the_host_gate_backs_off_when_its_guesses_fail(checkpoint, monkeypatch):
    """Each cancelled gate wastes a verify step (its step runs on padding), so the engine stops arming once the gate
    has cost more than it saved (GateCredit) and tries again only much later. Every opening made to fail here (the
    runner cancels the gate and launches the step the ordinary way): 2 gates armed over the run, where arming every
    time arms one a verify step; greedy tokens equal decoding without speculation."""
    llm, batch, params, reference = greedy_behind_the_gate(checkpoint, monkeypatch, 28, 60)
    runner = llm.engine.runner

    def failing_open(scheduled, rows):
        gated = runner._gated
        runner.cancel_gate()
        return runner._launch_verify_graph(scheduled, gated.size, rows)

    monkeypatch.setattr(runner, "_open_gate", failing_open)
    assert outputs(llm, batch, params) == reference
    assert runner.num_gate_opens == 0 and 1 <= runner.num_gate_cancels <= 2, runner.num_gate_cancels
    assert llm.engine.num_early_launches >= 10  # (verify steps the gate could have taken)


def test_the_host_gate_is_not_armed_under_tensor_parallelism(checkpoint, monkeypatch):
    """Under tensor parallelism a rank whose gate timed out would run its step on padding while the others run theirs,
    and their collectives would pair different steps: the engine never arms the gate there. One rank standing in for
    several (its ParallelGroup says it is not single; nothing else here depends on it): no gate armed, verify steps
    launched early as before, the same tokens."""
    llm, batch, params, reference = greedy_behind_the_gate(checkpoint, monkeypatch, 26, 30)
    monkeypatch.setattr(type(llm.engine.parallel), "single", property(lambda group: False))
    assert outputs(llm, batch, params) == reference
    assert llm.engine.runner.num_gated_launches == 0 and llm.engine.num_early_launches > 0


def test_the_host_gate_is_not_armed_for_drafts_made_on_the_gpu(checkpoint, monkeypatch):
    """An EAGLE-3 head drafts with kernels queued on the engine's stream: behind a gated verify step they would wait
    for the gate, which waits for their drafts (until it timed out, 50 ms a step). A drafter that says its drafts
    come from the device (Eagle3Drafter does) keeps the gate unarmed; the tokens are the same."""
    from fastqwen.engine.eagle3_drafter import Eagle3Drafter

    assert Eagle3Drafter.drafts_on_device
    llm, batch, params, reference = greedy_behind_the_gate(checkpoint, monkeypatch, 27, 30)
    monkeypatch.setattr(llm.engine.speculator.drafter, "drafts_on_device", True, raising=False)
    assert outputs(llm, batch, params) == reference
    assert llm.engine.runner.num_gated_launches == 0 and llm.engine.num_early_launches > 0


def test_verify_steps_are_launched_before_the_step_returns(checkpoint, penalized, monkeypatch):
    """A verify step's drafts follow the tokens of the step before it, so the overlap schedule cannot launch it ahead
    of them; it is launched as soon as they are recorded, before step() returns them (LLMEngine._launch_next): every
    verify graph replay (stand-ins) happens in the call that recorded the step before it, its chunks start at each
    request's last recorded token, and greedy outputs with penalties equal decoding without speculation. With the
    overlap schedule off, nothing is launched early."""
    path, _ = checkpoint
    batch, params, reference = penalized
    references = {tuple(p): o for p, o in zip(batch, reference)}
    spec = {"method": "ngram", "num_speculative_tokens": K, "min_acceptance_rate": 0.0}
    llm = sampler_llm(path, "gpu-graphs", monkeypatch, spec)
    engine, replays = llm.engine, llm.engine.runner.verify_graphs.forwards
    engine.speculator.drafter = OracleDrafter(references)
    step, early = engine.step, []

    def checked_step():
        before = len(replays)
        output = step()
        ahead = engine._ahead
        if ahead is not None and ahead[1] is not None and ahead[0].has_drafts:
            early.append(len(replays) - before)  # this call replayed it
            for chunk in ahead[0].chunks:  # drafted after this step's tokens were committed
                assert chunk.start == len(chunk.request.token_ids) - 1 and not chunk.request.finished
        return output

    engine.step = checked_step
    assert outputs(llm, batch, params) == reference
    assert early == [1] * len(replays) and len(replays) > 4, (early, len(replays))
    assert engine.num_early_launches >= len(replays)
    llm = sampler_llm(path, "gpu-graphs", monkeypatch, spec, disable_overlap_schedule=True)
    llm.engine.speculator.drafter = OracleDrafter(references)
    assert outputs(llm, batch, params) == reference
    assert llm.engine.num_early_launches == 0 and llm.engine.runner.verify_graphs.forwards


def test_stop_strings_while_the_next_verify_step_is_launched(checkpoint, monkeypatch):
    """Stop strings end requests (the LLM aborts them) while their next verify step is launched already, or chosen and
    left for the next call to run eagerly (every other early-chosen step is made to, as drafts of several lengths
    would): texts and finish reasons equal decoding without speculation, the aborted requests' verify results are
    dropped and their drafts not counted, and every page comes back."""
    path, _ = checkpoint
    batch = prompts(6, seed=15)
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    base = make_llm(path)
    reference = base.generate(batch, long, use_tqdm=False)
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[r.text[k : k + 3]])
        for k, r in zip((8, 12, 16, 20, 24, 28), reference)
    ]
    expected = base.generate(batch, params, use_tqdm=False)
    spec = {"method": "ngram", "num_speculative_tokens": K, "min_acceptance_rate": 0.0}
    llm = sampler_llm(path, "gpu-graphs", monkeypatch, spec)
    engine = llm.engine
    with_oracle(llm, batch, [r.token_ids for r in reference])
    launch_replay, launch_next, calls = engine.runner.launch_replay, engine._launch_next, [0, False]

    def launch_replay_unless_deferred(scheduled):
        return None if calls[1] else launch_replay(scheduled)

    def every_other_deferred(output):
        calls[0] += 1
        calls[1] = calls[0] % 2 == 0
        try:
            return launch_next(output)
        finally:
            calls[1] = False

    engine.runner.launch_replay, engine._launch_next = launch_replay_unless_deferred, every_other_deferred
    abort, in_flight = engine.abort, []

    def recording_abort(rid):
        if engine._ahead is not None and any(c.request.rid == rid for c in engine._ahead[0].chunks):
            in_flight.append("launched" if engine._ahead[1] is not None else "chosen")
        return abort(rid)

    update, live_drafts = engine.scheduler.update, [0]

    def counting_update(scheduled, sampled, **kwargs):  # drafted chunks whose request is still running when recorded
        live_drafts[0] += sum(1 for c in scheduled.chunks if c.draft and not c.request.finished)
        return update(scheduled, sampled, **kwargs)

    engine.abort, engine.scheduler.update = recording_abort, counting_update
    got = llm.generate(batch, params, use_tqdm=False)
    for mine, theirs in zip(got, expected):
        assert mine.text == theirs.text and mine.finish_reason == theirs.finish_reason == "stop"
    assert {"launched", "chosen"} <= set(in_flight), in_flight
    assert engine.stats().spec_num_drafts == live_drafts[0]
    engine.check_invariants()
    allocator = engine.kv.allocator
    assert allocator.num_free() + engine.cache.evictable_pages() == allocator.num_total()


def test_a_failed_early_launch_fails_only_the_next_steps_requests(checkpoint, monkeypatch):
    """The next step is launched inside the call that reports this one: when that launch fails, the requests of the
    next step end with an error, and this step's deltas still go out with theirs (a request that finished in it gets
    its last tokens and finish reason); the engine goes on."""
    path, _ = checkpoint
    batch = prompts(2, seed=17)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    reference = outputs(make_llm(path), batch, params)
    spec = {"method": "ngram", "num_speculative_tokens": K, "min_acceptance_rate": 0.0}
    llm = with_oracle(sampler_llm(path, "gpu-graphs", monkeypatch, spec), batch, reference)
    engine = llm.engine
    resolved = [params.with_defaults(engine.generation_defaults)] * 2
    resolved[0] = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True).with_defaults(
        engine.generation_defaults
    )
    for rid, (prompt, p) in enumerate(zip(batch, resolved)):
        engine.add(EngineRequest(rid=rid, prompt_ids=prompt, params=p, arrival_time=time.monotonic()))
    launch_replay, armed = engine.runner.launch_replay, [False]

    def failing_once(scheduled):
        if armed[0]:
            armed[0] = False
            raise RuntimeError("a launch that fails")
        return launch_replay(scheduled)

    update = engine.scheduler.update

    def arming_update(scheduled, sampled, **kwargs):  # the step that finishes request 0 is followed by a failing launch
        advanced = update(scheduled, sampled, **kwargs)
        armed[0] = armed[0] or any(r.rid == 0 and r.finished for r, _, _ in advanced)
        return advanced

    engine.runner.launch_replay, engine.scheduler.update = failing_once, arming_update
    tokens, finish = {0: [], 1: []}, {}
    while engine.has_unfinished():
        for delta in engine.step().deltas:
            tokens[delta.rid] += delta.new_token_ids
            if delta.finish_reason is not None:
                finish[delta.rid] = delta.finish_reason
    assert tokens[0] == reference[0][:12] and finish[0] == "length"
    assert finish[1] == "error" and 12 <= len(tokens[1]) < 30 and tokens[1] == reference[1][: len(tokens[1])]
    engine.check_invariants()
    assert engine.speculator.stats.num_accepted_tokens > 0


def test_stop_string_inside_an_accepted_run(checkpoint):
    """A stop string that ends inside a run of accepted tokens: the text ends where it would without speculation."""
    path, _ = checkpoint
    batch = prompts(3, seed=15)
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    base = make_llm(path)
    reference = base.generate(batch, long, use_tqdm=False)
    llm = with_oracle(
        make_llm(path, {"method": "ngram", "num_speculative_tokens": 5}), batch, [r.token_ids for r in reference]
    )
    for prompt, ref in zip(batch, reference):
        stop = ref.text[len(ref.text) // 2 : len(ref.text) // 2 + 3]
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])
        (expected,) = base.generate([prompt], params, use_tqdm=False)
        (got,) = llm.generate([prompt], params, use_tqdm=False)
        assert got.text == expected.text and got.finish_reason == expected.finish_reason == "stop"
    assert llm.engine.stats().spec_num_accepted_tokens > 0
    llm.engine.check_invariants()


# ---- grammars -----------------------------------------------------------------------------------------------------


def test_grammar_masks_every_verified_position(tmp_path):
    """Requests with a regex or a JSON schema draft too: drafts are cut to what the grammar allows, and every verified
    position draws under the mask of its own state. Greedy outputs equal decoding without speculation (a position
    drawn without its mask would pick the unconstrained argmax as the target's token after an accepted run), and
    each output matches its grammar."""
    from fastqwen.sampling_params import StructuredOutput
    from test_structured_output import REGEX, SCHEMAS, _write_checkpoint

    folder = str(tmp_path)
    _write_checkpoint(folder)
    knobs = dict(dtype="float32", device="cpu", num_pages=512, page_size=8)
    specs = [StructuredOutput("regex", REGEX), StructuredOutput("json_schema", json.dumps(SCHEMAS[0]))]
    batch = [[(7 * i + j) % 200 + 40 for j in range(12)] for i in range(4)]
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured=specs[i % 2]) for i in range(4)]
    base = LLM(folder, **knobs)
    reference = base.generate(batch, params, use_tqdm=False)
    llm = LLM(folder, speculative_config={"method": "ngram", "num_speculative_tokens": 4}, **knobs)
    with_oracle(llm, batch, [r.token_ids for r in reference])
    out = llm.generate(batch, params, use_tqdm=False)
    assert [o.token_ids for o in out] == [r.token_ids for r in reference]
    for o, spec in zip(out, specs):  # (a JSON answer cut by max_tokens is only a valid prefix)
        if o.finish_reason == "stop":
            assert re.fullmatch(REGEX, o.text) if spec.kind == "regex" else json.loads(o.text) is not None
    # (Whether a corrupted draft token is rejected or cut by the grammar first depends on when each mask was ready,
    # so only accepted runs are asserted: the bonus token after one is what a maskless draft row would get wrong.)
    assert llm.engine.stats().spec_num_accepted_tokens > 0
    llm.engine.check_invariants()


def test_grammar_cut_drafts_keep_the_verify_graphs(tmp_path, monkeypatch):
    """With verify graphs, a draft its grammar cut short is filled up to the graphs' length (the filler never
    accepted nor counted, its positions drawn under the last real position's mask): the steps replay the graphs,
    greedy outputs equal decoding without speculation, and each finished output matches its grammar."""
    from fastqwen.sampling_params import StructuredOutput
    from test_structured_output import REGEX, SCHEMAS, _write_checkpoint

    folder = str(tmp_path)
    _write_checkpoint(folder)
    knobs = dict(num_pages=512, page_size=8)
    specs = [StructuredOutput("regex", REGEX), StructuredOutput("json_schema", json.dumps(SCHEMAS[0]))]
    batch = [[(7 * i + j) % 200 + 40 for j in range(12)] for i in range(4)]
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured=specs[i % 2]) for i in range(4)]
    reference = LLM(folder, dtype="float32", device="cpu", **knobs).generate(batch, params, use_tqdm=False)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "min_acceptance_rate": 0.0}
    llm = graph_llm(monkeypatch, folder, speculative_config=spec, **knobs)
    with_oracle(llm, batch, [r.token_ids for r in reference])
    runner = llm.engine.runner
    eager_verify_steps, cut = [], [0]
    run_eager, launch_replay = runner._run_eager, runner.launch_replay

    def eager(scheduled, *args, **kwargs):
        # (a step that also prefills, a request admitted once its grammar compiled, runs eagerly anyway)
        if scheduled.has_drafts and all(c.end - c.start == 1 for c in scheduled.chunks):
            eager_verify_steps.append(len(scheduled.chunks))
        return run_eager(scheduled, *args, **kwargs)

    def replay(scheduled):
        cut[0] += sum(c.filled_from not in (None, 0) for c in scheduled.chunks)
        return launch_replay(scheduled)

    monkeypatch.setattr(runner, "_run_eager", eager)
    monkeypatch.setattr(runner, "launch_replay", replay)
    out = llm.generate(batch, params, use_tqdm=False)
    assert [o.token_ids for o in out] == [r.token_ids for r in reference]
    for o, spec in zip(out, specs):  # (a JSON answer cut by max_tokens is only a valid prefix)
        if o.finish_reason == "stop":
            assert re.fullmatch(REGEX, o.text) if spec.kind == "regex" else json.loads(o.text) is not None
    assert cut[0] > 0 and eager_verify_steps == [] and runner.verify_graphs.forwards
    assert llm.engine.stats().spec_num_accepted_tokens > 0
    llm.engine.check_invariants()
