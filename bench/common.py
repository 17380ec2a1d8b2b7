"""Shared timing helpers for the GPU benchmarks (CUDA-event timing, median of many samples)."""

from __future__ import annotations

import statistics

import torch


def time_fn(fn, iters: int, warmup: int = 5) -> float:
    """Median milliseconds of fn() over iters samples, measured with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def copy_bandwidth(iters: int) -> float:
    """GB/s of a 1 GiB device-to-device copy, counting read + write."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.empty_like(src)
    ms = time_fn(lambda: dst.copy_(src), iters)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / (ms * 1e-3) / 1e9
