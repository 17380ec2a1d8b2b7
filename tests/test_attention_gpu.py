"""CUDA paged decode attention against the float32 reference, on fresh random inputs with scattered pages,
lengths that are not multiples of the page size, and split-KV; outputs poisoned before each run."""

from __future__ import annotations

import random

import pytest
import torch

from fastqwen.ops import decode_workspace, paged_attention_decode
from fastqwen.ops._native import has_cuda_kernels
from fastqwen.ops.attention import paged_attention_decode_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and has_cuda_kernels()), reason="needs a CUDA GPU and the kernels"),
]


def make_case(batch, kv_heads, group, page_size, lens, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    heads = kv_heads * group
    pages_per_seq = [-(-n // page_size) for n in lens]
    total_pages = sum(pages_per_seq) + 5
    k_cache = torch.randn(total_pages, page_size, kv_heads, 128, device="cuda", generator=gen).to(dtype)
    v_cache = torch.randn(total_pages, page_size, kv_heads, 128, device="cuda", generator=gen).to(dtype)
    order = torch.randperm(total_pages, device="cuda", generator=gen).tolist()  # scattered, not contiguous
    max_pages = max(pages_per_seq)
    table = torch.zeros(batch, max_pages, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_per_seq):
        table[b, :n] = torch.tensor(order[used : used + n], dtype=torch.int32)
        used += n
    q = torch.randn(batch, heads, 128, device="cuda", generator=gen).to(dtype)
    return q, k_cache, v_cache, table.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda")


def check(q, k_cache, v_cache, table, lens, splits):
    scale = 128**-0.5
    out = torch.full_like(q, float("nan"))
    workspace = decode_workspace(q.shape[0] * q.shape[1] * splits, q.device) if splits > 1 else None
    paged_attention_decode(q, k_cache, v_cache, table, lens, scale, out, splits, workspace)
    want = paged_attention_decode_reference(q, k_cache, v_cache, table, lens, scale)
    assert not torch.isnan(out).any(), "unwritten output"
    tol = 2**-7 if q.dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(out.float(), want.float(), rtol=2 * tol, atol=2e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 2, 4, 5, 8])
@pytest.mark.parametrize("page_size", [1, 16, 128])
@pytest.mark.parametrize("splits", [1, 3, 16])
def test_decode_matches_reference(dtype, group, page_size, splits):
    rng = random.Random(group * 100 + page_size + splits)
    batch = 7
    lens = [1, 2, 17, page_size, page_size + 1] + [rng.randint(1, 3000) for _ in range(batch - 5)]
    check(*make_case(batch, 2, group, page_size, lens, dtype, seed=group + page_size), splits)


@pytest.mark.parametrize("batch,length,splits", [(1, 16384, 33), (1, 32768, 64), (64, 777, 1), (300, 40, 1)])
def test_decode_long_and_wide(batch, length, splits):
    lens = [length - i % 5 for i in range(batch)]
    check(*make_case(batch, 8, 4, 16, lens, torch.bfloat16, seed=length), splits)


def test_decode_bad_arguments():
    q, k, v, table, lens = make_case(2, 2, 4, 16, [5, 9], torch.bfloat16, seed=1)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="int32"):
        paged_attention_decode(q, k, v, table.long(), lens, 0.1, out)
    with pytest.raises(ValueError, match="workspace"):
        paged_attention_decode(q, k, v, table, lens, 0.1, out, num_splits=4)
    with pytest.raises(ValueError, match="shape"):
        paged_attention_decode(q, k, v, table, lens, 0.1, out[:1])
    with pytest.raises(ValueError, match="cpu"):
        paged_attention_decode(q, k, v, table.cpu(), lens, 0.1, out)
