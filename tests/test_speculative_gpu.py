"""Speculative decoding on the GPU: verify steps replayed from their CUDA graphs (forward and sampler) give the
greedy tokens of decoding without speculation, with ngram, suffix and a half-wrong oracle drafter; logprobs are the
target's; the KV ownership invariant holds; synthetic acceptance runs the verify graphs at every captured size."""

from __future__ import annotations

import random

import pytest
import torch
from checkpoints import make_checkpoint
from fastqwen import LLM, SamplingParams
from test_speculative import OracleDrafter

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

K = 3


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("spec_gpu"))
    # Sharp logits (logit_scale 8): the verify step runs other kernels than a decode step (prefill attention, the
    # tensor-core GEMV at 4 tokens), whose bf16 rounding must not flip a near-tie of the greedy argmax.
    make_checkpoint(
        folder,
        tied=False,
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
        hidden=256,
        intermediate=512,
        layers=4,
        dtype=torch.bfloat16,
        logit_scale=8.0,
        seed=13,
    )
    return folder


def make_llm(folder: str, spec: dict | None = None) -> LLM:
    return LLM(
        folder,
        dtype="bfloat16",
        device="cuda",
        page_size=16,
        num_pages=1024,
        max_num_seqs=32,
        cuda_graph_max_bs=32,
        speculative_config=spec,
    )


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randrange(8, 40))] for _ in range(n)]


def count_verify_replays(llm: LLM) -> list[int]:
    runner, counter = llm.engine.runner, [0]
    launch = runner._launch_verify_graph

    def counting(scheduled, size):
        counter[0] += 1
        return launch(scheduled, size)

    runner._launch_verify_graph = counting
    return counter


@pytest.mark.parametrize("method", ["ngram", "suffix", "oracle"])
def test_greedy_tokens_and_logprobs_unchanged_with_verify_graphs(folder, method):
    batch = prompts(12, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=2)
    base = make_llm(folder)
    reference = base.generate(batch, params, use_tqdm=False)
    del base
    spec = {"method": "suffix" if method == "suffix" else "ngram", "num_speculative_tokens": K}
    llm = make_llm(folder, spec)
    assert llm.engine.runner.verify_graphs is not None
    if method == "oracle":
        llm.engine.speculator.drafter = OracleDrafter({tuple(p): o.token_ids for p, o in zip(batch, reference)})
    replays = count_verify_replays(llm)
    out = llm.generate(batch, params, use_tqdm=False)
    assert [o.token_ids for o in out] == [o.token_ids for o in reference]
    assert replays[0] > 0
    stats = llm.engine.stats()
    assert stats.spec_num_accepted_tokens > 0
    # The logprobs of every token are the target's (other kernels: bf16 rounding, measured below 0.02).
    for mine, theirs in zip(out, reference):
        assert len(mine.logprobs) == len(theirs.logprobs)
        for a, b in zip(mine.logprobs, theirs.logprobs):
            assert a.token == b.token and abs(a.logprob - b.logprob) < 0.05
    llm.engine.check_invariants()


def test_synthetic_acceptance_runs_every_verify_size(folder):
    spec = {"method": "ngram", "num_speculative_tokens": K, "synthetic_acceptance_length": 2.0}
    llm = make_llm(folder, spec)
    graphs = llm.engine.runner.verify_graphs
    replays = count_verify_replays(llm)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for n in (1, 3, 16):
        out = llm.generate(prompts(n, seed=n), params, use_tqdm=False)
        assert all(len(o.token_ids) == 40 for o in out)
    assert replays[0] > 0 and graphs.max_bs == 16
    stats = llm.engine.stats()
    assert abs(stats.spec_num_accepted_tokens / stats.spec_num_drafts - 1.0) < 0.05
    llm.engine.check_invariants()


def test_seeded_sampling_draws_what_plain_decoding_draws(folder):
    """A seeded draw is a function of the seed, the step and the logits: each verified position draws with its own
    step's seed, so seeded requests get the tokens plain decoding gives them (the sharp model keeps the kernels'
    rounding differences away from the draw's boundaries), and the same tokens run to run."""
    spec = {"method": "ngram", "num_speculative_tokens": K}
    batch = prompts(6, seed=5)
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=48, seed=100 + i) for i in range(6)]
    base = make_llm(folder)
    reference = [o.token_ids for o in base.generate(batch, params, use_tqdm=False)]
    del base
    llm = make_llm(folder, spec)
    first = [o.token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    second = [o.token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    assert first == second
    assert first == reference
    assert llm.engine.stats().spec_num_accepted_tokens > 0
