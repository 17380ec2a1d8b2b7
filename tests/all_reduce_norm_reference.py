"""The float64 reference of ParallelGroup.all_reduce_add_rms_norm and how far a rounded computation may lie from it.

The reference is the math, in float64: new_residual = residual + sum over ranks of the partials, normed =
new_residual / sqrt(mean(new_residual^2) + eps) * weight. The bound follows the roundings of the contract
(csrc/custom_all_reduce.h, ops/norm.py), each at most u = eps_dtype / 2 of its value: the sum rounded once (the
custom kernel, fp32 accumulation) or once per added rank (gloo's pairwise sums on the CPU), the new residual rounded,
the normalized value rounded, and the product with the weight rounded; plus the error the residual's error carries
into the norm's mean square. Each term is bounded elementwise in float64, then the whole doubled; the bugs the tests
look for (the residual added twice, a rank's partial left out) move values by whole residuals or partials.
"""

from __future__ import annotations

import torch


def reference(
    partials: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new_residual) in float64 from every rank's partial rows [rows, hidden]."""
    new_residual = residual.double() + torch.stack([p.double() for p in partials]).sum(0)
    inv = torch.rsqrt(new_residual.pow(2).mean(-1, keepdim=True) + eps)
    return new_residual * inv * weight.double(), new_residual


def bounds(
    partials: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor, eps: float, sum_roundings: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise bounds (normed, new_residual) on |computed - reference| for a computation in the partials' dtype
    that rounds the sum of the ranks' partials sum_roundings times."""
    dtype = residual.dtype
    u = torch.finfo(dtype).eps / 2
    fp32 = 2.0**-24 * (len(partials) + residual.shape[-1])  # fp32 accumulations of the sum and the mean square
    normed, new_residual = reference(partials, residual, weight, eps)
    abs_sum = torch.stack([p.double().abs() for p in partials]).sum(0)
    sum_err = (max(sum_roundings, 1) * u + fp32) * abs_sum
    res_err = sum_err + u * (new_residual.abs() + sum_err)
    inv = torch.rsqrt(new_residual.pow(2).mean(-1, keepdim=True) + eps)
    mean_sq = new_residual.pow(2).mean(-1, keepdim=True)
    mean_sq_err = (2 * new_residual.abs() * res_err + res_err.pow(2)).mean(-1, keepdim=True) + fp32 * mean_sq
    # |1/sqrt(m + d + eps) - 1/sqrt(m + eps)| <= 1.5 * inv * |d| / (m + eps) while |d| <= (m + eps) / 2
    inv_err = 1.5 * inv * mean_sq_err / (mean_sq + eps)
    scaled = new_residual.abs() * inv
    scaled_err = res_err * (inv + inv_err) + new_residual.abs() * inv_err + u * (scaled + res_err * (inv + inv_err))
    w = weight.double().abs()
    normed_err = w * scaled_err + u * (normed.abs() + w * scaled_err)
    return 2 * normed_err, 2 * res_err


def assert_close_to_reference(
    normed: torch.Tensor,
    new_residual: torch.Tensor,
    partials: list[torch.Tensor],
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    sum_roundings: int,
    what: str,
) -> None:
    """normed and new_residual (as computed, any device) within bounds() of the float64 reference."""
    want_normed, want_residual = reference(partials, residual, weight, eps)
    normed_bound, residual_bound = bounds(partials, residual, weight, eps, sum_roundings)
    for name, got, want, bound in (
        ("new residual", new_residual, want_residual, residual_bound),
        ("normed", normed, want_normed, normed_bound),
    ):
        err = (got.double().cpu() - want).abs()
        worst = (err / bound.clamp_min(1e-300)).max().item()
        assert (err <= bound).all(), f"{what}: the {name} is off the float64 reference by {worst:.2f}x its bound"
