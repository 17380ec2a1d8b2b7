"""RMSNorm and fused residual-add + RMSNorm.

Numerics follow Hugging Face's Qwen3RMSNorm: normalize in float32, round to the model dtype, then multiply by the
weight in the model dtype. The residual sum is rounded to the model dtype before it is normalized, as HF does.
bf16 / fp16 CUDA tensors go to the kernels in csrc/norm.cu; anything else to the PyTorch reference.
"""

from __future__ import annotations

import torch

from ._native import check_tensors, dtype_code, kernel_applies, native, stream_of
from .linear import FP8_BLOCK, QuantizedRows, _padded_rows, _quantize_for_gemm, quantized_buffers


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(variance + eps)).to(x.dtype)


def _check_shapes(op: str, x: torch.Tensor, weight: torch.Tensor, other: torch.Tensor, other_name: str) -> None:
    if x.dim() < 1 or weight.shape != (x.shape[-1],):
        raise ValueError(f"{op}: weight has shape {tuple(weight.shape)}, expected ({x.shape[-1]},)")
    if other.shape != x.shape:
        raise ValueError(f"{op}: {other_name} has shape {tuple(other.shape)}, expected {tuple(x.shape)}")


def rms_norm_kernel_applies(on_gpu: bool, dtype: torch.dtype) -> bool:
    """Whether rms_norm / fused_add_rms_norm run their CUDA kernel (else the reference) for x on the GPU or not, of
    this dtype."""
    return kernel_applies("rms_norm", on_gpu, dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """out = RMSNorm(x) * weight over the last dimension."""
    if out is None:
        out = torch.empty_like(x)
    _check_shapes("rms_norm", x, weight, out, "out")
    if not rms_norm_kernel_applies(x.is_cuda, x.dtype):
        out.copy_(rms_norm_reference(x, weight, eps))
        return out
    check_tensors("rms_norm", x.device, x.dtype, x=x, weight=weight, out=out)
    hidden = x.shape[-1]
    native().rms_norm(
        out.data_ptr(),
        x.data_ptr(),
        weight.data_ptr(),
        x.numel() // hidden,
        hidden,
        eps,
        dtype_code(x.dtype),
        stream_of(x),
    )
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual <- x + residual, x <- RMSNorm(residual) * weight. Returns (x, residual)."""
    _check_shapes("fused_add_rms_norm", x, weight, residual, "residual")
    if not rms_norm_kernel_applies(x.is_cuda, x.dtype):
        residual.add_(x)
        x.copy_(rms_norm_reference(residual, weight, eps))
        return x, residual
    check_tensors("fused_add_rms_norm", x.device, x.dtype, x=x, residual=residual, weight=weight)
    hidden = x.shape[-1]
    native().fused_add_rms_norm(
        x.data_ptr(),
        residual.data_ptr(),
        weight.data_ptr(),
        x.numel() // hidden,
        hidden,
        eps,
        dtype_code(x.dtype),
        stream_of(x),
    )
    return x, residual


def fused_add_rms_norm_quantized(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[QuantizedRows, torch.Tensor]:
    """fused_add_rms_norm with its output quantized for the block-scaled FP8 GEMM instead of written: residual <- x +
    residual as there; returns (QuantizedRows of RMSNorm(residual) * weight, bit for bit what the GEMM would quantize
    fused_add_rms_norm's output to, residual). x [M, hidden] is left as it was where the kernel runs (csrc/norm.h
    fused_add_rms_norm_fp8; hidden a multiple of 128); elsewhere the two steps, x overwritten."""
    _check_shapes("fused_add_rms_norm_quantized", x, weight, residual, "residual")
    m, hidden = x.shape
    padded = _padded_rows(m)
    kernel = (
        rms_norm_kernel_applies(x.is_cuda, x.dtype)
        and kernel_applies("quantize_fp8_tokens", x.is_cuda, x.dtype)
        and hidden % FP8_BLOCK == 0
        and 0 < m
        and padded <= 65535
    )
    if not kernel:
        fused_add_rms_norm(x, residual, weight, eps)
        return QuantizedRows(*_quantize_for_gemm(x, padded), m, x.dtype), residual
    check_tensors("fused_add_rms_norm_quantized", x.device, x.dtype, x=x, residual=residual, weight=weight)
    q, scale_t = quantized_buffers(padded, hidden, x.device)
    native().fused_add_rms_norm_fp8(
        x.data_ptr(),
        residual.data_ptr(),
        weight.data_ptr(),
        m,
        hidden,
        eps,
        dtype_code(x.dtype),
        q.data_ptr(),
        scale_t.data_ptr(),
        padded,
        stream_of(x),
    )
    return QuantizedRows(q, scale_t.t(), m, x.dtype), residual
