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


def graph_of(fn) -> torch.cuda.CUDAGraph:
    """fn captured in a CUDA graph (after one warm-up run): replays time the GPU work without launch gaps."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g
