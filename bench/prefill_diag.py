"""EXPERIMENT (issue 48): the Hopper prefill kernel under switches read from the environment at each launch
(FASTQWEN_PREFILL_SECTION, FASTQWEN_PREFILL_DIAG, FASTQWEN_PREFILL_POLY; VARIANT=n picks a pipeline), beside cuDNN's SDPA on the same shapes, in one process.

    python bench/prefill_diag.py --cases 1:16384 1:32768 --configs base SECTION=2 DIAG=1

A config is `base` or comma-separated NAME=VALUE pairs (NAME without the FASTQWEN_PREFILL_ prefix). DIAG bit 0 skips
the softmax and bit 1 reads each K/V tile as one 128-key box (both give wrong outputs: timing only)."""

from __future__ import annotations

import argparse
import os

import torch
from common import graph_of, time_fn
from fastqwen.ops import paged_attention_prefill
from fastqwen.ops._native import native
from kernels import DT, HEAD_DIM, HEADS, PAGE, kv_pool, parse_prefill_case

SWITCHES = ("SECTION", "DIAG", "POLY")


def set_config(config: str, default_variant: int) -> None:
    for name in SWITCHES:
        os.environ.pop("FASTQWEN_PREFILL_" + name, None)
    native().set_paged_attention_prefill_hopper_variant(default_variant)
    if config == "base":
        return
    for pair in config.split(","):
        name, value = pair.split("=")
        if name == "VARIANT":
            native().set_paged_attention_prefill_hopper_variant(int(value))
            continue
        assert name in SWITCHES, name
        os.environ["FASTQWEN_PREFILL_" + name] = value


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", type=parse_prefill_case, default=[(1, 16384, 0)])
    ap.add_argument("--configs", nargs="+", default=["base"])
    ap.add_argument("--variant", type=int, default=None)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2, help="each config timed this many times, interleaved")
    args = ap.parse_args()
    default_variant = native().set_paged_attention_prefill_hopper_variant(0)
    if args.variant is not None:
        default_variant = args.variant
    native().set_paged_attention_prefill_hopper_variant(default_variant)
    from torch.nn.attention import SDPBackend, sdpa_kernel

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

        results: dict[str, list[float]] = {c: [] for c in args.configs}
        for _ in range(args.repeats):
            for config in args.configs:
                set_config(config, default_variant)
                graph = graph_of(ours)  # the switches are read as the launches are captured
                us = time_fn(graph.replay, args.iters, queue_ahead=True) / nbuf * 1e3
                del graph
                results[config].append(flops / (us * 1e-6) / 1e12)
        set_config("base", default_variant)
        del k_cache, v_cache, qs, outs
        torch.cuda.empty_cache()
        if prefix:  # (SDPA's causal mask here is top-left: only whole prompts are compared)
            for config, xs in results.items():
                print(
                    f"case {batch}x{new}+{prefix}: {config:<24} {max(xs):6.1f} TFLOP/s ({' '.join(f'{x:.0f}' for x in xs)})"
                )
            continue
        q = torch.randn(nbuf, batch, HEADS, new, HEAD_DIM, device="cuda", dtype=DT)
        k = torch.randn(nbuf, batch, HEADS, total, HEAD_DIM, device="cuda", dtype=DT)
        v = torch.randn_like(k)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):

            def sdpa():
                return [
                    torch.nn.functional.scaled_dot_product_attention(q[i], k[i], v[i], is_causal=True)
                    for i in range(nbuf)
                ]

            cudnn = []
            for _ in range(args.repeats):
                graph = graph_of(sdpa)
                cudnn.append(flops / (time_fn(graph.replay, args.iters, queue_ahead=True) / nbuf * 1e-3) / 1e12)
                del graph
        del q, k, v
        torch.cuda.empty_cache()
        line = f"case {batch}x{new}+{prefix}: cuDNN {max(cudnn):6.1f} ({' '.join(f'{x:.0f}' for x in cudnn)})"
        print(line)
        for config, xs in results.items():
            print(
                f"   {config:<24} {max(xs):6.1f} TFLOP/s  ({' '.join(f'{x:.0f}' for x in xs)})  / cuDNN {max(xs) / max(cudnn):.3f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
