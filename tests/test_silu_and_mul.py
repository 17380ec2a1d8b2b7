"""silu_and_mul: reference vs float64 math (CPU), CUDA kernel vs reference (GPU)."""

import pytest
import torch
import torch.nn.functional as F
from fastqwen.ops._native import has_cuda_kernels
from fastqwen.ops.activation import silu_and_mul, silu_and_mul_reference

requires_kernel = pytest.mark.skipif(
    not (torch.cuda.is_available() and has_cuda_kernels()),
    reason="needs a CUDA GPU and fastqwen._C built with CUDA",
)


def exact(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    g, u = x[..., :d].double(), x[..., d:].double()
    return g / (1 + torch.exp(-g)) * u


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("shape", [(1, 2), (7, 6), (3, 5, 254), (16, 2048)])
def test_reference_matches_float64(dtype, tol, shape):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    ref = silu_and_mul_reference(x)
    assert ref.dtype == dtype and ref.shape == shape[:-1] + (shape[-1] // 2,)
    torch.testing.assert_close(ref.double(), exact(x), rtol=tol, atol=tol)


def test_reference_path_writes_out_on_cpu():
    x = torch.randn(5, 16)
    out = torch.full((5, 8), float("nan"))
    r = silu_and_mul(x, out)
    assert r is out
    torch.testing.assert_close(out, F.silu(x[:, :8]) * x[:, 8:])
    torch.testing.assert_close(silu_and_mul(x), out)
    with pytest.raises(ValueError):
        silu_and_mul(torch.randn(4, 7))
    with pytest.raises(ValueError):
        silu_and_mul(x, torch.empty(5, 9))
    with pytest.raises(ValueError):
        silu_and_mul(x, torch.empty(5, 8, dtype=torch.float64))


TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
}


@pytest.mark.gpu
@requires_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [0, 1, 7, 4096])
@pytest.mark.parametrize("d", [1, 3, 8, 127, 4096, 12288])
def test_kernel_matches_reference(dtype, rows, d):
    if rows * d > 4096 * 4096 and dtype == torch.float32:
        rows = 1024  # keep memory modest
    x = torch.randn(rows, 2 * d, device="cuda", dtype=dtype) * 3
    out = torch.full((rows, d), float("nan"), device="cuda", dtype=dtype)  # poisoned
    r = silu_and_mul(x, out)
    assert r is out
    torch.cuda.synchronize()
    ref = silu_and_mul_reference(x)
    assert not out.isnan().any(), "kernel left elements unwritten"
    torch.testing.assert_close(out, ref, **TOL[dtype])
    if dtype != torch.float32 and out.numel() > 0:
        # the kernel rounds once: it must be (up to fp32 noise) at least as close to the
        # exact value as HF's double rounding
        ex = exact(x)
        slack = 1e-6 * ex.abs().max().item() + 1e-12
        assert (out.double() - ex).abs().max().item() <= (ref.double() - ex).abs().max().item() + slack


@pytest.mark.gpu
@requires_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_batched_and_unaligned(dtype):
    # 3-D input, allocation inside, and a misaligned base pointer (scalar path).
    x = torch.randn(2, 5, 2 * 4096, device="cuda", dtype=dtype)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_reference(x), **TOL[dtype])
    buf = torch.randn(3 * 2 * 64 + 1, device="cuda", dtype=dtype)
    xu = buf[1:].view(3, 128)  # contiguous, data_ptr not 16-byte aligned
    outu = torch.full((3 * 64 + 1,), float("nan"), device="cuda", dtype=dtype)[1:].view(3, 64)
    silu_and_mul(xu, outu)
    torch.testing.assert_close(outu, silu_and_mul_reference(xu), **TOL[dtype])
    # more rows than one grid dimension holds
    xb = torch.randn(70000, 16, device="cuda", dtype=dtype)
    torch.testing.assert_close(silu_and_mul(xb), silu_and_mul_reference(xb), **TOL[dtype])


@pytest.mark.gpu
@requires_kernel
def test_kernel_on_side_stream_and_graph():
    x = torch.randn(64, 2 * 1024, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(64, 1024, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        silu_and_mul(x, out)  # warm-up on the side stream
        g = torch.cuda.CUDAGraph()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        silu_and_mul(x, out)
    x.copy_(torch.randn_like(x))
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, silu_and_mul_reference(x), **TOL[torch.bfloat16])


@pytest.mark.gpu
@requires_kernel
def test_kernel_bad_inputs_raise():
    x = torch.randn(4, 16, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(4, 8, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous"):
        silu_and_mul(torch.randn(16, 4, device="cuda", dtype=torch.bfloat16).t(), out)
    with pytest.raises(ValueError, match="contiguous"):
        silu_and_mul(x, torch.empty(8, 4, device="cuda", dtype=torch.bfloat16).t())
    # A dtype the kernel does not take runs the reference, as every op does.
    wide = x.double()
    torch.testing.assert_close(silu_and_mul(wide), silu_and_mul_reference(wide))
    with pytest.raises(ValueError, match="dtype"):
        silu_and_mul(x, out.float())
    with pytest.raises(ValueError):
        silu_and_mul(x, torch.empty(4, 9, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(ValueError):
        silu_and_mul(torch.randn(4, 15, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(ValueError):
        silu_and_mul(x, torch.empty(4, 8, dtype=torch.bfloat16))  # out on CPU


def test_native_rejects_bad_sizes():
    from fastqwen.ops._native import native

    m = native()
    assert m is not None
    if not getattr(m, "built_with_cuda", False):
        pytest.skip("extension built without CUDA")
    with pytest.raises(ValueError):
        m.silu_and_mul(0, 0, -1, 8, m.DTYPE_BF16, 0)
    with pytest.raises(ValueError):
        m.silu_and_mul(0, 0, 1, -8, m.DTYPE_BF16, 0)
    with pytest.raises(ValueError):
        m.silu_and_mul(0, 0, 1, 8, 7, 0)
    with pytest.raises(ValueError):
        m.silu_and_mul(0, 0, 1, 8, m.DTYPE_BF16, 0)  # null pointers
    with pytest.raises(ValueError):
        m.silu_and_mul(-5, 0, 1, 8, m.DTYPE_BF16, 0)  # negative pointer
    m.silu_and_mul(0, 0, 0, 8, m.DTYPE_BF16, 0)  # zero rows: no launch, no error
