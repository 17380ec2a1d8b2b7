"""The prefill attention kernel between a layer's projections, as a chunked prefill runs it, against the same kernel
alone: does its rate in the engine (bench/latency.py --ttft-profile, per chunk) differ from bench/kernels.py's
because of what runs around it (clocks after the GEMMs, L2 contents) rather than its shape?

Each case is a CUDA graph of `--layers` Qwen3-8B layers' projections at `new` tokens (qkv, o, gate_up, down through
F.linear on [out, in] weights, as the engine's prefill), with and without the attention call between qkv and o; the
attention's time in the layer is the difference, next to the attention graph alone. The three take turns
(common.interleaved_medians), for our kernel and for cuDNN's SDPA on the same shapes (bench/kernels.py's
sdpa_prefill_graphs inputs). What it found (bench/results/current/long-context.md): in the engine the kernel runs at
the lower clocks the 700 W power cap leaves it, not slower for what runs around it.

    python bench/prefill_in_layer.py --cases 1:8192:0 1:8192:16384 [--json out.json]"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from common import graph_of, interleaved_medians
from fastqwen import ops
from kernels import parse_prefill_case, prefill_case, sdpa_prefill_graphs
from torch.nn.attention import SDPBackend, sdpa_kernel

HIDDEN, QKV, INTER = 4096, 6144, 12288  # Qwen3-8B


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", type=parse_prefill_case, default=[(1, 8192, 0), (1, 8192, 16384)])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--pages",
        choices=["scattered", "in-order"],
        default="scattered",
        help="the KV pages of the sequence scattered over the pool (bench/kernels.py) or one after the other, as a "
        "fresh prompt gets them from the engine's allocator",
    )
    ap.add_argument(
        "--engine-ops",
        action="store_true",
        help="the layer's other kernels too, as the engine runs them: the two fused_add_rms_norm, qk_norm_rope_store_kv "
        "(which writes the chunk's q and its K/V into the pages the attention then reads) and silu_and_mul",
    )
    ap.add_argument(
        "--settle-ms",
        type=float,
        default=200.0,
        help="untimed replays of each graph before its samples in a round, about this long (common.interleaved_medians)",
    )
    ap.add_argument("--json")
    args = ap.parse_args()

    rows = []
    for batch, new, prefix in args.cases:
        case = prefill_case(batch, new, prefix, nbuf=1)
        if args.pages == "in-order":
            case.tables.copy_(torch.arange(case.tables.numel(), device="cuda", dtype=torch.int32).view_as(case.tables))
        tokens = batch * new
        dt = case.qs.dtype
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=dt)
        w_qkv, w_o, w_gu, w_down = (
            torch.randn(outputs, inputs, device="cuda", dtype=dt) * 0.02
            for outputs, inputs in ((QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER))
        )
        _, _, (q, k, v, mask_kw) = sdpa_prefill_graphs(case, names=())

        def ours() -> None:
            case.call(0)

        def cudnn() -> None:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                torch.nn.functional.scaled_dot_product_attention(q[0], k[0], v[0], **mask_kw)

        hidden, residual = torch.randn_like(x), torch.randn_like(x)
        norm_w = torch.ones(HIDDEN, device="cuda", dtype=dt)
        head_norm_w = torch.ones(case.qs.shape[-1], device="cuda", dtype=dt)
        cos_sin = ops.rope_cos_sin_cache(case.qs.shape[-1], prefix + new, 1e6, torch.device("cuda"))
        positions = (prefix + torch.arange(new, device="cuda")).repeat(batch)
        # the chunk's slots in each sequence's pages (the rows of case.tables[0])
        page = case.k_cache.shape[1]
        pages = case.tables[0].long().gather(1, (positions.view(batch, new) // page))
        out_slots = (pages * page + positions.view(batch, new) % page).view(-1)
        act = torch.empty(tokens, INTER, device="cuda", dtype=dt)

        for name, attention in (("ours", ours), ("cudnn", cudnn)):

            def layers(with_attention: bool) -> None:
                for _ in range(args.layers):
                    if args.engine_ops:
                        ops.fused_add_rms_norm(hidden, residual, norm_w, 1e-6)
                    qkv = F.linear(x, w_qkv)
                    if args.engine_ops:
                        ops.qk_norm_rope_store_kv(qkv, head_norm_w, head_norm_w, cos_sin, positions,
                                                  case.k_cache, case.v_cache, out_slots, 1e-6, q_out=case.qs[0])  # fmt: skip
                    if with_attention:
                        attention()
                    F.linear(case.outs[0].view(tokens, -1), w_o)
                    if args.engine_ops:
                        ops.fused_add_rms_norm(hidden, residual, norm_w, 1e-6)
                    gu = F.linear(x, w_gu)
                    if args.engine_ops:
                        ops.silu_and_mul(gu, out=act)
                    F.linear(act if args.engine_ops else gu[:, :INTER], w_down)

            def attention_alone() -> None:
                for _ in range(args.layers):
                    attention()

            graphs = {
                "attention": graph_of(attention_alone),
                "layers": graph_of(lambda: layers(True)),
                "projections": graph_of(lambda: layers(False)),
            }
            ms = interleaved_medians(graphs, args.iters, args.rounds, args.settle_ms)
            graphs.clear()
            alone = ms["attention"] / args.layers
            in_layer = (ms["layers"] - ms["projections"]) / args.layers
            row = {
                "kernel": name,
                "batch": batch,
                "new": new,
                "prefix": prefix,
                "pages": args.pages,
                "engine_ops": args.engine_ops,
                "attention_alone_ms": alone,
                "attention_in_layer_ms": in_layer,
                "alone_tflops": case.flops / (alone * 1e9),
                "in_layer_tflops": case.flops / (in_layer * 1e9),
                "projections_ms_per_layer": ms["projections"] / args.layers,
            }
            rows.append(row)
            print(
                f"{name:5} B={batch} new={new} prefix={prefix}: attention alone {alone:.3f} ms "
                f"({row['alone_tflops']:.0f} TFLOP/s), between the projections {in_layer:.3f} ms "
                f"({row['in_layer_tflops']:.0f} TFLOP/s); projections {row['projections_ms_per_layer']:.3f} ms a layer",
                flush=True,
            )
        del case, x, w_qkv, w_o, w_gu, w_down, q, k, v
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
