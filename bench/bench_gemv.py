"""GPU benchmark of the projections at decode batch sizes: the GEMV kernel (bf16 and FP8 weight-only) against cuBLAS
bf16 (F.linear) and the FP8 large-batch path (scaled_mm with per-token scales, or dequantize + GEMM), on Qwen3
projection shapes, batch 1..16. From 2 to 8 tokens the GEMV runs on the tensor cores (csrc/gemv_tc.cu); there
gemv_simt_* is its FMA kernel (csrc/gemv.cu) at the same sizes.

Bytes per call: the weight (FP8: values and block scales), x and out. Weights rotate among enough buffers that they
exceed twice the L2, so the weights come from HBM. Each sample is one CUDA-graph replay of passes over the buffers
(at least MIN_CALLS calls, back to back as in the decode graph), queued behind a spinning kernel so that the host's
submission of the graph is not timed (time_fn's queue_ahead), divided by the number of calls; medians over --iters
samples. --host-timing times as this benchmark did before 2026-11-24 (one pass, the submission inside the sample) for
comparison. Bandwidth is printed as
a fraction of a device-to-device copy of 1 GiB measured in the same run (read + write). At one token it also
times, the same way, a copy that moves as many bytes as the FP8 GEMV (copy_fp8_bytes): what a copy of that size reaches.

    python bench/bench_gemv.py [--presets Qwen3-8B] [--batches 1 2 4 8 16] [--shapes qkv o_proj] [--json out.json]
                               [--iters 30] [--tp 2]   (--tp: one rank's shard of each projection)
                               [--tc-fp8-variants 0 5 7 ...]   (each pipeline of the tensor-core FP8 kernel)
"""

from __future__ import annotations

import argparse
import math
import re
import sys

import torch
from common import copy_bandwidth, graph_of, report, time_fn
from fastqwen.config import ModelConfig
from fastqwen.ops._native import has_cuda_kernels, native
from fastqwen.ops.linear import LinearWeight, _fp8_gemm, fp8_gemm_supported, gemv, linear_silu_and_mul, quantize_fp8
from fastqwen.sharding import Shard

L2_BYTES = 50 * 1024 * 1024
MIN_CALLS = 24  # calls per timed graph: its start on the GPU (a few us) is shared among them as in the decode graph


def shapes(preset: str, tp: int = 1) -> dict[str, tuple[int, int]]:
    """[rows, cols] of each projection on one rank of `tp` (sharding.py's split: its heads, its KV heads or the one
    replicated KV head, its part of the intermediate features, its padded slice of the vocabulary)."""
    cfg = ModelConfig.from_preset(preset)
    shard = Shard(0, tp)
    shard.check(cfg)
    first, end = shard.heads(cfg)
    kv_first, kv_end = shard.kv_heads(cfg)
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = (end - first) * d, (kv_end - kv_first) * d
    i_first, i_end = shard.intermediate(cfg)
    i = i_end - i_first
    return {
        "qkv": (q + 2 * kv, h),
        "o_proj": (h, q),
        "gate_up": (2 * i, h),
        "down": (h, i),
        "lm_head": (shard.vocab_rows(cfg.vocab_size), h),
    }


def weight_bytes(w: LinearWeight) -> int:
    return sum(t.numel() * t.element_size() for t in w.tensors())


