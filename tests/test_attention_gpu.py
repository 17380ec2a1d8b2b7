"""CUDA paged attention (decode and prefill/extend) against the float32 references, on fresh random inputs with
scattered pages, lengths that are not multiples of the page size, split-KV, cached prefixes that end mid-page and
mixed batches; outputs poisoned before each run."""

from __future__ import annotations

import random

import pytest
import torch

from fastqwen.ops import decode_workspace, paged_attention_decode, paged_attention_prefill, plan_decode
from fastqwen.ops._native import has_cuda_kernels, native
from fastqwen.ops.attention import paged_attention_decode_reference, paged_attention_prefill_reference

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


def check(q, k_cache, v_cache, table, lens, workspace=None):
    scale = 128**-0.5
    out = torch.full_like(q, float("nan"))
    paged_attention_decode(q, k_cache, v_cache, table, lens, scale, out, workspace)
    want = paged_attention_decode_reference(q, k_cache, v_cache, table, lens, scale)
    assert not torch.isnan(out).any(), "unwritten output"
    # As for prefill: the softmax weights are rounded to the input dtype before P @ V, the output once more.
    p_eps = 2**-8 if q.dtype == torch.bfloat16 else 2**-10
    out_eps = 2**-7 if q.dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(out.float(), want.float(), rtol=2 * out_eps, atol=p_eps * float(v_cache.abs().max()))
    return out


# Lengths around the split thresholds: chunks are >= 256 tokens, multiples of the 64-token tile, at most 32 per
# sequence (so 4096 and 16384 tokens split into 16 chunks of 256 and 32 of 512).
SPLIT_LENGTHS = [255, 256, 257, 511, 513, 1000, 4096, 4097, 5000]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 2, 4, 5, 8])
@pytest.mark.parametrize("page_size", [1, 16, 128])
def test_decode_matches_reference(dtype, group, page_size):
    rng = random.Random(group * 100 + page_size)
    lens = [1, 2, 17, 63, 64, 65, page_size, page_size + 1] + SPLIT_LENGTHS + [rng.randint(1, 6000) for _ in range(4)]
    check(*make_case(len(lens), 2, group, page_size, lens, dtype, seed=group + page_size))


@pytest.mark.parametrize("batch,length", [(1, 16384), (1, 32768), (64, 777), (300, 40), (512, 300)])
def test_decode_long_and_wide(batch, length):
    lens = [length - i % 5 for i in range(batch)]
    check(*make_case(batch, 8, 4, 16, lens, torch.bfloat16, seed=length))


def test_decode_is_batch_invariant():
    """A sequence's output is bitwise the same alone, first or last in a batch, beside short or long neighbours."""
    lens = [5000, 3, 300, 17000, 64, 1]
    q, k, v, table, kv_lens = make_case(len(lens), 8, 4, 16, lens, torch.bfloat16, seed=11)
    together = check(q, k, v, table, kv_lens)
    for b in range(len(lens)):
        alone = check(q[b : b + 1], k, v, table[b : b + 1], kv_lens[b : b + 1])
        assert torch.equal(alone[0], together[b])
    order = list(reversed(range(len(lens))))
    reordered = check(q[order], k, v, table[order], kv_lens[order])
    assert torch.equal(reordered, together[order])


def test_decode_shared_workspace_planned_once():
    """The engine plans once per step and runs every layer with planned=True on one workspace."""
    lens = [4000, 20, 9000]
    q, k, v, table, kv_lens = make_case(len(lens), 2, 4, 16, lens, torch.bfloat16, seed=3)
    workspace = decode_workspace(8, q.shape[1], q.device)
    plan_decode(kv_lens, workspace)
    first = torch.empty_like(q)
    paged_attention_decode(q, k, v, table, kv_lens, 128**-0.5, first, workspace, planned=True)
    second = check(q, k, v, table, kv_lens, workspace)
    assert torch.equal(first, second)
    # 4000 tokens: 16 chunks of 256 (the minimum); 20: one; 9000: 29 chunks of 320 (282 rounded up to the tile).
    assert workspace.split_offsets[:4].tolist() == [0, 16, 17, 46]
    assert workspace.part_lse.shape[0] == 8 * q.shape[1] * native().DECODE_MAX_SPLITS  # sized by csrc/attention.h


def test_decode_bad_arguments():
    q, k, v, table, lens = make_case(2, 2, 4, 16, [5, 9], torch.bfloat16, seed=1)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="int32"):
        paged_attention_decode(q, k, v, table.long(), lens, 0.1, out)
    with pytest.raises(ValueError, match="workspace"):
        paged_attention_decode(q, k, v, table, lens, 0.1, out, decode_workspace(1, q.shape[1], q.device))
    with pytest.raises(ValueError, match="shape"):
        paged_attention_decode(q, k, v, table, lens, 0.1, out[:1])
    with pytest.raises(ValueError, match="cpu"):
        paged_attention_decode(q, k, v, table.cpu(), lens, 0.1, out)


