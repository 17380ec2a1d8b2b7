"""Where the time of a batch-1 decode step goes: the host time of each part of LLMEngine.step, next to the GPU time
of the step's work (CUDA events from the batch upload to the sampled tokens).

    python bench/profile_step.py --model Qwen3-8B --load-format dummy [--disable-cuda-graph] [--json out]

Parts (medians over the decode steps, milliseconds of host time):
  schedule     Scheduler.schedule: pick the batch, allocate pages
  build        fill the pinned staging buffer and enqueue its one upload
  launch       enqueue the forward: one graph replay, or every kernel of the eager forward
  sample       enqueue penalties / sampling
  read_back    enqueue the token copy and wait for it: this is where the host waits for the GPU
  update       Scheduler.update, stop checks, detokenization, building the step's updates
The host is the bottleneck when gpu_ms is close to the step time minus read_back's wait, i.e. when the GPU finishes
soon after the last launch; with graphs the launch part should be tens of microseconds.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

import torch

from fastqwen import LLM, SamplingParams

from common import report


def timed(store: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            store.setdefault(name, []).append(time.perf_counter() - start)

    return wrapper


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="Qwen3-8B")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--batch", type=int, default=1, help="decode batch size (that many requests at once)")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")  # the capture's time and memory
    llm = LLM(args.model, load_format=args.load_format, max_model_len=8192, disable_cuda_graph=args.disable_cuda_graph)
    engine = llm.engine
    runner, scheduler = engine.runner, engine.scheduler
    times: dict[str, list[float]] = {}
    gpu_ms: list[float] = []
    scheduler.schedule = timed(times, "schedule", scheduler.schedule)
    runner._build = timed(times, "build", runner._build)
    runner.run_model = timed(times, "launch", runner.run_model)
    read_back = runner._read_back

    def read_back_with_gpu_time(tokens):
        end.record()
        out = read_back(tokens)
        gpu_ms.append(begin.elapsed_time(end))
        return out

    runner._read_back = timed(times, "read_back", read_back_with_gpu_time)
    step = runner.step
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    batch_sizes: list[int] = []

    def step_with_begin(scheduled):
        begin.record()
        batch_sizes.append(len(scheduled.chunks) if scheduled.is_decode else -1)
        return step(scheduled)

    runner.step = timed(times, "runner_step", step_with_begin)
    engine.step = timed(times, "engine_step", engine.step)

    prompts = [[(7 * i + 13 * b) % engine.config.vocab_size for i in range(args.prompt_len)] for b in range(args.batch)]
    for _ in range(2):  # the first run warms up
        batch_sizes.clear()
        for prompt in prompts:
            engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=args.steps + 1, ignore_eos=True))
        while not batch_sizes or batch_sizes[-1] != args.batch:  # prefill (eager, chunked) until all decode
            engine.step()
        for values in times.values():  # profile the decode steps only
            values.clear()
        gpu_ms.clear()
        while engine.has_unfinished():
            engine.step()

    def median_ms(name: str, skip_first: bool = True) -> float:
        return statistics.median(times[name][1:] if skip_first else times[name]) * 1e3

    parts = {name: median_ms(name) for name in ("schedule", "build", "launch", "read_back")}
    parts["sample"] = statistics.median(
        r - b - l - rb for r, b, l, rb in zip(times["runner_step"], times["build"], times["launch"], times["read_back"])
    ) * 1e3  # fmt: skip
    parts["update"] = statistics.median(e - s - r for e, s, r in zip(times["engine_step"], times["schedule"], times["runner_step"])) * 1e3
    result = {
        "model": args.model,
        "device": torch.cuda.get_device_name(),
        "cuda_graph": not args.disable_cuda_graph and runner.graphs is not None,
        "prompt_tokens": args.prompt_len,
        "batch": args.batch,
        "decode_steps": len(times["engine_step"]) - 1,
        "step_ms": median_ms("engine_step"),
        "gpu_ms": statistics.median(gpu_ms[1:]),
        "host_ms": {k: round(v, 4) for k, v in parts.items()},
    }
    # Host time outside the wait for the GPU: what a step costs beyond the GPU's own work at batch 1.
    result["host_ms_excluding_wait"] = round(sum(v for k, v in parts.items() if k != "read_back"), 4)
    report(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
