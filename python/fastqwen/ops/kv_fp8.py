"""FP8 (e4m3) KV cache entries: how a value is stored and read back, the rule the kernels follow too.

A cache tensor holds x / scale rounded to the nearest e4m3 value (ties to even) and saturated to +-448, e4m3's
largest finite value; reading gives e4m3 * scale. There is one scale per tensor, that is per layer for K and for V:
1.0, or the k_scale / v_scale a checkpoint provides. Every e4m3 value is exact in fp16 and bf16, so the only error is
the rounding on the write: at most 1/16 of the value in e4m3's normal range (|x / scale| >= 2^-6), and 2^-10 * scale
below it.
"""

from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_KV_DTYPE


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x (any float dtype) -> e4m3 of x / scale, saturated (torch's own conversion would turn |x| > 448 into NaN)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Cached rows -> float32 values: e4m3 * scale, or a 16-bit cache's values as they are."""
    if is_fp8(x.dtype):
        return x.float() * scale
    return x.float()


def store_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, scale: float) -> None:
    """cache (viewed [slots, ...]) [slots] = rows, quantized when the cache is e4m3 (written through a byte view:
    index_put is not implemented for float8 on every device)."""
    if is_fp8(cache.dtype):
        cache.view(torch.uint8)[slots] = quantize_kv(rows, scale).view(torch.uint8)
    else:
        cache[slots] = rows.to(cache.dtype)


def gather_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots] (through a byte view for e4m3, as store_rows)."""
    if is_fp8(cache.dtype):
        return cache.view(torch.uint8)[slots].view(FP8_KV_DTYPE)
    return cache[slots]
