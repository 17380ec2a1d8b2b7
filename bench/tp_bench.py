"""The custom all-reduce against NCCL's at decode message sizes, on 2 GPUs (or --world N): microseconds per call,
each timed as 100 calls replayed from one CUDA graph (as decode runs them), the median of rank 0's replays.

In the same run, what a decoder layer does after o_proj and down: the custom all-reduce followed by the separate
fused_add_rms_norm kernel (what the engine runs for steps of more than 32 tokens) against the all-reduce fused with
the residual add and RMSNorm (custom_all_reduce_add_rms_norm, the engine's choice up to 32 tokens unless
FASTQWEN_FUSED_ALLREDUCE_NORM=0; timed here whatever it says), and the norm kernel alone for reference. Rows: batch 1..256, hidden 4096 (Qwen3-8B) and 5120 (Qwen3-32B).

Then, at one token, a row-parallel projection (o_proj and down at the shard shapes of Qwen3-8B / Qwen3-32B, bf16 and
FP8 weights) with the all-reduce + norm after it, as a decoder layer runs them: the GEMV writing its output then the
fused kernel sending it (gemv_then_fused), the GEMV storing its rows into the receive buffers itself and the fused
kernel only summing (gemv_sends: FASTQWEN_GEMV_SENDS's path, timed here whatever it says), and the GEMV alone.

The engine-level figures of the tensor-parallel bars come from the existing benchmarks, which take --tp:
    python bench/latency.py --model Qwen3-32B --load-format dummy --tp 2 --prompt-lens 128   # TPOT and its limit
    python bench/throughput.py --model Qwen3-32B --load-format dummy --tp 2 --workload fixed \\
        --num-prompts 256 --input-len 128 --output-len 1024
(latency.py's limit is rank 0's weight bytes, half the model's at TP=2, over the copy bandwidth measured in the run.)

    python bench/tp_bench.py [--world 2] [--hidden 4096 5120] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import statistics
import sys

import torch

BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
CALLS_PER_GRAPH = 100
EPS = 1e-6


def _time_in_graph(group, call) -> float:
    """Microseconds per call: CALLS_PER_GRAPH calls captured in one CUDA graph, the median of 20 replays, the ranks
    starting each replay together."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            call()
    group.barrier()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        group.barrier()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS_PER_GRAPH)
    del graph
    return round(statistics.median(times), 2)


def _rank(rank: int, world: int, port: int, hiddens: list[int], results) -> None:
    import torch.distributed as dist
    from fastqwen import ops
    from fastqwen.ops.collectives import ParallelGroup

    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["FASTQWEN_GEMV_SENDS"] = "1"  # (the send target, for the pairs below; the model is not used here)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, datetime.timedelta(seconds=120))
    group = ParallelGroup.connect(rank, world, store, device)
    custom = group.custom
    rows = []
    for hidden in hiddens:
        weight = (torch.rand(hidden, device=device) + 0.5).to(torch.bfloat16)
        for batch in BATCHES:
            # The values drift as the calls repeat in place (the residual grows); the time does not depend on them.
            x = torch.randn(batch, hidden, device=device).to(torch.bfloat16)
            residual = torch.randn(batch, hidden, device=device).to(torch.bfloat16)
            row = {"hidden": hidden, "batch": batch, "bytes": x.numel() * x.element_size()}
            paths = {
                "nccl": lambda: group.device_group.allreduce([x]).wait(),
                "norm": lambda: ops.fused_add_rms_norm(x, residual, weight, EPS),  # the kernel alone, no exchange
            }
            if custom is not None and custom.applies(x):
                paths["custom"] = lambda: custom(x)
                paths["custom_then_norm"] = lambda: ops.fused_add_rms_norm(custom(x), residual, weight, EPS)
            if custom is not None and custom.applies_with_norm(x, residual, weight):
                paths["fused_norm"] = lambda: custom.all_reduce_add_rms_norm(x, residual, weight, EPS)
            for name, call in paths.items():
                row[f"{name}_us"] = _time_in_graph(group, call)
            if "custom_us" in row:
                row["nccl_over_custom"] = round(row["nccl_us"] / row["custom_us"], 2)
            if "fused_norm_us" in row:
                row["separate_over_fused"] = round(row["custom_then_norm_us"] / row["fused_norm_us"], 2)
            rows.append(row)
    pairs = _projection_pairs(group, device, world, hiddens)
    group.barrier()
    if rank == 0:
        results.put((rows, pairs))
    group.close()