# ---------------------------------------------------------------------------------------------------------------
# Prefill / extend: q_lens new tokens at the end of kv_lens cached tokens per sequence.


def make_prefill_case(kv_heads, group, page_size, q_lens, kv_lens, dtype, seed):
    q_dec, k_cache, v_cache, table, lens = make_case(len(kv_lens), kv_heads, group, page_size, kv_lens, dtype, seed)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    q = torch.randn(sum(q_lens), kv_heads * group, 128, device="cuda", generator=gen).to(dtype)
    starts = torch.tensor([0] + q_lens, dtype=torch.int64).cumsum(0).to(torch.int32).cuda()
    return q, k_cache, v_cache, starts, table, lens


def check_prefill(q, k_cache, v_cache, starts, table, lens, max_query_len=None):
    scale = 128**-0.5
    out = torch.full_like(q, float("nan"))
    paged_attention_prefill(q, k_cache, v_cache, starts, table, lens, scale, out, max_query_len)
    want = torch.empty_like(q)
    paged_attention_prefill_reference(q, k_cache, v_cache, starts, table, lens, scale, want)
    assert not torch.isnan(out).any(), "unwritten output"
    # The kernel rounds the softmax weights to the input dtype before P @ V (relative error <= 2^-9 for bf16, 2^-11
    # for fp16), so the absolute error is bounded by that times max |v|; the output is rounded once more (rtol).
    p_eps = 2**-8 if q.dtype == torch.bfloat16 else 2**-10
    out_eps = 2**-7 if q.dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(out.float(), want.float(), rtol=2 * out_eps, atol=p_eps * float(v_cache.abs().max()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 2, 4, 5, 8])
@pytest.mark.parametrize("page_size", [1, 16, 128])
def test_prefill_matches_reference(dtype, group, page_size):
    rng = random.Random(group * 1000 + page_size)
    # Whole prompts, 1-token sequences (decode rows of a mixed batch), extends whose cached prefix ends mid-page
    # (the query block straddles it), lengths around the 128-row tile and the 64-key tile.
    q_lens = [1, 1, 7, 33, 64, 65, 200, rng.randint(1, 300)]
    prefixes = [0, rng.randint(1, 500), 0, page_size + 3, 0, 37, rng.randint(1, 700), 0]
    kv_lens = [a + b for a, b in zip(q_lens, prefixes)]
    check_prefill(*make_prefill_case(2, group, page_size, q_lens, kv_lens, dtype, seed=group + page_size))


@pytest.mark.parametrize("page_size", [2, 4, 8, 32, 64])
def test_prefill_other_page_sizes(page_size):
    q_lens, prefixes = [5, 130, 1], [3 * page_size - 1, 0, 50]
    kv_lens = [a + b for a, b in zip(q_lens, prefixes)]
    check_prefill(*make_prefill_case(4, 4, page_size, q_lens, kv_lens, torch.bfloat16, seed=page_size))


@pytest.mark.parametrize(
    "q_lens,prefixes",
    [
        ([4096], [0]),  # a whole long prompt
        ([512], [32768 - 512]),  # extend at the end of a 32768-token sequence
        ([1] * 200 + [300], [i * 7 % 900 for i in range(200)] + [1000]),  # decode rows beside a prefill chunk
        ([3] * 512, [i % 50 for i in range(512)]),  # batch of 512
    ],
    ids=["prompt4096", "extend32768", "mixed", "batch512"],
)
def test_prefill_long_and_wide(q_lens, prefixes):
    kv_lens = [a + b for a, b in zip(q_lens, prefixes)]
    check_prefill(*make_prefill_case(8, 4, 16, q_lens, kv_lens, torch.bfloat16, seed=len(q_lens)))


def test_prefill_small_max_query_len_still_complete():
    """max_query_len only sizes the grid: a smaller one makes blocks loop over more tiles, never skip them."""
    case = make_prefill_case(2, 4, 16, [700, 20], [900, 20], torch.bfloat16, seed=5)
    check_prefill(*case, max_query_len=1)


def test_prefill_bad_arguments():
    q, k, v, starts, table, lens = make_prefill_case(2, 4, 16, [3, 4], [5, 9], torch.bfloat16, seed=1)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="int32"):
        paged_attention_prefill(q, k, v, starts.long(), table, lens, 0.1, out)
    with pytest.raises(ValueError, match="shape"):
        paged_attention_prefill(q, k, v, starts, table, lens, 0.1, out[:1])
    with pytest.raises(ValueError, match="page_table"):
        paged_attention_prefill(q, k, v, starts, table[:1], lens, 0.1, out)
    with pytest.raises(ValueError, match="cpu"):
        paged_attention_prefill(q, k, v, starts, table, lens.cpu(), 0.1, out)
