"""One FP8 GEMV case run eagerly a few times, for Nsight Compute (gpu_check.sh's gemvprofile stage): Qwen3-8B's
projection SHAPE at M tokens with the tensor-core kernel's FP8 pipeline VARIANT (csrc/gemv_tc.cu; ignored at one
token, which runs gemv.cu's one-token kernel). Eight calls over two weight copies larger than the L2 together, so that
ncu's `--launch-skip 4 --launch-count 1` sees a call whose weights come from HBM.

    python bench/gemv_ncu_case.py --shape gate_up --m 4 --variant 13
"""

from __future__ import annotations

import argparse

import torch
from bench_gemv import shapes
from fastqwen.ops._native import native
from fastqwen.ops.linear import LinearWeight, gemv, linear_silu_and_mul, quantize_fp8


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="gate_up")
    p.add_argument("--m", type=int, default=4)
    p.add_argument("--variant", type=int, default=None)
    args = p.parse_args()
    rows, cols = shapes("Qwen3-8B")[args.shape]
    dense = torch.randn(rows, cols, device="cuda") * 0.02
    weights = [LinearWeight(*quantize_fp8(dense)) for _ in range(2)]
    x = torch.randn(args.m, cols, device="cuda").to(torch.bfloat16)
    if args.variant is not None:
        native().set_gemv_tc_fp8_variant(args.variant)
    for i in range(8):
        w = weights[i % 2]
        if args.shape == "gate_up":
            linear_silu_and_mul(x, w, gemv_only=True)
        else:
            gemv(x, w, torch.empty(args.m, rows, device="cuda", dtype=torch.bfloat16))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
