"""A driver for Nsight Compute: the GEMV at one token on Qwen3-8B's projection shapes, FP8 and bf16, each called
--calls times (ncu profiles each launch alone, caches flushed). The kernels' own numbers (duration, DRAM
throughput, stall reasons) come from ncu, not from this script:

    ncu --clock-control none -k regex:gemv --section SpeedOfLight --section WarpStateStats \
        python bench/ncu_gemv.py [--calls 2]
"""

from __future__ import annotations

import argparse
import sys

import torch

from fastqwen.config import ModelConfig
from fastqwen.ops.linear import LinearWeight, gemv, linear_silu_and_mul, quantize_fp8


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="Qwen3-8B")
    p.add_argument("--calls", type=int, default=2)
    p.add_argument("--kinds", nargs="+", default=["fp8", "bf16"])
    args = p.parse_args()
    cfg = ModelConfig.from_preset(args.preset)
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    shapes = {"qkv": (q + 2 * kv, h), "o_proj": (h, q), "gate_up": (2 * i, h), "down": (h, i)}
    for kind in args.kinds:
        for name, (rows, cols) in shapes.items():
            dense = torch.randn(rows, cols, device="cuda") * 0.02
            w = LinearWeight(*quantize_fp8(dense)) if kind == "fp8" else LinearWeight(dense.to(torch.bfloat16))
            del dense
            x = torch.randn(1, cols, device="cuda").to(torch.bfloat16)
            for _ in range(args.calls):
                if name == "gate_up":
                    linear_silu_and_mul(x, w, gemv_only=True)
                else:
                    gemv(x, w)
            torch.cuda.synchronize()
            print(f"{kind} {name} [{rows}, {cols}]: {args.calls} calls", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