def bench_shape(
    rows: int,
    cols: int,
    batches: list[int],
    iters: int,
    copy_gbs: float,
    gate_up: bool = False,
    host_timing: bool = False,
    tc_fp8_variants: tuple[int, ...] = (),
    rows_per_block: tuple[int, ...] = (),
) -> list[dict]:
    """gate_up: also the GEMV with the SiLU-and-mul epilogue (out half as wide), as the MLP runs it. host_timing: one
    pass a graph, the host's submission timed (see the module's doc). tc_fp8_variants: where the FP8 GEMV runs on the
    tensor cores, also each of these pipelines of its kernel (set_gemv_tc_fp8_variant), as gemv_fp8_v{N}.
    rows_per_block: at one token, also the GEMVs with blocks of each of these many weight rows
    (set_gemv_rows_per_block), as gemv_bf16_r{N} and gemv_fp8_r{N}."""
    dense = torch.randn(rows, cols, device="cuda") * 0.02
    nbuf = max(2, math.ceil(2 * L2_BYTES / (rows * cols)))  # the FP8 copies alone exceed twice the L2
    passes = 1 if host_timing else math.ceil(MIN_CALLS / nbuf)
    calls = passes * nbuf
    bf16 = [LinearWeight(dense.to(torch.bfloat16)) for _ in range(nbuf)]
    fp8 = [LinearWeight(*quantize_fp8(dense)) for _ in range(nbuf)]
    del dense
    scaled_mm = fp8_gemm_supported(torch.device("cuda"), torch.bfloat16, fp8[0])
    for w in fp8:
        if scaled_mm:
            from fastqwen.ops.linear import _scaled_mm_weight_scale

            _scaled_mm_weight_scale(w)
    rows_out = []
    for m in batches:
        x = torch.randn(m, cols, device="cuda").to(torch.bfloat16)
        outs = [torch.empty(m, rows, device="cuda", dtype=torch.bfloat16) for _ in range(nbuf)]
        variants = {
            "gemv_bf16": (bf16, lambda w, o: gemv(x, w, o)),
            "cublas_bf16": (bf16, lambda w, o: torch.matmul(x, w.weight.t(), out=o)),
            "gemv_fp8": (fp8, lambda w, o: gemv(x, w, o)),
            "fp8_gemm": (
                fp8,
                (lambda w, o: o.copy_(_fp8_gemm(x, w)))
                if scaled_mm
                else (lambda w, o: torch.matmul(x, w.dequantize(torch.bfloat16).t(), out=o)),
            ),
        }
        if gate_up:
            variants["gemv_silu_bf16"] = (bf16, lambda w, o: linear_silu_and_mul(x, w, gemv_only=True))
            variants["gemv_silu_fp8"] = (fp8, lambda w, o: linear_silu_and_mul(x, w, gemv_only=True))
        if native().gemv_uses_tensor_cores(m, cols, False):  # the GEMV's FMA kernel where the tensor-core one runs
            for name in [v for v in variants if v.startswith("gemv_")]:
                variants[name.replace("gemv_", "gemv_simt_")] = variants[name]
        if native().gemv_uses_tensor_cores(m, cols, True):
            for v in tc_fp8_variants:
                variants[f"gemv_fp8_v{v}"] = variants["gemv_fp8"]
                if gate_up:
                    variants[f"gemv_silu_fp8_v{v}"] = variants["gemv_silu_fp8"]
        if m == 1:
            for r in rows_per_block:
                for name in ("gemv_bf16", "gemv_fp8"):
                    variants[f"{name}_r{r}"] = variants[name]
        row = {"rows": rows, "cols": cols, "batch": m, "fp8_gemm": "scaled_mm" if scaled_mm else "dequantize+cublas"}
        for name, (weights, call) in variants.items():

            def all_passes(weights=weights, call=call):
                for _ in range(passes):
                    for w, o in zip(weights, outs):
                        call(w, o)

            variant = int(name.rsplit("_v", 1)[1]) if "_fp8_v" in name else None
            before = native().set_gemv_tensor_cores("_simt_" not in name)  # read when the graph is captured
            before_variant = native().set_gemv_tc_fp8_variant(variant) if variant is not None else None
            forced = re.search(r"_r(\d)$", name)  # (gemv_bf16_r5: blocks of 5 rows)
            block_rows = int(forced.group(1)) if forced else 0
            before_rows = native().set_gemv_rows_per_block(block_rows)
            try:
                graph = graph_of(all_passes)
            finally:
                native().set_gemv_tensor_cores(before)
                native().set_gemv_rows_per_block(before_rows)
                if before_variant is not None:
                    native().set_gemv_tc_fp8_variant(before_variant)
            ms = time_fn(graph.replay, iters, queue_ahead=not host_timing) / calls
            moved = weight_bytes(weights[0]) + 2 * m * ((rows // 2 if "silu" in name else rows) + cols)
            row[f"{name}_us"] = round(ms * 1e3, 2)
            row[f"{name}_frac_copy"] = round(moved / (ms * 1e-3) / 1e9 / copy_gbs, 3)
        if m == 1:  # a copy moving as many bytes as the FP8 GEMV (half read, half written), timed the same way
            half = weight_bytes(fp8[0]) // 2
            pairs = [
                (
                    torch.empty(half, dtype=torch.uint8, device="cuda"),
                    torch.empty(half, dtype=torch.uint8, device="cuda"),
                )
                for _ in range(nbuf)
            ]
            graph = graph_of(lambda: [d.copy_(s) for _ in range(passes) for s, d in pairs])
            ms = time_fn(graph.replay, iters, queue_ahead=not host_timing) / calls
            row["copy_fp8_bytes_us"] = round(ms * 1e3, 2)
            row["copy_fp8_bytes_frac_copy"] = round(2 * half / (ms * 1e-3) / 1e9 / copy_gbs, 3)
            del pairs, graph
        rows_out.append(row)
        print(row, flush=True)
    return rows_out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["Qwen3-8B"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--shapes", nargs="+", default=None, help="only these projections (qkv o_proj gate_up down lm_head)")
    p.add_argument("--tp", type=int, default=1, help="one rank's shard of each projection at this tensor-parallel size")
    p.add_argument("--shapes-only", action="store_true", help="print the shapes and exit (no GPU needed)")
    p.add_argument("--json", default=None)
    p.add_argument(
        "--rows-per-block",
        type=int,
        nargs="*",
        default=[],
        help="one token: also the GEMVs with blocks of these many weight rows (4, 5, 6; set_gemv_rows_per_block)",
    )
    p.add_argument("--host-timing", action="store_true", help="time as before 2026-11-24 (see above)")
    p.add_argument(
        "--tc-fp8-variants",
        type=int,
        nargs="*",
        default=[],
        help="also these pipelines of the tensor-core FP8 kernel (0 .. GEMV_TC_FP8_PIPELINES - 1, csrc/gemv_tc.cu), as gemv_fp8_v{N}",
    )
    args = p.parse_args()
    if args.shapes_only:
        for preset in args.presets:
            print(preset, f"tp={args.tp}", shapes(preset, args.tp))
        return 0
    if not torch.cuda.is_available() or not has_cuda_kernels():
        print("needs a GPU and the CUDA kernels", file=sys.stderr)
        return 1
    copy_gbs = copy_bandwidth(20, queue_ahead=not args.host_timing)
    result = {
        "device": torch.cuda.get_device_name(),
        "copy_gbs": round(copy_gbs, 1),
        "timing": "host" if args.host_timing else "queued ahead",
        "tp": args.tp,
        "shapes": {},
    }
    for preset in args.presets:
        for name, (rows, cols) in shapes(preset, args.tp).items():
            if args.shapes and name not in args.shapes:
                continue
            key = f"{preset}/{name}" if args.tp == 1 else f"{preset}/tp{args.tp}/{name}"
            print(f"-- {key} [{rows}, {cols}]", flush=True)
            result["shapes"][key] = bench_shape(
                rows,
                cols,
                args.batches,
                args.iters,
                copy_gbs,
                gate_up=name == "gate_up",
                host_timing=args.host_timing,
                tc_fp8_variants=tuple(args.tc_fp8_variants),
                rows_per_block=tuple(args.rows_per_block),
            )
            torch.cuda.empty_cache()
    report(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