# hidden -> the preset whose row-parallel projections the pairs take (their inputs split over the ranks)
PRESETS = {4096: "Qwen3-8B", 5120: "Qwen3-32B"}


def _projection_pairs(group, device, world: int, hiddens: list[int]) -> list[dict]:
    """One token: each row-parallel projection's GEMV with the fused all-reduce + norm after it, unsent and sent."""
    from fastqwen.config import ModelConfig
    from fastqwen.ops.linear import LinearWeight, gemv, quantize_fp8

    custom = group.custom
    rows = []
    for hidden in hiddens:
        if hidden not in PRESETS or custom is None or custom.send_target is None:
            continue
        cfg = ModelConfig.from_preset(PRESETS[hidden])
        weight = (torch.rand(hidden, device=device) + 0.5).to(torch.bfloat16)
        residual = torch.randn(1, hidden, device=device).to(torch.bfloat16)
        for name, k in (("o_proj", cfg.q_size // world), ("down", cfg.intermediate_size // world)):
            dense = torch.randn(hidden, k, device=device) * 0.02
            x = torch.randn(1, k, device=device).to(torch.bfloat16)
            out = torch.empty(1, hidden, device=device, dtype=torch.bfloat16)
            for fp8 in (False, True):
                w = LinearWeight(*quantize_fp8(dense)) if fp8 else LinearWeight(dense.to(torch.bfloat16))

                def sends(w=w):
                    sent_out, sent = group.linear_to_all_reduce(x, w)
                    assert sent, "the GEMV did not send"
                    group.all_reduce_add_rms_norm(sent_out, residual, weight, EPS, sent=True)

                paths = {
                    "gemv_alone": lambda w=w: gemv(x, w, out),
                    "gemv_then_fused": lambda w=w: custom.all_reduce_add_rms_norm(
                        gemv(x, w, out), residual, weight, EPS
                    ),
                    "gemv_sends": sends,
                }
                row = {"preset": PRESETS[hidden], "projection": name, "shape": [hidden, k], "fp8": fp8}
                for path, call in paths.items():
                    row[f"{path}_us"] = _time_in_graph(group, call)
                row["unsent_over_sent"] = round(row["gemv_then_fused_us"] / row["gemv_sends_us"], 3)
                rows.append(row)
    return rows


def _table(rows: list[dict]) -> str:
    columns = ["hidden", "batch", "nccl_us", "custom_us", "norm_us", "custom_then_norm_us", "fused_norm_us"]
    columns.append("separate_over_fused")
    lines = ["  ".join(f"{c:>19}" for c in columns)]
    for row in rows:
        lines.append("  ".join(f"{row.get(c, '-')!s:>19}" for c in columns))
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument(
        "--hidden", type=int, nargs="+", default=[4096, 5120], help="hidden sizes (Qwen3-8B: 4096, Qwen3-32B: 5120)"
    )
    p.add_argument("--port", type=int, default=29511)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if torch.cuda.device_count() < args.world:
        print(f"needs {args.world} GPUs, {torch.cuda.device_count()} visible", file=sys.stderr)
        return 1
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, args.world, args.port, args.hidden, results)) for r in range(args.world)
    ]
    for proc in procs:
        proc.start()
    rows, pairs = results.get(timeout=600)
    for proc in procs:
        proc.join(60)
    out = {
        "device": torch.cuda.get_device_name(0),
        "world": args.world,
        "hidden": args.hidden,
        "dtype": "bfloat16",
        "calls_per_graph": CALLS_PER_GRAPH,
        "rows": rows,
        "projection_pairs": pairs,
    }
    print(_table(rows))
    for pair in pairs:
        print(pair)
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
