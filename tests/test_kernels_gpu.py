"""CUDA norm and RoPE/KV kernels against their PyTorch references, on fresh random inputs over a grid of shapes,
with outputs poisoned (NaN) before each run so that any element a kernel fails to write shows up."""

from __future__ import annotations

import pytest
import torch
from fastqwen.ops import fused_add_rms_norm, qk_norm_rope_store_kv, rms_norm, rope_cos_sin_cache
from fastqwen.ops._native import has_cuda_kernels
from fastqwen.ops.norm import rms_norm_reference
from fastqwen.ops.rope_kv import apply_rope_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and has_cuda_kernels()), reason="needs a CUDA GPU and the kernels"
    ),
]

DTYPES = [torch.bfloat16, torch.float16]
EPS = 1e-6


def assert_close_to_reference(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to one rounding of the dtype: the kernel sums squares in another order and rounds rsqrt
    differently, which can move a rounding by one ulp. Nearly every element must match exactly."""
    assert not torch.isnan(got).any() or torch.isnan(want).any(), "unwritten (NaN) elements"
    rtol = 2**-7 if got.dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * rtol, atol=1e-3, equal_nan=True)
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    assert same.float().mean() > 0.98, f"only {same.float().mean():.3f} of elements identical"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [1024, 2048, 2560, 4096, 5120, 1000, 72, 20480])
@pytest.mark.parametrize("tokens", [1, 3, 17, 255, 1031])
def test_rms_norm_and_fused_add(dtype, hidden, tokens):
    gen = torch.Generator(device="cuda").manual_seed(hidden * 7 + tokens)
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype, generator=gen) * 3
    residual = torch.randn(tokens, hidden, device="cuda", dtype=dtype, generator=gen)
    weight = (1 + 0.2 * torch.randn(hidden, device="cuda", generator=gen)).to(dtype)
    out = torch.full_like(x, float("nan"))
    rms_norm(x, weight, EPS, out=out)
    assert_close_to_reference(out, rms_norm_reference(x, weight, EPS))

    want_residual = residual + x
    want_x = rms_norm_reference(want_residual, weight, EPS)
    fused_add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(residual, want_residual), "the residual sum is one bf16/fp16 add: it must match exactly"
    assert_close_to_reference(x, want_x)


def test_norms_on_misaligned_rows():
    """A view that starts off a 16-byte boundary takes the two-pass kernel and gives the same result, for the plain
    norm and for residual-add + norm (whose second pass must scale the sum, not x)."""
    base = torch.randn(9 * 4096 + 3, device="cuda", dtype=torch.bfloat16)
    x = base[3:].view(9, 4096)
    weight = (1 + 0.2 * torch.randn(4096, device="cuda")).to(torch.bfloat16)
    out = torch.full((9, 4096), float("nan"), device="cuda", dtype=torch.bfloat16)
    rms_norm(x, weight, EPS, out=out)
    assert_close_to_reference(out, rms_norm_reference(x, weight, EPS))

    residual_base = torch.randn(9 * 4096 + 5, device="cuda", dtype=torch.bfloat16) * 4
    residual = residual_base[5:].view(9, 4096)  # off the boundary too
    want_residual = residual + x
    want_x = rms_norm_reference(want_residual, weight, EPS)
    fused_add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(residual, want_residual), "the residual sum is one bf16 add: it must match exactly"
    assert_close_to_reference(x, want_x)


@pytest.mark.parametrize("eps", [1e-6, 1e-2])
def test_norms_where_eps_counts(eps):
    """Rows whose mean square is from 0 (a row of zeros) to 10^4 times eps, where eps moves the result: both kernels
    (one-pass, and two-pass on a misaligned view) against the reference, plain and after a residual add. At
    eps = 1e-6 (Qwen3's) the rows are of size 1e-3, as the k-norm sees in a head that is nearly zero."""
    gen = torch.Generator(device="cuda").manual_seed(int(1 / eps))
    hidden, sizes = 4096, [0.0, 0.3, 1.0, 3.0, 100.0]  # each row's rms in units of sqrt(eps)
    rms = torch.tensor(sizes, device="cuda")[:, None] * eps**0.5
    weight = (1 + 0.2 * torch.randn(hidden, device="cuda", generator=gen)).to(torch.bfloat16)
    for offset in (0, 3):  # 0: the one-pass kernel; 3 elements off a 16-byte boundary: the two-pass one
        buffer = torch.empty(len(sizes) * hidden + offset, device="cuda", dtype=torch.bfloat16)
        x = buffer[offset:].view(len(sizes), hidden)
        x.copy_(torch.randn(len(sizes), hidden, device="cuda", generator=gen) * rms)
        want = rms_norm_reference(x, weight, eps)
        mean_square = x.double().pow(2).mean(-1)
        assert (want[0] == 0).all() and (mean_square[1:4] < 10 * eps).all(), "eps must matter in these rows"
        out = torch.full_like(x, float("nan"))
        rms_norm(x, weight, eps, out=out)
        assert_close_to_reference(out, want)
        residual = torch.zeros_like(x)  # the sum is x itself
        fused_add_rms_norm(x, residual, weight, eps)
        assert_close_to_reference(x, want)


def qk_reference(qkv, qw, kw, cos_sin, positions, k_cache, v_cache, slots, num_heads):
    """The reference math (the op would take the kernel on these tensors), on copies: (q_out, k_cache, v_cache)."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    head_dim = k_cache.shape[3]
    t = qkv.shape[0]
    kvh = k_cache.shape[2]
    q, k, v = qkv.split([num_heads * head_dim, kvh * head_dim, kvh * head_dim], dim=1)
    q, k = q.reshape(t, num_heads, head_dim), k.reshape(t, kvh, head_dim)
    if qw is not None:  # (None: no per-head norm, a Llama layer's)
        q, k = rms_norm_reference(q, qw, EPS), rms_norm_reference(k, kw, EPS)
    rows = cos_sin[positions]
    q_out = apply_rope_reference(q, rows)
    k = apply_rope_reference(k, rows)
    valid = slots >= 0
    k_cache.view(-1, kvh, head_dim)[slots[valid]] = k[valid]
    v_cache.view(-1, kvh, head_dim)[slots[valid]] = v.reshape(t, kvh, head_dim)[valid]
    return q_out, k_cache, v_cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(16, 8), (32, 8), (40, 8), (64, 8), (4, 4)])
@pytest.mark.parametrize("page_size", [1, 16, 128])
@pytest.mark.parametrize("tokens", [1, 5, 33, 257])
def test_qk_norm_rope_store_kv(dtype, heads, kv_heads, page_size, tokens, head_dim=128):
    run_qk_case(dtype, heads, kv_heads, page_size, tokens, head_dim)


@pytest.mark.parametrize("head_dim", [64, 256])
def test_qk_norm_rope_store_kv_other_head_dims(head_dim):
    run_qk_case(torch.bfloat16, 8, 2, 16, 19, head_dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 33])
def test_rope_store_kv_without_norms_runs_the_kernel(dtype, tokens):
    """q_weight = k_weight = None (the EAGLE-3 head's Llama layer): the kernel rotates q and k as they are, against
    the reference math without the norms."""
    run_qk_case(dtype, 32, 8, 16, tokens, 128, normed=False)


def run_qk_case(dtype, heads, kv_heads, page_size, tokens, head_dim, normed=True):
    gen = torch.Generator(device="cuda").manual_seed(heads * 1000 + tokens * 10 + page_size)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = (torch.randn(tokens, width, device="cuda", generator=gen) * 2).to(dtype)
    qw = (1 + 0.3 * torch.randn(head_dim, device="cuda", generator=gen)).to(dtype)
    kw = (1 + 0.3 * torch.randn(head_dim, device="cuda", generator=gen)).to(dtype)
    if not normed:
        qw = kw = None
    max_pos = 4096
    cos_sin = rope_cos_sin_cache(head_dim, max_pos, 1e6, torch.device("cuda"))
    positions = torch.randint(0, max_pos, (tokens,), device="cuda", generator=gen)
    pages = -(-tokens // page_size) + 3
    # Scattered slots, every third token padding (-1).
    slots = torch.randperm(pages * page_size, device="cuda", generator=gen)[:tokens]
    slots[::3] = -1
    k_cache = torch.full((pages, page_size, kv_heads, head_dim), float("nan"), device="cuda", dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    want_q, want_k, want_v = qk_reference(qkv, qw, kw, cos_sin, positions, k_cache, v_cache, slots, heads)
    q_out = torch.full((tokens, heads, head_dim), float("nan"), device="cuda", dtype=dtype)
    qk_norm_rope_store_kv(qkv, qw, kw, cos_sin, positions, k_cache, v_cache, slots, EPS, q_out)
    assert_close_to_reference(q_out, want_q)
    assert_close_to_reference(k_cache, want_k)  # NaN exactly where nothing may be written (padding, unused slots)
    assert torch.equal(torch.isnan(k_cache), torch.isnan(want_k))
    assert torch.equal(v_cache.nan_to_num(7.0), want_v.nan_to_num(7.0)), "v is copied, bit for bit"


def test_engine_model_uses_the_kernels():
    """The model calls the ops; on bf16 CUDA tensors the ops are the kernels (not the references)."""
    from fastqwen.ops import norm

    calls = []
    original = norm.native

    def spy():
        module = original()
        calls.append(module)
        return module

    norm.native = spy
    try:
        x = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
        rms_norm(x, torch.ones(1024, device="cuda", dtype=torch.bfloat16), EPS)
    finally:
        norm.native = original
    assert calls, "rms_norm on a bf16 CUDA tensor did not reach the extension"


def test_bad_arguments_raise_clear_errors():
    x = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(1024, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        rms_norm(x, w.float(), EPS)
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm(torch.randn(1024, 8, device="cuda", dtype=torch.bfloat16).t(), w, EPS)
    with pytest.raises(ValueError, match="shape"):
        rms_norm(x, torch.ones(512, device="cuda", dtype=torch.bfloat16), EPS)
    with pytest.raises(ValueError, match="cpu"):
        rms_norm(x, w.cpu(), EPS)
    with pytest.raises(ValueError, match="shape"):
        fused_add_rms_norm(x, torch.randn(3, 1024, device="cuda", dtype=torch.bfloat16), w, EPS)
    qkv = torch.randn(2, (4 + 4) * 128, device="cuda", dtype=torch.bfloat16)
    cache = torch.zeros(4, 16, 2, 128, device="cuda", dtype=torch.bfloat16)
    cos_sin = rope_cos_sin_cache(128, 64, 1e6, torch.device("cuda"))
    q_out = torch.empty(2, 4, 128, device="cuda", dtype=torch.bfloat16)
    pos = torch.tensor([0, 1], device="cuda")
    slots = torch.tensor([0, 1], device="cuda")
    wq = torch.ones(128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="int64"):
        qk_norm_rope_store_kv(qkv, wq, wq, cos_sin, pos.int(), cache, cache.clone(), slots, EPS, q_out)
    with pytest.raises(ValueError, match="qkv"):
        qk_norm_rope_store_kv(qkv[:, :-128], wq, wq, cos_sin, pos, cache, cache.clone(), slots, EPS, q_out)
    with pytest.raises(ValueError, match="cpu"):
        qk_norm_rope_store_kv(qkv, wq, wq, cos_sin.cpu(), pos, cache, cache.clone(), slots, EPS, q_out)
    # Out-of-range positions and slots are device data, not checkable without a sync: they never crash, q is NaN.
    qk_norm_rope_store_kv(
        qkv,
        wq,
        wq,
        cos_sin,
        torch.tensor([0, 10_000], device="cuda"),
        cache,
        cache.clone(),
        torch.tensor([0, 1_000_000], device="cuda"),
        EPS,
        q_out,
    )
    torch.cuda.synchronize()
    assert torch.isnan(q_out[1]).all() and not torch.isnan(q_out[0]).any()
