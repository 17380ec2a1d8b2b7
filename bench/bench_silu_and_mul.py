"""GPU benchmark of silu_and_mul (bf16) against the PyTorch reference F.silu(gate) * up.

Per call the op moves 3 * d * rows * 2 bytes (reads gate and up, writes out). Inputs
rotate among enough buffers that their total exceeds twice the L2 (50 MB on H100), so
timings are from HBM, not L2. Times are medians over >= 50 samples; each sample is one
CUDA-graph replay of a pass over all the buffers (GPU time without Python launch
overhead), divided by the number of calls. "eager" is the same pass launched from
Python (includes launch overhead; what a non-graph step sees). Bandwidth is compared
with a device-to-device copy of a 1 GiB buffer measured in the same run (read + write).

    python bench/bench_silu_and_mul.py [--json out.json] [--iters 50]
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
import torch.nn.functional as F
from common import copy_bandwidth, graph_of, time_fn
from fastqwen.ops._native import has_cuda_kernels
from fastqwen.ops.activation import silu_and_mul, silu_and_mul_reference

L2_BYTES = 50 * 1024 * 1024


def bench_shape(rows: int, d: int, dtype: torch.dtype, iters: int, copy_gbs: float) -> dict:
    elem = torch.tensor([], dtype=dtype).element_size()
    bytes_per_call = 3 * d * rows * elem
    nbuf = max(2, math.ceil(2 * L2_BYTES / bytes_per_call))
    xs_pool = torch.randn(nbuf * rows, 2 * d, device="cuda", dtype=dtype)
    out_pool = torch.empty(nbuf * rows, d, device="cuda", dtype=dtype)
    xs = [xs_pool[i * rows : (i + 1) * rows] for i in range(nbuf)]
    outs = [out_pool[i * rows : (i + 1) * rows] for i in range(nbuf)]

    # sanity: kernel vs reference on one buffer
    silu_and_mul(xs[0], outs[0])
    torch.testing.assert_close(outs[0], silu_and_mul_reference(xs[0]), rtol=1e-2, atol=1e-2)

    def ours():
        for x, o in zip(xs, outs):
            silu_and_mul(x, o)

    def ref():
        for x, o in zip(xs, outs):
            torch.mul(F.silu(x[:, :d]), x[:, d:], out=o)

    res = {
        "rows": rows,
        "d": d,
        "dtype": str(dtype).replace("torch.", ""),
        "buffers": nbuf,
        "bytes_per_call": bytes_per_call,
    }
    for name, fn in (("ours", ours), ("ref", ref)):
        g = graph_of(fn)
        ms = time_fn(g.replay, iters, queue_ahead=True) / nbuf
        res[f"{name}_us"] = ms * 1e3
        res[f"{name}_gbs"] = bytes_per_call / (ms * 1e-3) / 1e9
        res[f"{name}_frac_copy"] = res[f"{name}_gbs"] / copy_gbs
        del g
        res[f"{name}_eager_us"] = time_fn(fn, max(10, iters // 5)) / nbuf * 1e3
    res["speedup_vs_ref"] = res["ref_us"] / res["ours_us"]
    del xs_pool, out_pool, xs, outs
    torch.cuda.empty_cache()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results to this JSON file")
    ap.add_argument("--iters", type=int, default=50, help="samples per measurement (median), >= 50 recommended")
    ap.add_argument("--d", type=int, default=12288, help="intermediate size (Qwen3-8B: 12288)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 512, 8192])
    args = ap.parse_args()

    if not torch.cuda.is_available():
        print("bench_silu_and_mul: no CUDA device; nothing to do", file=sys.stderr)
        return 2
    if not has_cuda_kernels():
        print("bench_silu_and_mul: fastqwen._C was built without CUDA kernels", file=sys.stderr)
        return 2

    torch.manual_seed(0)
    dev = torch.cuda.get_device_name()
    copy_gbs = copy_bandwidth(args.iters)
    print(f"device: {dev}   torch {torch.__version__}   d2d copy (read+write, 1 GiB): {copy_gbs:.0f} GB/s")
    header = (
        f"{'tokens':>7} {'d':>6} | {'ours us':>9} {'GB/s':>7} {'%copy':>6} {'eager us':>9} | "
        f"{'ref us':>9} {'GB/s':>7} {'%copy':>6} {'eager us':>9} | {'speedup':>7}"
    )
    print(header)
    print("-" * len(header))
    results = []
    for rows in args.tokens:
        r = bench_shape(rows, args.d, torch.bfloat16, args.iters, copy_gbs)
        results.append(r)
        print(
            f"{rows:>7} {args.d:>6} | {r['ours_us']:>9.2f} {r['ours_gbs']:>7.0f} {100 * r['ours_frac_copy']:>5.1f}% "
            f"{r['ours_eager_us']:>9.2f} | {r['ref_us']:>9.2f} {r['ref_gbs']:>7.0f} {100 * r['ref_frac_copy']:>5.1f}% "
            f"{r['ref_eager_us']:>9.2f} | {r['speedup_vs_ref']:>6.2f}x",
            flush=True,
        )

    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "bench": "silu_and_mul",
                    "device": dev,
                    "torch": torch.__version__,
                    "cuda": torch.version.cuda,
                    "copy_gbs": copy_gbs,
                    "iters": args.iters,
                    "note": "us per call: median over samples of one CUDA-graph replay of a pass over "
                    "all buffers / buffers; GB/s counts 3*d*rows*2 bytes per call",
                    "results": results,
                },
                f,
                indent=2,
            )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
