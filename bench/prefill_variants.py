"""The Hopper prefill kernel's pipelines (set_paged_attention_prefill_hopper_variant) one process, beside cuDNN's SDPA
on the same causal shapes, each timed REPEATS times interleaved: a quick comparison, and the case Nsight Compute
profiles (bench/gpu_check.sh prefillstalls: the first launches are the first pipeline's own).

    python bench/prefill_variants.py --cases 1:16384 1:32768 --variants 10 11 [--repeats 2]

bench/kernels.py --ops prefill is the full record (every pipeline, FP8 pools, extends, FlashAttention-2)."""

from __future__ import annotations

import argparse

import torch
from common import graph_of, time_fn
from fastqwen.ops import paged_attention_prefill
from fastqwen.ops._native import native
from kernels import DT, HEAD_DIM, HEADS, PAGE, kv_pool, parse_prefill_case


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", type=parse_prefill_case, default=[(1, 16384, 0)])
    ap.add_argument("--variants", nargs="+", type=int, default=[10, 11])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2, help="each pipeline timed this many times, interleaved")
    ap.add_argument("--no-cudnn", action="store_true")
    args = ap.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    default_variant = native().set_paged_attention_prefill_hopper_variant(0)
    try:
        for batch, new, prefix in args.cases:
            total = prefix + new
            pages_each = -(-total // PAGE)
            nbuf = 2
            pool_pages = nbuf * batch * pages_each
            k_cache, v_cache = kv_pool(pool_pages, "bf16")
            tables = torch.randperm(pool_pages, device="cuda").to(torch.int32).view(nbuf, batch, pages_each)
            lens = torch.full((batch,), total, dtype=torch.int32, device="cuda")
            starts = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * new
            qs = torch.randn(nbuf, batch * new, HEADS, HEAD_DIM, device="cuda", dtype=DT)
            outs = torch.empty_like(qs)
            scale = HEAD_DIM**-0.5
            flops = 4 * HEADS * HEAD_DIM * batch * sum(prefix + i + 1 for i in range(new))

            def ours():
                for i in range(nbuf):
                    paged_attention_prefill(qs[i], k_cache, v_cache, starts, tables[i], lens, scale, outs[i], new)

            results: dict[int, list[float]] = {v: [] for v in args.variants}
            for _ in range(args.repeats):
                for variant in args.variants:
                    native().set_paged_attention_prefill_hopper_variant(variant)
                    graph = graph_of(ours)  # (the pipeline is chosen as the launches are captured)
                    us = time_fn(graph.replay, args.iters, queue_ahead=True) / nbuf * 1e3
                    del graph
                    results[variant].append(flops / (us * 1e-6) / 1e12)
            del k_cache, v_cache, qs, outs
            torch.cuda.empty_cache()
            label = f"case {batch}x{new}+{prefix}:"
            cudnn = []
            if not args.no_cudnn and prefix == 0:  # (SDPA's causal mask is top-left: whole prompts only)
                q = torch.randn(nbuf, batch, HEADS, new, HEAD_DIM, device="cuda", dtype=DT)
                k = torch.randn(nbuf, batch, HEADS, total, HEAD_DIM, device="cuda", dtype=DT)
                v = torch.randn_like(k)
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):

                    def sdpa():
                        return [
                            torch.nn.functional.scaled_dot_product_attention(q[i], k[i], v[i], is_causal=True)
                            for i in range(nbuf)
                        ]

                    for _ in range(args.repeats):
                        graph = graph_of(sdpa)
                        us = time_fn(graph.replay, args.iters, queue_ahead=True) / nbuf * 1e3
                        cudnn.append(flops / (us * 1e-6) / 1e12)
                        del graph
                del q, k, v
                torch.cuda.empty_cache()
                print(f"{label} cuDNN {max(cudnn):6.1f} TFLOP/s ({' '.join(f'{x:.0f}' for x in cudnn)})")
            else:
                print(label)
            for variant, xs in results.items():
                ratio = f"  / cuDNN {max(xs) / max(cudnn):.3f}" if cudnn else ""
                print(f"   variant {variant:<3} {max(xs):6.1f} TFLOP/s ({' '.join(f'{x:.0f}' for x in xs)}){ratio}")
    finally:
        native().set_paged_attention_prefill_hopper_variant(default_variant)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
