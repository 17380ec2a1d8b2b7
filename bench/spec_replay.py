"""Issue 42's replay test on a GPU: greedy requests run once with suffix decoding, their outputs enter the global suffix
cache, and the same requests run again. A greedy second pass computes what the first did, so its drafts (the first
pass's outputs) come true as long as each position's logits are the same bits whichever row of a verify step
computes it: its acceptance length (1 + accepted drafts per verify step) and its time per output token against
the first pass's, each request alone (batch 1), as vLLM and SGLang report TPOT ((end - first token) / (tokens - 1)).

    python bench/spec_replay.py --model Qwen3-8B --load-format dummy [--requests 4] [--new-tokens 256]
                                [--speculative-config '{"method": "suffix", "num_speculative_tokens": 5}'] [--json out]

Bar (issue 42): second pass acceptance length >= 3 and time per token at least 2x better than the first pass.

The default config never pauses drafting (min_acceptance_rate 0): with random weights the first pass's drafts all
fail, and a paused request decodes with the one-token kernels (the FMA GEMV, decode attention) while the second pass
verifies with the verify step's (the tensor-core GEMV, prefill attention). The two round differently, and random
weights' flat logits turn that into a different greedy token within a few steps, after which the cache stops
matching. Never paused, every decoded position of both passes is a row of a verify step (a short draft is filled up
with the last token when verify steps replay CUDA graphs), so the second pass can repeat the first. Compare the
first pass with speculation off too (gpu_check.sh's specreplay stage runs bench/latency.py beside it).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys

import torch
from common import report
from fastqwen import LLM
from fastqwen.config import EngineConfig
from latency import engine_latency

DEFAULT_SPEC = '{"method": "suffix", "num_speculative_tokens": 5, "min_acceptance_rate": 0}'


def one_pass(llm: LLM, prompts: list[list[int]], new_tokens: int) -> dict:
    """Each prompt alone; the pass's median TPOT, its acceptance length from the engine's counters, and the outputs."""
    before = llm.engine.stats()
    outputs = [[] for _ in prompts]
    tpots = [engine_latency(llm, prompt, new_tokens, out)["tpot_mean_ms"] for prompt, out in zip(prompts, outputs)]
    after = llm.engine.stats()
    drafts = after.spec_num_drafts - before.spec_num_drafts
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    return {
        "tpot_ms": statistics.median(tpots),
        "tpot_runs_ms": [round(t, 4) for t in tpots],
        "verify_steps": drafts,
        "acceptance_length": 1 + accepted / drafts if drafts else None,
        "outputs": outputs,
    }


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two outputs differ (None when equal): a second pass that leaves the first one's path
    cannot be drafted from the cache after that point."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineConfig.add_cli_arguments(p, model="Qwen3-8B", load_format="dummy", max_model_len=4096)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.speculative_config is None:
        args.speculative_config = DEFAULT_SPEC
    args.enable_prefix_caching = False  # (the second pass's prompts would be cached: its TTFT is not what is compared)
    llm = LLM(EngineConfig.from_cli(args))
    vocab = llm.engine.config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    engine_latency(llm, [1] * 16, 4)  # warm-up
    first = one_pass(llm, prompts, args.new_tokens)
    second = one_pass(llm, prompts, args.new_tokens)
    result = {
        "model": args.model,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "speculative_config": json.loads(args.speculative_config),
        "requests": args.requests,
        "new_tokens": args.new_tokens,
        "first": first,
        "second": second,
        "speedup": first["tpot_ms"] / second["tpot_ms"],
        "first_difference": [first_difference(a, b) for a, b in zip(first["outputs"], second["outputs"])],
    }
    for name in ("first", "second"):
        r = result[name]
        print(f"{name:6} pass: TPOT {r['tpot_ms']:.3f} ms, acceptance length {r['acceptance_length']}", flush=True)
    print(f"second pass {result['speedup']:.2f}x faster per token", flush=True)
    print(f"first difference between the passes' outputs, per request: {result['first_difference']}", flush=True)
    report(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
