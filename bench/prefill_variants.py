"""The Hopper prefill kernel's pipelines (set_paged_attention_prefill_hopper_variant) in one process, beside cuDNN's
SDPA on the same shapes, each timed REPEATS times interleaved: a quick comparison, and the case Nsight Compute
profiles (bench/gpu_check.sh prefillstalls: the first launches are the first pipeline's own).

    python bench/prefill_variants.py --cases 1:16384 1:32768 --variants 10 11 [--repeats 2]

bench/kernels.py --ops prefill is the full record (every pipeline, FP8 pools, extends, FlashAttention-2)."""

from __future__ import annotations

import argparse

import torch
from common import graph_of, time_fn
from fastqwen.ops._native import native
from kernels import parse_prefill_case, prefill_case, sdpa_prefill_graphs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", type=parse_prefill_case, default=[(1, 16384, 0)])
    ap.add_argument("--variants", nargs="+", type=int, default=[10, 11])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2, help="each pipeline timed this many times, interleaved")
    ap.add_argument("--no-cudnn", action="store_true")
    args = ap.parse_args()

    def tflops(graph, flops: int, nbuf: int) -> float:
        us = time_fn(graph.replay, args.iters, queue_ahead=True) / nbuf * 1e3
        return flops / (us * 1e-6) / 1e12

    default_variant = native().set_paged_attention_prefill_hopper_variant(0)
    try:
        for batch, new, prefix in args.cases:
            case = prefill_case(batch, new, prefix)
            results: dict[int, list[float]] = {v: [] for v in args.variants}
            for _ in range(args.repeats):
                for variant in args.variants:
                    native().set_paged_attention_prefill_hopper_variant(variant)
                    graph = graph_of(case.run)  # (the pipeline is chosen as the launches are captured)
                    results[variant].append(tflops(graph, case.flops, case.nbuf))
                    del graph
            cudnn = []
            if not args.no_cudnn:
                graphs, errors, inputs = sdpa_prefill_graphs(case, names=("cudnn",))
                if "cudnn" in graphs:
                    cudnn = [tflops(graphs["cudnn"], case.flops, case.nbuf) for _ in range(args.repeats)]
                else:
                    print(f"cuDNN refused: {errors.get('cudnn')}")
                del graphs, inputs
            print(f"case {batch}x{new}+{prefix}:" + (f" cuDNN {max(cudnn):6.1f} TFLOP/s" if cudnn else ""))
            for variant, xs in results.items():
                ratio = f"  / cuDNN {max(xs) / max(cudnn):.3f}" if cudnn else ""
                print(f"   variant {variant:<3} {max(xs):6.1f} TFLOP/s ({' '.join(f'{x:.0f}' for x in xs)}){ratio}")
            del case
            torch.cuda.empty_cache()
    finally:
        native().set_paged_attention_prefill_hopper_variant(default_variant)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
