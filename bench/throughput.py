"""Offline throughput: output tokens per second for a batch of requests, through LLM.generate.

Workloads: `random` = N requests with input and output lengths uniform in [100, 1024] (the benchmark mini-sglang
and nano-vllm publish), `fixed` = N requests of --input-len in / --output-len out. Prompts are random token ids,
every request runs to its output length (ignore_eos). --hf adds Hugging Face transformers' static-batch generate
on the first --hf-requests requests of the same workload as the baseline.

The run's steps are accounted too (`steps` in the JSON): the time between one step's end and the next's charged to
the later step, split into decode-only steps (every token computed is an output token) and steps with prefill work,
with the decode-only steps' median: where the run's rate falls short of the batch over its decode step (issue 47).

    python bench/throughput.py --model Qwen3-8B --load-format dummy --workload random --num-prompts 256 [--json out]
    python bench/throughput.py --model Qwen3-8B --load-format dummy --workload fixed --num-prompts 1024 \
        --input-len 128 --output-len 1024
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time

import torch
from common import add_decode_attention_options, apply_decode_attention_options, hf_model_like, report
from fastqwen import LLM, SamplingParams
from fastqwen.config import EngineConfig


def workload(args, vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(args.seed)
    if args.workload == "random":
        ins = [rng.randint(100, 1024) for _ in range(args.num_prompts)]
        outs = [rng.randint(100, 1024) for _ in range(args.num_prompts)]
    else:
        ins, outs = [args.input_len] * args.num_prompts, [args.output_len] * args.num_prompts
    return [[rng.randrange(vocab) for _ in range(n)] for n in ins], outs


def step_breakdown(start: float, steps: list[tuple[float, int, int]]) -> dict:
    """steps: (end time, tokens computed, tokens output) of each engine step in order; start: when the run began (the
    same clock). The time since the step before (or the start) is charged to each step: "decode_only" when it
    computed no more tokens than it output, else "with_prefill"."""
    kinds = {"decode_only": [0, 0.0, 0], "with_prefill": [0, 0.0, 0]}
    decode_durations = []
    last = start
    for end, computed, output in steps:
        kind = "with_prefill" if computed > output else "decode_only"
        duration, last = end - last, end
        kinds[kind][0] += 1
        kinds[kind][1] += duration
        kinds[kind][2] += output
        if kind == "decode_only":
            decode_durations.append(duration)
    result = {name: {"steps": n, "seconds": round(s, 4), "output_tokens": t} for name, (n, s, t) in kinds.items()}
    result["decode_step_median_ms"] = round(statistics.median(decode_durations) * 1e3, 3) if decode_durations else None
    return result


def recording_steps(engine) -> list[tuple[float, int, int]]:
    """Wraps engine.step to append each StepOutput's (time, tokens computed, tokens output) to the returned list."""
    steps: list[tuple[float, int, int]] = []
    step = engine.step

    def recorded():
        out = step()
        steps.append((out.time, out.num_tokens, sum(len(d.new_token_ids) for d in out.deltas)))
        return out

    engine.step = recorded
    return steps


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def hf_throughput(model_name: str, prompts: list[list[int]], outs: list[int], device: str) -> float:
    """Output tok/s of transformers' generate, one static batch (left-padded, the longest output for all rows)."""
    model = hf_model_like(model_name, device)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    new = max(outs)
    sync()
    start = time.perf_counter()
    model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    sync()
    # Only the tokens each request asked for count as useful output.
    return sum(outs) / (time.perf_counter() - start)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineConfig.add_cli_arguments(p, model="Qwen3-8B", load_format="dummy", max_model_len=4096)
    p.add_argument("--workload", choices=["random", "fixed"], default="random")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--hf", action="store_true")
    p.add_argument("--hf-requests", type=int, default=32)
    add_decode_attention_options(p)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    apply_decode_attention_options(args)
    llm = LLM(EngineConfig.from_cli(args))
    prompts, outs = workload(args, llm.engine.config.vocab_size)
    llm.generate([prompts[0][:16]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outs]
    steps = recording_steps(llm.engine)
    sync()
    start, start_monotonic = time.perf_counter(), time.monotonic()  # (steps end on the monotonic clock)
    results = llm.generate(prompts, params, use_tqdm=False)
    sync()
    elapsed = time.perf_counter() - start
    output_tokens = sum(r.num_completion_tokens for r in results)
    device = llm.engine.device
    result = {
        "model": args.model,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "workload": args.workload,
        "num_prompts": args.num_prompts,
        "input_tokens": sum(len(p) for p in prompts),
        "output_tokens": output_tokens,
        "elapsed_s": elapsed,
        "output_tok_s": output_tokens / elapsed,
        "preemptions": llm.engine.scheduler.num_preemptions,
        "overlap": llm.engine.overlap,
        "steps_launched_ahead": llm.engine.num_ahead_steps,
        "steps": step_breakdown(start_monotonic, steps),
    }
    del llm, results
    gc.collect()  # the engine's GPU memory must be gone before the baseline builds its own model
    torch.cuda.empty_cache()
    if args.hf:
        n = min(args.hf_requests, len(prompts))
        result["hf_output_tok_s"] = hf_throughput(args.model, prompts[:n], outs[:n], str(device))
        result["hf_requests"] = n
    report(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
