"""add_rms_norm_linear (the residual add and RMSNorm with the projection after them) on the CPU: the reference path
against the ops it stands for, its shape checks, and the argument checks of the fused kernel's entry point (which
run before anything touches a GPU). The kernel itself is tested against float64 math in test_gemv_gpu.py."""

from __future__ import annotations

import pytest
import torch

from fastqwen import ops
from fastqwen.ops import _native
from fastqwen.ops.linear import LinearWeight, add_rms_norm_linear, linear, linear_silu_and_mul, quantize_fp8
from fastqwen.ops.norm import rms_norm_reference


def _inputs(hidden: int, rows: int, dtype=torch.bfloat16, fp8: bool = False, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, hidden, generator=gen).to(dtype)
    residual = torch.randn(1, hidden, generator=gen).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    dense = torch.randn(rows, hidden, generator=gen) * 0.05
    w = LinearWeight(*quantize_fp8(dense)) if fp8 else LinearWeight(dense.to(dtype))
    return x, residual, norm_w, w


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("silu", [False, True], ids=["plain", "silu"])
@pytest.mark.parametrize("with_x", [True, False], ids=["add", "norm_only"])
def test_reference_path_is_the_norm_ops_then_linear(fp8, silu, with_x):
    x, residual, norm_w, w = _inputs(256, 96, fp8=fp8)
    x_before, residual_before = x.clone(), residual.clone()
    y, h = add_rms_norm_linear(x if with_x else None, residual, norm_w, 1e-6, w, silu_gate_up=silu)
    want_h = (x.float() + residual.float()).to(x.dtype) if with_x else residual
    normed = rms_norm_reference(want_h, norm_w, 1e-6)
    want_y = linear_silu_and_mul(normed, w) if silu else linear(normed, w)
    assert torch.equal(h, want_h) and torch.equal(y, want_y)
    assert y.shape == (1, 48 if silu else 96)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # inputs left as they are
    if not with_x:
        assert h is residual
    # The same as the in-place op the model used before.
    hidden, res = x.clone(), residual.clone()
    if with_x:
        ops.fused_add_rms_norm(hidden, res, norm_w, 1e-6)
    else:
        hidden = ops.rms_norm(res, norm_w, 1e-6)
    assert torch.equal(res, h) and torch.equal(want_y, linear_silu_and_mul(hidden, w) if silu else linear(hidden, w))
    y2, h2 = add_rms_norm_linear(x if with_x else None, residual, norm_w, 1e-6, w, silu_gate_up=silu, keep_sum=False)
    assert h2 is None and torch.equal(y2, y)


def test_refuses_mismatched_shapes():
    x, residual, norm_w, w = _inputs(128, 32)
    with pytest.raises(ValueError, match="residual must be"):
        add_rms_norm_linear(x, residual[:, :64], norm_w, 1e-6, w)
    with pytest.raises(ValueError, match="x must be like residual"):
        add_rms_norm_linear(x.float(), residual, norm_w, 1e-6, w)
    with pytest.raises(ValueError, match="x must be like residual"):
        add_rms_norm_linear(torch.cat([x, x]), residual, norm_w, 1e-6, w)
    with pytest.raises(ValueError, match="norm_weight"):
        add_rms_norm_linear(x, residual, norm_w[:64], 1e-6, w)
    assert not ops.add_rms_norm_linear_fuses(residual, w)  # (on the CPU: the reference path)


def test_fused_kernel_refuses_bad_arguments():
    m = _native.native()
    if m is None or not getattr(m, "built_with_cuda", False):
        pytest.skip("extension built without CUDA")
    bf16 = _native.dtype_code(torch.bfloat16)
    ok = dict(out=16, x=16, residual=32, residual_out=48, norm_weight=64, eps=1e-6, w=80, scale=0, bias=0, n=64,
              k=4096, dtype=bf16, fp8=False, silu_gate_up=False, stream=0)  # fmt: skip
    cases = [
        (dict(k=m.GEMV_NORM_MAX_K + 8), "at most"),
        (dict(residual_out=32), "must not be residual"),
        (dict(residual=0), "null residual"),
        (dict(norm_weight=0), "null residual or norm weight"),
        (dict(residual=40), "16-byte aligned"),
        (dict(norm_weight=72), "16-byte aligned"),
        (dict(residual_out=56), "16-byte aligned"),
        (dict(eps=-1.0), "eps"),
        (dict(eps=float("nan")), "eps"),
        (dict(k=4100), "multiple of 8"),
        (dict(fp8=True), "null data pointer"),  # an FP8 weight needs its scales
        (dict(silu_gate_up=True, n=63), "n even"),
        (dict(dtype=_native.dtype_code(torch.float32)), "dtype"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            m.gemv_norm(**(ok | change))
