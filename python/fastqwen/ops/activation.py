"""MLP activation: ``silu_and_mul``.

Qwen3's MLP computes ``down(act(gate(x)) * up(x))``; with the fused gate_up
projection its output is ``[..., 2*d]`` with gate first and up second.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._native import dtype_code, kernel_applies, native, stream_of

__all__ = ["silu_and_mul", "silu_and_mul_kernel_applies", "silu_and_mul_reference"]


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """PyTorch reference, exactly as Hugging Face Qwen3 computes it: ``F.silu(gate) * up``
    in the input dtype (silu rounded to the dtype, then the product rounded again)."""
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"silu_and_mul: last dim of x must be even, got shape {tuple(x.shape)}")
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def silu_and_mul_kernel_applies(on_gpu: bool, dtype: torch.dtype) -> bool:
    """Whether silu_and_mul runs its CUDA kernel (else the reference) for x on the GPU or not, of this dtype."""
    return kernel_applies("silu_and_mul", on_gpu, dtype)


def _check_out(x: torch.Tensor, out: torch.Tensor, d: int) -> None:
    expected = tuple(x.shape[:-1]) + (d,)
    if tuple(out.shape) != expected:
        raise ValueError(f"silu_and_mul: out has shape {tuple(out.shape)}, expected {expected}")
    if out.dtype != x.dtype:
        raise ValueError(f"silu_and_mul: out dtype {out.dtype} differs from x dtype {x.dtype}")
    if out.device != x.device:
        raise ValueError(f"silu_and_mul: out is on {out.device}, x is on {x.device}")


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out = silu(x[..., :d]) * x[..., d:]`` for x of shape ``[..., 2*d]``; out is ``[..., d]``.

    Where silu_and_mul_kernel_applies (bf16 / fp16 / fp32 CUDA tensors, extension built with the kernels) this runs
    the fused kernel (x and out contiguous, on one device: ValueError otherwise); on anything else
    :func:`silu_and_mul_reference`, written into ``out``. ``out`` is allocated when None; pass it to avoid
    allocating inside a step (CUDA graphs).

    Numerics: the kernel computes silu in fp32 as ``g / (1 + exp(-g))``, multiplies by
    up in fp32 and rounds once to the output dtype, whereas HF rounds silu(gate) to the
    dtype before the multiply. For bf16/fp16 the two differ by about one ulp of the
    output at most (the kernel is the more accurate of the two); tests compare with a
    tolerance. For fp32 they agree to ~1e-6 relative.
    """
    if x.dim() < 1 or x.shape[-1] % 2 != 0:
        raise ValueError(f"silu_and_mul: last dim of x must be even, got shape {tuple(x.shape)}")
    d = x.shape[-1] // 2
    if out is not None:
        _check_out(x, out, d)
    if not silu_and_mul_kernel_applies(x.is_cuda, x.dtype):
        ref = silu_and_mul_reference(x)
        return ref if out is None else out.copy_(ref)
    if out is None:
        out = torch.empty(tuple(x.shape[:-1]) + (d,), dtype=x.dtype, device=x.device)
    for name, t in (("x", x), ("out", out)):  # device and dtype were checked above
        if not t.is_contiguous():
            raise ValueError(f"silu_and_mul: {name} must be contiguous (shape {tuple(t.shape)}, stride {t.stride()})")
    num_rows = out.numel() // d if d > 0 else 0
    if num_rows == 0:
        return out
    if x.device.index != torch.cuda.current_device():
        with torch.cuda.device(x.device):
            native().silu_and_mul(x.data_ptr(), out.data_ptr(), num_rows, d, dtype_code(x.dtype), stream_of(x))
    else:
        native().silu_and_mul(x.data_ptr(), out.data_ptr(), num_rows, d, dtype_code(x.dtype), stream_of(x))
    return out
