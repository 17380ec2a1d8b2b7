"""MLP activation: ``silu_and_mul``.

Qwen3's MLP computes ``down(act(gate(x)) * up(x))``; with the fused gate_up
projection its output is ``[..., 2*d]`` with gate first and up second.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._native import has_cuda_kernels, native

__all__ = ["silu_and_mul", "silu_and_mul_reference"]


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """PyTorch reference, exactly as Hugging Face Qwen3 computes it: ``F.silu(gate) * up``
    in the input dtype (silu rounded to the dtype, then the product rounded again)."""
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"silu_and_mul: last dim of x must be even, got shape {tuple(x.shape)}")
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def _dtype_code(dtype: torch.dtype) -> int | None:
    m = native()
    return {
        torch.float32: m.DTYPE_F32,
        torch.float16: m.DTYPE_F16,
        torch.bfloat16: m.DTYPE_BF16,
    }.get(dtype)


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

    On a CUDA tensor, when the extension was built with CUDA kernels, this runs the
    fused kernel (x and out must be contiguous, bf16/fp16/fp32, same device and
    dtype; ValueError otherwise). Otherwise it runs :func:`silu_and_mul_reference`
    and writes into ``out``. ``out`` is allocated when None; pass it to avoid
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

    if x.is_cuda and has_cuda_kernels():
        code = _dtype_code(x.dtype)
        if code is None:
            raise ValueError(f"silu_and_mul: unsupported dtype {x.dtype} (bfloat16, float16 or float32)")
        if not x.is_contiguous():
            raise ValueError(f"silu_and_mul: x must be contiguous (shape {tuple(x.shape)}, stride {x.stride()})")
        if out is None:
            out = torch.empty(tuple(x.shape[:-1]) + (d,), dtype=x.dtype, device=x.device)
        else:
            _check_out(x, out, d)
            if not out.is_contiguous():
                raise ValueError(
                    f"silu_and_mul: out must be contiguous (shape {tuple(out.shape)}, stride {out.stride()})"
                )
        num_rows = out.numel() // d if d > 0 else 0
        if num_rows == 0:
            return out
        if x.device.index != torch.cuda.current_device():
            with torch.cuda.device(x.device):
                _launch(x, out, num_rows, d, code)
        else:
            _launch(x, out, num_rows, d, code)
        return out

    ref = silu_and_mul_reference(x)
    if out is None:
        return ref
    _check_out(x, out, d)
    out.copy_(ref)
    return out


def _launch(x: torch.Tensor, out: torch.Tensor, num_rows: int, d: int, code: int) -> None:
    stream = torch.cuda.current_stream(x.device).cuda_stream
    native().silu_and_mul(x.data_ptr(), out.data_ptr(), num_rows, d, code, stream)
