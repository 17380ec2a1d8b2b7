"""Prompt logprobs (SamplingParams.prompt_logprobs) against Hugging Face transformers' log-softmax of the prompt, in
float32: whole prefills, chunked prefills, batches of several requests, and prompts the prefix cache holds."""

from __future__ import annotations

import pytest
import torch
from checkpoints import make_checkpoint
from fastqwen import LLM, InvalidRequestError, SamplingParams

TOL = 1e-4


@pytest.fixture(scope="module")
def hf_and_folder(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("plp"))
    model = make_checkpoint(folder, tied=False, seed=5, max_positions=256)
    return model, folder


def hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab] float64 log-softmax; row p - 1 predicts prompt[p]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def check(model, prompt: list[int], entries, start: int = 0, num_top: int = 0) -> None:
    reference = hf_prompt_logprobs(model, prompt)
    assert len(entries) == len(prompt) - start
    for offset, entry in enumerate(entries):
        position = start + offset
        if position == 0:
            assert entry is None  # nothing precedes the first token
            continue
        row = reference[position - 1]
        assert entry.token == prompt[position]
        assert abs(entry.logprob - row[prompt[position]].item()) < TOL, position
        assert entry.rank == int((row > row[prompt[position]]).sum()) + 1
        top = row.topk(num_top)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert max((abs(lp - ref) for (_, lp), ref in zip(entry.top, top.values.tolist())), default=0) < TOL


@pytest.mark.parametrize("budget", [512, 16, 7])  # whole prefill; chunks of 16 and of 7 tokens
def test_prompt_logprobs_equal_hf(hf_and_folder, budget):
    model, folder = hf_and_folder
    llm = LLM(
        folder,
        dtype="float32",
        device="cpu",
        num_pages=128,
        page_size=4,
        max_num_batched_tokens=budget,
        enable_prefix_caching=False,
    )
    prompts = [list(range(3, 43)), [7, 300, 12, 5, 5, 5, 90], [11]]
    params = [SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=n) for n in (0, 5, 2)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, outputs):
        check(model, prompt, out.prompt_logprobs, num_top=p.prompt_logprobs)
    # Asking for prompt logprobs changes nothing else.
    plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    assert all(o.prompt_logprobs is None for o in plain)


def test_prompt_logprobs_recomputed_over_a_cached_prefix(hf_and_folder):
    model, folder = hf_and_folder
    llm = LLM(folder, dtype="float32", device="cpu", num_pages=128, page_size=4, max_num_batched_tokens=16)
    prompt = list(range(20, 58))
    warm = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[0]
    again = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[0]
    assert warm.num_cached_tokens == 0 and again.num_cached_tokens >= 32  # the cache holds the prompt now
    whole = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3), use_tqdm=False)[0]
    assert whole.num_cached_tokens == 0, "every position's logits are needed: nothing may come from the cache"
    check(model, prompt, whole.prompt_logprobs, num_top=3)
    # From position 21 on only the logits from position 20 on are needed: the first 20 tokens (5 pages) may be reused.
    tail = llm.generate(
        [prompt],
        SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1, prompt_logprobs_start=21),
        use_tqdm=False,
    )[0]
    assert tail.num_cached_tokens == 20
    check(model, prompt, tail.prompt_logprobs, start=21, num_top=1)
    assert whole.token_ids == tail.token_ids == warm.token_ids


def test_prompt_logprobs_survive_preemption(hf_and_folder):
    """A pool too small for all at once: requests are preempted mid-prefill and recomputed, and still every prompt
    position gets exactly one logprob."""
    model, folder = hf_and_folder
    llm = LLM(folder, dtype="float32", device="cpu", num_pages=24, page_size=4, max_num_batched_tokens=12)
    prompts = [[(i * 7 + k) % 380 + 1 for k in range(30)] for i in range(4)]
    outputs = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, prompt_logprobs=1), use_tqdm=False
    )
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outputs):
        check(model, prompt, out.prompt_logprobs, num_top=1)


def test_prompt_logprobs_bounds(hf_and_folder):
    _, folder = hf_and_folder
    llm = LLM(folder, dtype="float32", device="cpu", num_pages=32, page_size=4)
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(prompt_logprobs=21)
    assert err.value.param == "prompt_logprobs"
    with pytest.raises(InvalidRequestError, match="only 3 tokens") as err:
        llm.generate([[1, 2, 3]], SamplingParams(prompt_logprobs=0, prompt_logprobs_start=3), use_tqdm=False)
    assert err.value.param == "prompt_logprobs"
