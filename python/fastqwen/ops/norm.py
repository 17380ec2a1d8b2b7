"""RMSNorm and fused residual-add + RMSNorm.

Numerics follow Hugging Face's Qwen3RMSNorm: normalize in float32, round to the model dtype, then multiply by the
weight in the model dtype. The residual sum is rounded to the model dtype before it is normalized, as HF does.
"""

from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(variance + eps)).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """out = RMSNorm(x) * weight over the last dimension."""
    result = rms_norm_reference(x, weight, eps)
    if out is None:
        return result
    out.copy_(result)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual <- x + residual, x <- RMSNorm(residual) * weight. Returns (x, residual)."""
    residual.add_(x)
    x.copy_(rms_norm_reference(residual, weight, eps))
    return x, residual
