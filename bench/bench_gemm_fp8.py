"""GPU benchmark of the FP8 projections at decode batch sizes (issue 47): fastqwen's FP8 path as the engine calls it
against cuBLAS's FP8 GEMM alone and the bf16 GEMM, on a model's four projections (qkv, o_proj, gate_up, down: N and K
from its config), M = 16 to 512 tokens.

Variants (per shape and M):
  engine       ops.linear(x, w) on the FP8 weight, as a decode step calls it: above FP8_GEMV_MAX_TOKENS tokens the
               activations are quantized per token and 128 columns (quantize_fp8_tokens), then cuBLASLt's
               block-scaled GEMM runs through F.scaled_mm (the path taken is recorded in the row)
  quantize     that activation quantizer alone (bf16 x -> e4m3 and its 1x128 scales): the engine's part outside the GEMM
  fp8_block    F.scaled_mm on the already quantized activations with the engine's scales (1x128 on x, the
               checkpoint's 128x128 blocks on W): cuBLAS's block-scaled GEMM alone
  fp8_tensor   torch._scaled_mm on the same e4m3 weight bytes with per-tensor scales (x quantized with one scale),
               the scaling cuBLAS runs fastest; not the model's numerics (128x128 block scales have no per-tensor
               form), a bar for the GEMM alone. fp8_tensor_fast: the same with use_fast_accum (Hopper's faster,
               less precise accumulation, the per-tensor setting vLLM uses)
  fp8_rowwise  torch._scaled_mm on the same weight bytes with a scale per token of x (quantized so) and one per
               output row of W (ones here): the scaling a per-channel FP8 model would take (not the model's numerics,
               as fp8_tensor); whether cuBLAS/CUTLASS runs it at the per-tensor speed decides whether an on-load
               quantization with scales per output row could leave the block-scaled GEMM behind
  bf16         torch.matmul with the bf16 weight: cuBLAS's bf16 GEMM, what dense weights run
  bf16_lt      the same through cuBLASLt (torch.backends.cuda.preferred_blas_library("cublaslt") while it is
               captured): whether its heuristics pick faster kernels at these shapes than cuBLAS's (issue 47: the bf16
               projections at M = 256 took 1.3-1.7x their bound on the H100)
Every variant's output is checked against a float32 reference of its own inputs before it is timed.

Bytes per call (gemm_work): the compulsory ones, each once: W (FP8: its values and float32 block scales), x read at its
dtype (bf16 for engine, quantize and bf16; e4m3 and its scales for the fp8_* GEMMs), out written in bf16 (quantize:
e4m3 values and scales); the per-tensor scalars are left out. FLOPs: 2 M N K (quantize: none counted). Each variant
is reported as time, TFLOP/s, GB/s and the fraction of a 1 GiB device-to-device copy's rate, and against its bound:
the larger of its bytes at that copy rate and its FLOPs at a GEMM of 8192^3 of its dtype (bf16, or e4m3 per-tensor;
step_account.gemm_tflops), both measured in this run. At small M the weight read dominates: bandwidth-bound.

Timing as bench_gemv.py: weights rotate among enough copies that the FP8 copies alone exceed twice the L2; a sample is
one CUDA-graph replay of at least MIN_CALLS calls, queued ahead of the GPU (common.time_fn), divided by the calls;
medians over --iters samples.

    python bench/bench_gemm_fp8.py [--presets Qwen3-8B] [--batches 16 32 64 128 256 512] [--shapes qkv o_proj]
                                   [--iters 30] [--json out.json]
    python bench/bench_gemm_fp8.py --work-only    # the bytes and FLOPs only, on the CPU
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn.functional as F
from bench_gemv import shapes
from common import report
from fastqwen.ops.linear import FP8_BLOCK as BLOCK  # 1x128 scales on activations, 128x128 on weights
from fastqwen.ops.linear import FP8_MAX

L2_BYTES = 50 * 1024 * 1024
MIN_CALLS = 24  # calls per timed graph (bench_gemv.py's reason: the graph's start is shared among them)
PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")  # the FP8 layers' projections (the LM head stays bf16)
VARIANTS = ("engine", "quantize", "fp8_block", "fp8_tensor", "fp8_tensor_fast", "fp8_rowwise", "bf16", "bf16_lt")
BATCHES = [16, 32, 64, 128, 256, 512]
# A variant's result against its reference (relative Frobenius error) must stay under this; the engine's includes
# the activations' rounding to e4m3 (the bar linear's own probe uses), the others only the output's rounding to bf16,
# but for fast accumulation, whose narrower accumulator can lose more over K = 12,288 (its error is recorded).
MAX_ERROR = {
    "engine": 0.1,
    "fp8_block": 0.01,
    "fp8_tensor": 0.01,
    "fp8_tensor_fast": 0.05,
    "fp8_rowwise": 0.01,
    "bf16": 0.01,
    "bf16_lt": 0.01,
}


def gemm_work(variant: str, m: int, n: int, k: int) -> dict[str, int]:
    """Compulsory bytes and FLOPs of one call of `variant` (see the module's doc) for out [m, n] = x [m, k] @ W^T."""
    weight_scales = 4 * -(-n // BLOCK) * -(-k // BLOCK)  # float32, one per 128x128 block
    x_scales = 4 * m * -(-k // BLOCK)  # float32, one per token and 128 columns
    out = 2 * m * n
    flops = 2 * m * n * k
    if variant == "engine":
        return {"bytes": n * k + weight_scales + 2 * m * k + out, "flops": flops}
    if variant == "quantize":
        return {"bytes": 2 * m * k + m * k + x_scales, "flops": 0}
    if variant == "fp8_block":
        return {"bytes": n * k + weight_scales + m * k + x_scales + out, "flops": flops}
    if variant in ("fp8_tensor", "fp8_tensor_fast"):
        return {"bytes": n * k + m * k + out, "flops": flops}
    if variant == "fp8_rowwise":  # float32 scales: one per token, one per output row
        return {"bytes": n * k + m * k + 4 * m + 4 * n + out, "flops": flops}
    if variant in ("bf16", "bf16_lt"):
        return {"bytes": 2 * n * k + 2 * m * k + out, "flops": flops}
    raise ValueError(f"unknown variant {variant!r}; one of {VARIANTS}")


def bound_us(work: dict[str, int], copy_gbs: float, tflops: float) -> float:
    """The larger of the bytes at the copy rate and the FLOPs at the GEMM rate, in microseconds."""
    return max(work["bytes"] / (copy_gbs * 1e9), work["flops"] / (tflops * 1e12)) * 1e6


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def weight_copies(n: int, k: int, copies: int, device: str):
    """`copies` bf16 weights [n, k] and as many FP8 LinearWeights (128x128 block scales) of the same values, made
    ready as the engine makes them (prepare_linear: scaled_mm probed, its scale layout built)."""
    from fastqwen.ops.linear import LinearWeight, prepare_linear, quantize_fp8

    dense = torch.randn(n, k, device=device) * 0.02
    bf16 = [dense.to(torch.bfloat16) for _ in range(copies)]
    fp8 = [LinearWeight(*quantize_fp8(dense)) for _ in range(copies)]
    prepare_linear(fp8, torch.bfloat16, torch.device(device))
    return bf16, fp8


def variants_at(x: torch.Tensor, bf16: list, fp8: list) -> tuple[str, dict]:
    """The engine's path for x, and per variant (weights, call(weight), reference() or None): every call computes
    x @ W^T for one weight copy as that variant does; reference() is float32 math on the same (quantized) inputs as
    the call on the first copy."""
    from fastqwen.ops.linear import (
        _quantize_for_gemm,
        _scaled_mm_weight_scale,
        fp8_gemm_supported,
        gemv_kernel_applies,
        linear,
        linear_reference,
    )

    m, k = x.shape
    padded = -(-m // 16) * 16  # cuBLASLt's FP8 alignment of the token count, padded as ops.linear pads it
    xq, x_scale = _quantize_for_gemm(x, padded)
    amax = x.float().abs().amax().clamp_min(1e-12)
    x_tensor = (x.float() * (FP8_MAX / amax)).to(torch.float8_e4m3fn)  # per-tensor: one scale, amax / 448
    x_tensor = F.pad(x_tensor.view(torch.uint8), (0, 0, 0, padded - m)).view(torch.float8_e4m3fn)
    x_tensor_scale = (amax / FP8_MAX).float()
    one = torch.ones((), device=x.device)
    row_amax = x.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12)  # per token: amax / 448
    x_row = (x.float() * (FP8_MAX / row_amax)).to(torch.float8_e4m3fn)
    x_row = F.pad(x_row.view(torch.uint8), (0, 0, 0, padded - m)).view(torch.float8_e4m3fn)
    x_row_scale = F.pad(row_amax / FP8_MAX, (0, 0, 0, padded - m), value=1.0).float()
    w_row_scale = torch.ones(1, fp8[0].weight.shape[0], device=x.device)
    if not x.is_cuda:
        path = "linear_reference (no GPU)"
    elif gemv_kernel_applies(x, fp8[0]):
        path = "gemv"
    elif fp8_gemm_supported(x.device, x.dtype, fp8[0]):
        path = "quantize_fp8_tokens + scaled_mm 1x128 x 128x128"
    else:
        path = "dequantize + cuBLAS bf16"

    def block_scaled(w):
        return F.scaled_mm(
            xq,
            w.weight.t(),
            x_scale,
            F.ScalingType.BlockWise1x128,
            _scaled_mm_weight_scale(w),
            F.ScalingType.BlockWise128x128,
            output_dtype=torch.bfloat16,
        )[:m]

    def tensor_scaled(w, fast=False):
        return torch._scaled_mm(
            x_tensor, w.weight.t(), x_tensor_scale, one, out_dtype=torch.bfloat16, use_fast_accum=fast
        )[:m]

    def tensor_reference():
        return (x_tensor[:m].float() * x_tensor_scale) @ fp8[0].weight.float().t()

    def rowwise(w):
        return torch._scaled_mm(x_row, w.weight.t(), x_row_scale, w_row_scale, out_dtype=torch.bfloat16)[:m]

    def rowwise_reference():
        return (x_row[:m].float() * x_row_scale[:m]) @ (fp8[0].weight.float() * w_row_scale.t()).t()

    return path, {
        "engine": (fp8, lambda w: linear(x, w), lambda: linear_reference(x, fp8[0])),
        "quantize": (fp8, lambda w: _quantize_for_gemm(x, padded), None),
        "fp8_block": (
            fp8,
            block_scaled,
            lambda: (xq[:m].float().view(m, -1, BLOCK) * x_scale[:m, :, None]).reshape(m, k) @ fp8[0].dequantize().t(),
        ),
        "fp8_tensor": (fp8, tensor_scaled, tensor_reference),
        "fp8_tensor_fast": (fp8, lambda w: tensor_scaled(w, fast=True), tensor_reference),
        "fp8_rowwise": (fp8, rowwise, rowwise_reference),
        "bf16": (bf16, lambda w: torch.matmul(x, w.t()), lambda: x.float() @ bf16[0].float().t()),
        "bf16_lt": (bf16, through_cublaslt(lambda w: torch.matmul(x, w.t())), lambda: x.float() @ bf16[0].float().t()),
    }


def through_cublaslt(call):
    """call with torch's preferred BLAS library set to cuBLASLt for its duration (a graph keeps the kernels chosen
    while it was captured); on the CPU (the tests), call as it is."""

    def lt_call(w):
        if not w.is_cuda:
            return call(w)
        before = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            return call(w)
        finally:
            torch.backends.cuda.preferred_blas_library(before)

    return lt_call


def checked(name: str, weights: list, call, reference) -> float | None:
    """The variant's relative error on the first copy against its reference (None: no reference); RuntimeError
    where it exceeds MAX_ERROR[name]."""
    if reference is None:
        return None
    error = relative_error(call(weights[0]), reference())
    if not error < MAX_ERROR[name]:
        raise RuntimeError(f"{name}: wrong result, relative error {error:.4f} >= {MAX_ERROR[name]}")
    return error


def bench_shape(
    n: int, k: int, batches: list[int], iters: int, copy_gbs: float, tflops: dict[str, float]
) -> list[dict]:
    """Every variant at every M for out [M, n] = x [M, k] @ W^T; a variant that fails records its error instead."""
    from common import graph_of, time_fn

    copies = max(2, math.ceil(2 * L2_BYTES / (n * k)))  # the FP8 copies alone exceed twice the L2
    passes = math.ceil(MIN_CALLS / copies)
    calls = passes * copies
    bf16, fp8 = weight_copies(n, k, copies, "cuda")
    rows = []
    for m in batches:
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        path, variants = variants_at(x, bf16, fp8)
        row = {"n": n, "k": k, "m": m, "engine_path": path}
        for name, (weights, call, reference) in variants.items():
            try:
                error = checked(name, weights, call, reference)
                if error is not None:
                    row[f"{name}_error"] = round(error, 5)

                def all_calls(weights=weights, call=call):
                    for _ in range(passes):
                        for w in weights:
                            call(w)

                graph = graph_of(all_calls)
                us = time_fn(graph.replay, iters, queue_ahead=True) / calls * 1e3
                del graph
            except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:  # a cuBLAS/torch that refuses it
                row[f"{name}_failed"] = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
                continue
            work = gemm_work(name, m, n, k)
            rate = tflops["bf16" if name.startswith("bf16") else "fp8"]
            row[f"{name}_us"] = round(us, 2)
            row[f"{name}_tflops"] = round(work["flops"] / (us * 1e-6) / 1e12, 1)
            row[f"{name}_gbs"] = round(work["bytes"] / (us * 1e-6) / 1e9, 1)
            row[f"{name}_frac_copy"] = round(work["bytes"] / (us * 1e-6) / 1e9 / copy_gbs, 3)
            row[f"{name}_of_bound"] = round(bound_us(work, copy_gbs, rate) / us, 3)
        for other in ("fp8_block", "fp8_tensor_fast", "fp8_rowwise", "bf16", "bf16_lt"):  # > 1: the engine is faster
            if "engine_us" in row and f"{other}_us" in row:
                row[f"{other}_over_engine"] = round(row[f"{other}_us"] / row["engine_us"], 3)
        rows.append(row)
        print(summary_line(row), flush=True)
        del x, variants
    del bf16, fp8
    torch.cuda.empty_cache()
    return rows


def summary_line(row: dict) -> str:
    def cell(name: str) -> str:
        if f"{name}_us" not in row:
            return f"{name} failed"
        return (
            f"{name} {row[f'{name}_us']:.1f} us {row[f'{name}_frac_copy']:.0%} copy {row[f'{name}_of_bound']:.0%} bound"
        )

    return f"  M={row['m']:<4} | " + " | ".join(cell(v) for v in VARIANTS)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["Qwen3-8B"])
    p.add_argument("--batches", type=int, nargs="+", default=BATCHES, help="token counts M")
    p.add_argument("--shapes", nargs="+", default=list(PROJECTIONS), choices=PROJECTIONS)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--work-only", action="store_true", help="print each row's bytes and FLOPs, time nothing (CPU)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if min(args.batches) < 1:
        p.error("--batches: token counts must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape_of = {f"{preset}/{name}": shapes(preset)[name] for preset in args.presets for name in args.shapes}
    if args.work_only:
        work = {
            key: {str(m): {v: gemm_work(v, m, n, k) for v in VARIANTS} for m in args.batches}
            for key, (n, k) in shape_of.items()
        }
        report({"work": work}, args.json)
        return 0
    from fastqwen.ops._native import has_cuda_kernels

    if not torch.cuda.is_available() or not has_cuda_kernels():
        print("bench_gemm_fp8.py: needs a GPU and the CUDA kernels (--work-only runs on the CPU)", file=sys.stderr)
        return 1
    from common import copy_bandwidth
    from step_account import gemm_tflops  # the GEMM rates step_account.py bounds the projections with

    copy_gbs = copy_bandwidth(20)
    tflops = {"bf16": gemm_tflops(20), "fp8": gemm_tflops(20, fp8=True)}
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_gbs": round(copy_gbs, 1),
        "gemm_tflops": {key: round(value, 1) for key, value in tflops.items()},
        "shapes": {},
    }
    print(f"copy {copy_gbs:.0f} GB/s, GEMM 8192^3: bf16 {tflops['bf16']:.0f}, FP8 {tflops['fp8']:.0f} TFLOP/s")
    for key, (n, k) in shape_of.items():
        print(f"-- {key}: N={n} K={k}", flush=True)
        result["shapes"][key] = bench_shape(n, k, args.batches, args.iters, copy_gbs, tflops)
    report(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
