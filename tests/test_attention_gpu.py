"""CUDA paged attention (decode and prefill/extend) against references, outputs poisoned before each run.

Two kinds of inputs. Random ones (scattered pages, lengths that are not multiples of the page size, split-KV, cached
prefixes that end mid-page, mixed batches) against the float32 reference ops. And "planted" ones, up to 32k keys and
past every split limit, against a float64 reference: one key in every 64-token tile has a large known score and a
one-hot value, so every chunk of keys moves the output by several times the tolerance; each planted test first
checks that about its own inputs (a mutant that skips a chunk or merges chunks with the wrong weights must fail it).

Tolerances are relative to each output row's own scale (max |reference| over the 128 dims of a (token, head) row):
u = 2^-8 for bf16, 2^-11 for fp16 (unit roundoff). The kernels round the softmax weights to the input dtype before
P @ V (relative error <= u per weight) and round the output once (<= u); with the planted inputs' non-negative
one-hot values that bounds the error by 2u of the row's scale, and the tests allow 4u. With random values of both
signs the weight rounding errors do not add up coherently; the random tests allow 8u.

Mutations these tests were run against (tests/mutation_check.py builds each into its own copy of the module and
expects the named tests to fail; the log is in git show 1274b3f:bench/results/2026-11-23-h100-tests/):
  decode_skip_first_chunk, decode_merge_skips_last_chunk, decode_merge_equal_weights, decode_ignores_split_limit
      -> test_decode_every_chunk_counts
  prefill_skips_first_tile, prefill_no_rescale -> test_prefill_every_tile_counts
  prefill_hopper_drops_the_last_partial_tile, prefill_hopper_causal_offset_ignores_the_prefix
      -> test_prefill_every_tile_counts, test_prefill_long_and_wide (their [hopper] cases)
Every prefill test runs on both prefill kernels (the prefill_kernel fixture).
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from checkpoints import record_result
from fastqwen.ops import decode_workspace, paged_attention_decode, paged_attention_prefill, plan_decode
from fastqwen.ops._native import has_cuda_kernels, native
from fastqwen.ops.attention import (
    paged_attention_decode_reference,
    paged_attention_prefill_reference,
    prefill_uses_hopper_kernel,
    set_hopper_prefill,
)
from fastqwen.ops.kv_fp8 import quantize_kv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and has_cuda_kernels()), reason="needs a CUDA GPU and the kernels"
    ),
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
    assert_within_scale(out, want, 8 * unit_roundoff(q.dtype), "decode")
    return out


def unit_roundoff(dtype: torch.dtype) -> float:
    return 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11


def assert_within_scale(out: torch.Tensor, want: torch.Tensor, rel: float, what: str) -> float:
    """Every (token, head) row of out within rel times that row's own scale (max |want| over the head dim).
    Returns the worst error as a fraction of the tolerance."""
    err = (out.double() - want.double()).abs().amax(-1)
    scale = want.double().abs().amax(-1)
    ratio = err / (rel * scale)
    worst = float(ratio.max())
    assert worst <= 1.0, (
        f"{what}: {int((ratio > 1).sum())} of {ratio.numel()} rows differ by more than {rel:.1e} of their scale; "
        f"worst {worst * rel:.2e} at row {divmod(int(ratio.argmax()), ratio.shape[-1])}"
    )
    return worst


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


@pytest.mark.parametrize("kv", ["bf16", "fp16", "fp8"])
@pytest.mark.parametrize("growth", [3.0, 24.0])
def test_decode_running_max_grows_along_the_keys(kv, growth):
    """Scores that grow along each sequence by `growth` (log2 units) every 64 keys for a group's first head, so that
    each warp's running max moves at every tile, by a little (3) or a lot (24): random scores move it almost only at
    a row's first tile. Hundreds of log2 units in all: a kernel that stopped moving the max overflows, and one that
    moved it without rescaling the sum or the output scales them wrong by about the number of tiles. Against the
    float32 reference over the same pool, 8 unit roundoffs of each row's scale."""
    dtype = torch.float16 if kv == "fp16" else torch.bfloat16
    lens = [1000, 3000, 130, 64, 4097]
    group, scale = 4, 128**-0.5
    q, k, v, table, kv_lens = make_case(len(lens), 2, group, 16, lens, dtype, seed=int(growth))
    for b, n in enumerate(lens):
        pos = torch.arange(n, device="cuda")
        pages, slots = table[b, pos // 16].long(), pos % 16
        for h in range(2):
            q0 = q[b, h * group].float()
            # q0 . k_j = growth * j / 64 log2 units of the kernel's scores (scale * log2(e) each)
            coeff = growth * pos.float() / 64 / (scale * math.log2(math.e) * q0.dot(q0))
            k[pages, slots, h] = (coeff[:, None] * q0).to(dtype)
    if kv == "fp8":
        k, v = quantize_kv(k, 1.0), quantize_kv(v, 1.0)  # (|k| stays under e4m3's 448)
    out = torch.full_like(q, float("nan"))
    paged_attention_decode(q, k, v, table, kv_lens, scale, out)
    assert torch.isfinite(out).all(), "overflowed or unwritten output"
    want = paged_attention_decode_reference(q, k, v, table, kv_lens, scale)
    assert_within_scale(out, want, 8 * unit_roundoff(dtype), f"decode, scores growing by {growth} every 64 keys")


def test_decode_shared_workspace_planned_once():
    """The engine plans once per step and runs every layer with planned=True on one workspace."""
    lens = [4000, 20, 9000]
    q, k, v, table, kv_lens = make_case(len(lens), 2, 4, 16, lens, torch.bfloat16, seed=3)
    workspace = decode_workspace(8, q.shape[1], q.device)
    plan_decode(kv_lens, workspace, k)
    first = torch.empty_like(q)
    paged_attention_decode(q, k, v, table, kv_lens, 128**-0.5, first, workspace, planned=True)
    second = check(q, k, v, table, kv_lens, workspace)
    assert torch.equal(first, second)
    # 4000 tokens: 16 chunks of 256 (the minimum); 20: one; 9000: 29 chunks of 320 (282 rounded up to the tile), with
    # 2 KV heads on a GPU of at least 64 SMs (at most SMs / 2 chunks, and 32).
    if max_splits(2) == 32:
        assert workspace.split_offsets[:4].tolist() == [0, 16, 17, 46]
    assert not workspace.plan_fresh, "the decode after a plan was launched as if the plan were older"
    assert workspace.part_lse.shape[0] == 8 * q.shape[1] * native().DECODE_MAX_SPLITS  # sized by csrc/attention.h


def decode_bitwise_both_ways(lens, group, seed, fp8, setter, default):
    """Decode of a case of `lens` (2 KV heads of `group` query heads, pages of 16; FP8 caches if fp8) with the
    extension's `setter` on, then off (restored to `default` after): every output written both times, and the same
    bit for bit. Returns the case and the output."""
    q, k, v, table, kv_lens = make_case(len(lens), 2, group, 16, lens, torch.bfloat16, seed=seed)
    if fp8:
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    outs = []
    try:
        for on in (True, False):
            getattr(native(), setter)(on)
            out = torch.full_like(q, float("nan"))
            paged_attention_decode(q, k, v, table, kv_lens, 128**-0.5, out)
            outs.append(out)
    finally:
        getattr(native(), setter)(default)
    assert not torch.isnan(outs[0]).any() and not torch.isnan(outs[1]).any(), "unwritten output"
    assert torch.equal(outs[0], outs[1])
    return (q, k, v, table, kv_lens), outs[0]


@pytest.mark.parametrize("fp8, group", [(False, 4), (False, 8), (True, 4), (True, 8)])
def test_decode_pipeline_across_items_is_bitwise_the_pipeline_started_afresh(fp8, group):
    """A block's loads run on into its next work item (its Q and first tiles) while it finishes one, and the item's
    warps merge in the stage its last tile came from. Against the kernel that starts each item's pipeline afresh:
    bit for bit, over 700 sequences (every block takes many items, of one to nine tiles, and empty ones: length 0),
    every output written; and (bf16 caches) within the tolerance of `check` against the reference."""
    gen = random.Random(11 + group)
    lens = [gen.choice([0, 1, 15, 64, 65, 200, 640, 1023, 1300, 2100]) for _ in range(300)]
    lens += [gen.randint(1, 1300) for _ in range(400)]
    (q, k, v, table, kv_lens), out = decode_bitwise_both_ways(
        lens, group, 13 + group, fp8, "set_paged_attention_decode_prefetch_next", default=True
    )
    assert not out[kv_lens == 0].any(), "an empty sequence's output is zero"
    if not fp8:  # (the FP8 cache's own tolerances are test_fp8_kv_gpu.py's)
        rows = kv_lens > 0  # (the reference's softmax over no keys is NaN)
        want = paged_attention_decode_reference(q[rows], k, v, table[rows], kv_lens[rows], 128**-0.5)
        assert_within_scale(out[rows], want, 8 * unit_roundoff(q.dtype), "decode across items")


@pytest.mark.parametrize("kv_dtype, min_chunk", [(torch.bfloat16, 256), (torch.float8_e4m3fn, 1024)])
def test_decode_plan_writes_the_record_of_every_chunk(kv_dtype, min_chunk):
    """The plan's chunk offsets, then from the next multiple of 4 each chunk's record (its sequence, first and end
    token, its index | the sequence's chunk count << 8), against the chunk length worked out independently (1,500
    sequences: the plan's block takes them in two passes); the offsets are those of a plan made without records."""
    gen = random.Random(5)
    lens = [4000, 20, 9000, 0, 1, 255, 256, 257, 20000] + [gen.randint(1, 1300) for _ in range(1491)]
    kv_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    workspace = decode_workspace(len(lens), 8, kv_lens.device)
    cache = torch.empty(0, 16, 8, 128, dtype=kv_dtype, device=kv_lens.device)  # (the plan reads its type and KV heads)
    batch = len(lens)
    try:
        native().set_paged_attention_decode_item_records(False)
        plan_decode(kv_lens, workspace, cache)
    finally:
        native().set_paged_attention_decode_item_records(True)
    offsets = workspace.split_offsets[: batch + 1].tolist()
    plan_decode(kv_lens, workspace, cache)
    plan = workspace.split_offsets.tolist()
    assert plan[: batch + 1] == offsets
    want_counts = []
    for n in lens:  # csrc/attention_decode.cu's chunk_len, independently
        clen = chunk_tokens(n, min_chunk, 8)
        want_counts.append(max(1, -(-n // clen)))
    assert [offsets[b + 1] - offsets[b] for b in range(batch)] == want_counts
    at = -(-(batch + 1) // 4) * 4
    want_records = []
    for b, (n, count) in enumerate(zip(lens, want_counts)):
        clen = chunk_tokens(n, min_chunk, 8)
        want_records += [[b, c * clen, min(n, (c + 1) * clen), c | count << 8] for c in range(count)]
    assert [plan[at + 4 * c : at + 4 * c + 4] for c in range(offsets[batch])] == want_records


def test_decode_split_limit_follows_the_sms_and_kv_heads():
    """The plan cuts a sequence into at most SMs / KV heads chunks (32 at most) while they stay within 1,792 tokens,
    longer ones into up to 32; a benchmark's limit replaces the rule until 0 restores it, and a limit outside
    0 .. DECODE_MAX_SPLITS is refused."""
    lens = [16448, 4160, 4032, 300, 28672, 28673, 131072]
    kv_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    workspace = decode_workspace(len(lens), 32, kv_lens.device)

    def splits(kv_heads):
        plan_decode(kv_lens, workspace, torch.empty(0, 16, kv_heads, 128, dtype=torch.bfloat16, device="cuda"))
        offsets = workspace.split_offsets[: len(lens) + 1].tolist()
        return [b - a for a, b in zip(offsets, offsets[1:])]

    def want(kv_heads, limit=None):
        return [-(-n // chunk_tokens(n, 256, kv_heads, limit)) for n in lens]

    for kv_heads in (1, 4, 8, 16):
        assert native().paged_attention_decode_max_splits(kv_heads) == max_splits(kv_heads)
        assert splits(kv_heads) == want(kv_heads), kv_heads
    if max_splits(8) == 16:  # an H100 or H200 (132 SMs): 16 chunks up to 28,672 tokens
        assert want(8) == [16, 13, 16, 2, 16, 30, 32]
    try:
        native().set_paged_attention_decode_max_splits(32)
        assert splits(8) == want(8, 32) == [29, 17, 16, 2, 32, 30, 32]
        native().set_paged_attention_decode_max_splits(5)
        assert splits(8) == want(8, 5)
    finally:
        native().set_paged_attention_decode_max_splits(0)
    assert splits(8) == want(8)
    for bad in (-1, native().DECODE_MAX_SPLITS + 1):
        with pytest.raises(ValueError, match="splits must be in"):
            native().set_paged_attention_decode_max_splits(bad)
    with pytest.raises(ValueError, match="num_kv_heads"):
        native().paged_attention_decode_max_splits(0)


@pytest.mark.parametrize("fp8, group", [(False, 4), (True, 8)])
def test_decode_with_item_records_is_bitwise_the_search(fp8, group):
    """Work items read from the plan's chunk records, copied items ahead (the default), against each item searched in the
    chunk offsets: bit for bit, over 700 sequences (blocks of many items: empty ones, one-tile ones, chunks of long
    sequences), every output written."""
    gen = random.Random(23 + group)
    lens = [gen.choice([0, 1, 64, 65, 300, 1300, 5000, 9000]) for _ in range(300)]
    lens += [gen.randint(1, 1300) for _ in range(400)]
    decode_bitwise_both_ways(lens, group, 29 + group, fp8, "set_paged_attention_decode_item_records", default=True)


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


def hopper_prefill_runs_here() -> bool:
    """Whether the one rule in ops/ picks the Hopper kernel for a 16-bit cache of 16-token pages on this device (with
    the kernel switched on)."""
    probe = torch.empty(1, 1, 128, dtype=torch.bfloat16, device="cuda")
    return prefill_uses_hopper_kernel(probe, torch.empty(1, 16, 1, 128, dtype=torch.bfloat16, device="cuda"))


@pytest.fixture(params=["hopper", "tensor_cores"])
def prefill_kernel(request):
    """Runs a prefill test on each kernel: csrc/attention_prefill_hopper.cu (where the device has it: 16-bit caches,
    pages of 16 or more) and csrc/attention_prefill.cu."""
    previous = set_hopper_prefill(request.param == "hopper")
    if request.param == "hopper":
        if not hopper_prefill_runs_here():
            set_hopper_prefill(previous)
            pytest.skip("no Hopper prefill kernel on this device")
    yield request.param
    set_hopper_prefill(previous)


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
    assert_within_scale(out, want, 8 * unit_roundoff(q.dtype), "prefill")


def prefill_lengths(rng: random.Random, page_size: int) -> tuple[list[int], list[int]]:
    """(q_lens, kv_lens) of a prefill case: whole prompts, 1-token sequences (decode rows of a mixed batch), extends
    whose cached prefix ends mid-page (the query block straddles it), lengths around the 128-row tile and the 64-key
    tile."""
    q_lens = [1, 1, 7, 33, 64, 65, 200, rng.randint(1, 300)]
    prefixes = [0, rng.randint(1, 500), 0, page_size + 3, 0, 37, rng.randint(1, 700), 0]
    return q_lens, [a + b for a, b in zip(q_lens, prefixes)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 2, 4, 5, 8])
@pytest.mark.parametrize("page_size", [1, 16, 128])
def test_prefill_matches_reference(dtype, group, page_size, prefill_kernel):
    q_lens, kv_lens = prefill_lengths(random.Random(group * 1000 + page_size), page_size)
    check_prefill(*make_prefill_case(2, group, page_size, q_lens, kv_lens, dtype, seed=group + page_size))


@pytest.mark.parametrize("page_size", [2, 4, 8, 32, 64, 1024])
def test_prefill_other_page_sizes(page_size, prefill_kernel):  # under 16: the tensor-core kernel either way
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
def test_prefill_long_and_wide(q_lens, prefixes, prefill_kernel):
    kv_lens = [a + b for a, b in zip(q_lens, prefixes)]
    check_prefill(*make_prefill_case(8, 4, 16, q_lens, kv_lens, torch.bfloat16, seed=len(q_lens)))


# The Hopper kernel's pipelines (csrc/attention.h); 32 in a build without CUDA kernels, so that the test ids
# tests/mutation_check.py names exist wherever the tests are collected.
HOPPER_VARIANTS = getattr(native(), "PREFILL_HOPPER_VARIANTS", 32)


@pytest.mark.parametrize("variant", range(HOPPER_VARIANTS))
def test_hopper_prefill_every_pipeline_matches_reference(variant):
    """Each pipeline of the Hopper kernel (set_paged_attention_prefill_hopper_variant: overlap, ping-pong, two or three
    stages, static or dynamic schedule, Q loaded by the consumers or copied by the producer; the default is one of
    them, the others are benchmarked) on ragged prompts and extends (the last sequence's Q tile reaching past q's last
    row), both dtypes, groups of 4 and 8 (a Q tile is one box) and 5 (it is not: the consumers load it), and work
    items that loop over several query tiles (max_query_len understated)."""
    previous_kernel = set_hopper_prefill(True)
    previous_variant = native().set_paged_attention_prefill_hopper_variant(variant)
    try:
        if not hopper_prefill_runs_here():
            pytest.skip("no Hopper prefill kernel on this device")
        for dtype, group, seed in ((torch.bfloat16, 4, 1), (torch.float16, 8, 2), (torch.bfloat16, 5, 4)):
            q_lens, kv_lens = prefill_lengths(random.Random(seed), 16)
            check_prefill(*make_prefill_case(2, group, 16, q_lens, kv_lens, dtype, seed=seed))
        check_prefill(*make_prefill_case(2, 4, 16, [700, 20], [900, 20], torch.bfloat16, seed=5), max_query_len=1)
        q_lens, prefixes = [512, 1, 300], [32768 - 512, 9000, 4000]  # extends past the 2- and 3-stage rings' wrap
        kv_lens = [a + b for a, b in zip(q_lens, prefixes)]
        check_prefill(*make_prefill_case(8, 4, 16, q_lens, kv_lens, torch.bfloat16, seed=3))
    finally:
        native().set_paged_attention_prefill_hopper_variant(previous_variant)
        set_hopper_prefill(previous_kernel)


@pytest.mark.parametrize("kv_len", [257, 386, 4098, 5000])
def test_prefill_query_rows_do_not_depend_on_the_rows_after_them(kv_len, prefill_kernel):
    """Speculative decoding verifies a position as row 0 of one step and, when a replay's draft comes true, as row 3
    of a step whose keys end 3 tokens earlier: its attention output must be the same bits, or greedy replays drift
    apart (issue 42's replay test). Two 128-row steps over one sequence: A's queries at kv_len - 128 .. kv_len - 1,
    B's at kv_len - 131 .. kv_len - 4, sharing 125 positions. At 257, 386 and 4098 A's last key starts a 128-key
    tile, which is wholly masked for the shared rows; at 5000 both steps read the same tiles.

    What breaks the property is small: a rescale by 1 +- a few ulps, of O and l alike, which mostly cancels in O / l,
    so few output elements change their bf16 bits: 3 shared rows (12,288 elements) let such a bug pass on an H100,
    with and without scaled queries. Hence 125 shared rows (512,000 elements), and queries scaled by 16 (exact) so
    that the scores reach a model's magnitudes (tens; randn's, about 3, give rounding residues too small for exp2 to
    move off 1)."""
    rows = 128
    q_all, k_cache, v_cache, _, table, _ = make_prefill_case(
        8, 4, 16, [rows + 3], [kv_len], torch.bfloat16, seed=kv_len
    )
    q_all *= 16

    def step(part: slice, length: int) -> torch.Tensor:  # q_all[i] is position kv_len - rows - 3 + i
        q = q_all[part].contiguous()
        out = torch.full_like(q, float("nan"))
        starts = torch.tensor([0, q.shape[0]], dtype=torch.int32, device="cuda")
        lens = torch.tensor([length], dtype=torch.int32, device="cuda")
        paged_attention_prefill(q, k_cache, v_cache, starts, table, lens, 128**-0.5, out, q.shape[0])
        return out

    a, b = step(slice(3, rows + 3), kv_len), step(slice(0, rows), kv_len - 3)
    assert not torch.isnan(a).any() and not torch.isnan(b).any()
    differ = (a[: rows - 3] != b[3:]).sum().item()
    assert differ == 0, f"{differ} of {a[: rows - 3].numel()} elements differ"


def test_prefill_small_max_query_len_still_complete(prefill_kernel):
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


# ---------------------------------------------------------------------------------------------------------------
# Planted keys: every chunk of keys counts, up to 32k keys and past every split limit.

PLANT_PERIOD = 64  # one planted key per 64-token tile (the kernels' K/V tile), so every tile and chunk holds one
PLANT_GAP = 20.0  # natural-log score of a planted key over the others: the others weigh e^-20 each
MIN_CHUNK, KV_TILE = 256, 64  # mirrors kMinChunk in csrc/attention_decode.cu and kKVTile in csrc/paged_kv.cuh


LONG_CHUNK = 1792  # mirrors kLongChunk in csrc/attention_decode.cu


def max_splits(kv_heads: int) -> int:
    """csrc/attention.h's decode_max_splits, from the GPU's SM count: one work item per SM over the KV heads, at most
    DECODE_MAX_SPLITS chunks a sequence."""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return min(native().DECODE_MAX_SPLITS, max(1, sms // kv_heads))


def chunk_tokens(length: int, min_chunk: int, kv_heads: int, limit: int | None = None) -> int:
    """The chunk length of csrc/attention_decode.cu's plan: a multiple of the 64-token tile, at least min_chunk; at
    most max_splits(kv_heads) chunks while they stay within LONG_CHUNK tokens, else up to DECODE_MAX_SPLITS; with a
    benchmark's `limit`, at most that many chunks at any length."""
    want = -(-length // (limit or max_splits(kv_heads)))
    if limit is None and want > LONG_CHUNK:
        want = -(-length // native().DECODE_MAX_SPLITS)
    return -(-max(min_chunk, want) // KV_TILE) * KV_TILE


def decode_chunks(length: int, kv_heads: int) -> list[tuple[int, int]]:
    """The split plan of csrc/attention_decode.cu (chunk_tokens; 256-token chunks at least, so with 2 KV heads they
    grow above 8,192 tokens)."""
    chunk = chunk_tokens(length, MIN_CHUNK, kv_heads)
    return [(s, min(length, s + chunk)) for s in range(0, max(length, 1), chunk)]


def make_planted_case(kv_heads, group, page_size, kv_lens, q_lens, dtype, seed):
    """Paged K/V for sequences of kv_lens tokens, and queries for the last q_lens[b] tokens of each ([B, H, D] when
    q_lens is None: decode). Every query head of KV head h is u_h plus a little noise (u_h: random signs); key p of a
    sequence is planted when p % 64 == 0: beta * u_h with a score of PLANT_GAP + U(0, 1) + 0.5 p / len, and the value
    e_d (one-hot; d runs through the head dim, so the keys of different tiles and chunks land in different dims).
    The other keys and values are random and weigh e^-20 each. Returns (q, k_cache, v_cache, table, kv_lens) as
    make_case does, plus the float64 keys and values of each sequence."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dim, heads = 128, kv_heads * group
    u = torch.randint(0, 2, (kv_heads, dim), device="cuda", generator=gen).double() * 2 - 1
    pages_per_seq = [-(-n // page_size) for n in kv_lens]
    total_pages = sum(pages_per_seq) + 3
    k_cache = torch.zeros(total_pages, page_size, kv_heads, dim, dtype=dtype, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    order = torch.randperm(total_pages, device="cuda", generator=gen)
    table = torch.zeros(len(kv_lens), max(pages_per_seq), dtype=torch.int32, device="cuda")
    keys, values, used = [], [], 0
    for b, n in enumerate(kv_lens):
        table[b, : pages_per_seq[b]] = order[used : used + pages_per_seq[b]].int()
        used += pages_per_seq[b]
        k = 0.3 * torch.randn(n, kv_heads, dim, device="cuda", generator=gen, dtype=torch.float64)
        v = torch.randn(n, kv_heads, dim, device="cuda", generator=gen, dtype=torch.float64)
        planted = torch.arange(0, n, PLANT_PERIOD, device="cuda")
        score = PLANT_GAP + torch.rand(len(planted), kv_heads, device="cuda", generator=gen, dtype=torch.float64)
        score += 0.5 * planted[:, None] / n
        k[planted] = (score / math.sqrt(dim))[..., None] * u  # q . k * dim^-0.5 = score for q = u
        v[planted] = 0
        hot = (torch.arange(len(planted), device="cuda")[:, None] + 37 * torch.arange(kv_heads, device="cuda")) % dim
        v[planted[:, None], torch.arange(kv_heads, device="cuda"), hot] = 1.0
        k, v = k.to(dtype), v.to(dtype)
        pos = torch.arange(n, device="cuda")
        slots = table[b, pos // page_size].long() * page_size + pos % page_size
        k_cache.view(-1, kv_heads, dim)[slots] = k
        v_cache.view(-1, kv_heads, dim)[slots] = v
        keys.append(k.double())
        values.append(v.double())
    rows = len(kv_lens) if q_lens is None else sum(q_lens)
    q = u.repeat_interleave(group, 0) + 0.1 * torch.randn(
        rows, heads, dim, device="cuda", generator=gen, dtype=torch.float64
    )
    lens = torch.tensor(kv_lens, dtype=torch.int32, device="cuda")
    return q.to(dtype), k_cache, v_cache, table, lens, keys, values


def chunk_pieces(q_rows, keys, values, chunks, scale):
    """float64 log-sum-exp and normalized output of each chunk of keys, for query rows [R, H, D] that see all of
    them: ([R, H, C], [R, H, C, D])."""
    rows, heads, dim = q_rows.shape
    kv_heads = keys.shape[1]
    qg = q_rows.view(rows, kv_heads, heads // kv_heads, dim)
    scores = torch.einsum("rkgd,jkd->rkgj", qg, keys).reshape(rows, heads, -1) * scale
    lse, out = [], []
    for start, end in chunks:
        s = scores[..., start:end]
        lse.append(torch.logsumexp(s, -1))
        p = torch.softmax(s, -1).view(rows, kv_heads, -1, end - start)
        out.append(torch.einsum("rkgj,jkd->rkgd", p, values[start:end]).reshape(rows, heads, dim))
    return torch.stack(lse, -1), torch.stack(out, -2)


def merged(lse, out, weights=None):
    """Chunks merged by their softmax mass (weights=None), or with the given weights [..., C] (mutants)."""
    w = torch.softmax(lse, -1) if weights is None else weights / weights.sum(-1, keepdim=True)
    return (w[..., None] * out).sum(-2)


def assert_every_chunk_counts(lse, out, rel, what, margin=2.0) -> dict:
    """Skipping any one chunk, or merging the chunks with equal weights, moves some row of the output by at least
    `margin` times the test's tolerance: so a mutant that does either fails the test. Returns the smallest such
    moves, in tolerances."""
    want = merged(lse, out)
    tol = rel * want.abs().amax(-1)  # [R, H]
    chunks = lse.shape[-1]
    if chunks < 2:
        return {"chunks": chunks}
    smallest_skip = float("inf")
    for c in range(chunks):
        keep = torch.ones(chunks, dtype=torch.bool, device=lse.device)
        keep[c] = False
        dropped = merged(lse[..., keep], out[..., keep, :])
        moved = float(((dropped - want).abs().amax(-1) / tol).max())
        assert moved >= margin, f"{what}: skipping chunk {c} of {chunks} moves the output by only {moved:.2f} x tol"
        smallest_skip = min(smallest_skip, moved)
    equal = merged(lse, out, torch.ones_like(lse))
    moved = float(((equal - want).abs().amax(-1) / tol).max())
    assert moved >= margin, (
        f"{what}: an equal-weight merge of {chunks} chunks moves the output by only {moved:.2f} x tol"
    )
    return {"chunks": chunks, "skip_moves_tol": round(smallest_skip, 2), "equal_merge_moves_tol": round(moved, 2)}


def check_each(cases, check) -> None:
    """check(case) for every case; fails afterwards listing every case that failed (a mutant's log then shows all
    the lengths it breaks, not only the first)."""
    failures = []
    for case in cases:
        try:
            check(case)
        except AssertionError as e:
            failures.append(str(e).splitlines()[0])
    assert not failures, f"{len(failures)} of {len(cases)} failed:\n" + "\n".join(failures)


# Around and past the split limits: 256 (one chunk), 257 (two), 8192 (32 chunks of 256), 8193 / 9000 (32 chunks of
# more than 256), 16384, 20000, 32768 (32 chunks of 512, 640, 1024).
PLANTED_DECODE_LENGTHS = [
    1,
    63,
    64,
    65,
    255,
    256,
    257,
    511,
    1000,
    4096,
    4097,
    8191,
    8192,
    8193,
    9000,
    16384,
    20000,
    32768,
]


@pytest.mark.parametrize(
    "dtype,group,kv_heads,search",
    [
        (torch.bfloat16, 1, 2, False),
        (torch.bfloat16, 4, 2, False),
        (torch.bfloat16, 8, 2, False),
        (torch.float16, 4, 2, False),
        (torch.bfloat16, 4, 8, False),
        (torch.bfloat16, 4, 8, True),
    ],
)
def test_decode_every_chunk_counts(dtype, group, kv_heads, search):
    """With 8 KV heads the split limit (SMs / 8 on this GPU: 16 on an H100) cuts fewer, longer chunks than with 2 up
    to 1,792 tokens a chunk (20,000 tokens: 16 chunks of 1,280; 28,672: 16 of 1,792; 28,673: 30; 32,768: 32). (The
    2-head cases keep their lengths: the planted draws, and so each case's margins, follow the batch.) With search,
    the plan writes no chunk records and the kernel works each item out from the offsets, by the split rule."""
    lens = PLANTED_DECODE_LENGTHS + ([28672, 28673] if kv_heads == 8 else [])
    q, k_cache, v_cache, table, kv_lens, keys, values = make_planted_case(
        kv_heads, group, 16, lens, None, dtype, seed=group
    )
    scale = 128**-0.5
    workspace = decode_workspace(len(lens), q.shape[1], q.device)
    out = torch.full_like(q, float("nan"))
    try:
        native().set_paged_attention_decode_item_records(not search)
        paged_attention_decode(q, k_cache, v_cache, table, kv_lens, scale, out, workspace)
    finally:
        native().set_paged_attention_decode_item_records(True)
    assert not torch.isnan(out).any(), "unwritten output"
    plans = [decode_chunks(n, kv_heads) for n in lens]
    rel = 4 * unit_roundoff(dtype)
    figures = {}

    def check_sequence(b):
        n = lens[b]
        lse, parts = chunk_pieces(q[b : b + 1].double(), keys[b], values[b], plans[b], scale)
        figures[n] = assert_every_chunk_counts(lse, parts, rel, f"length {n}")
        figures[n]["error_tol"] = round(
            assert_within_scale(
                out[b : b + 1], merged(lse, parts), rel, f"decode of {n} keys ({len(plans[b])} chunks)"
            ),
            3,
        )

    check_each(range(len(lens)), check_sequence)
    name = f"decode_{str(dtype).removeprefix('torch.')}_group{group}" + ("" if kv_heads == 2 else f"_kv{kv_heads}")
    name += "_search" if search else ""
    record_result("planted_attention.json", name, figures)
    # The chunks checked above are the kernel's own (else the check would prove nothing about its chunks).
    offsets = [0]
    for plan in plans:
        offsets.append(offsets[-1] + len(plan))
    assert workspace.split_offsets[: len(lens) + 1].tolist() == offsets, "the kernel's split plan changed"


def prefill_reference(q, keys, values, q_len, scale, block=512):
    """float64 causal attention of the last q_len of len(keys) tokens, [q_len, H, D]."""
    n, kv_heads, dim = keys.shape
    heads = q.shape[1]
    outs = []
    for s in range(0, q_len, block):
        e = min(q_len, s + block)
        qg = q[s:e].double().view(e - s, kv_heads, heads // kv_heads, dim)
        scores = torch.einsum("ikgd,jkd->ikgj", qg, keys) * scale
        q_pos = torch.arange(n - q_len + s, n - q_len + e, device=q.device)
        future = torch.arange(n, device=q.device)[None, :] > q_pos[:, None]  # [queries, keys]
        scores.masked_fill_(future[:, None, None, :], float("-inf"))
        outs.append(torch.einsum("ikgj,jkd->ikgd", torch.softmax(scores, -1), values).reshape(e - s, heads, dim))
    return torch.cat(outs)


@pytest.mark.parametrize(
    "q_lens,prefixes",
    [
        ([4096], [0]),  # a whole prompt: 64 tiles
        ([300], [32768 - 300]),  # extend at the end of a 32768-token sequence: 512 tiles
        ([1, 1, 129, 700, 1], [9000, 16383, 8000, 12000, 63]),  # decode rows beside extends past 8k and 16k keys
    ],
    ids=["prompt4096", "extend32768", "mixed"],
)
def test_prefill_every_tile_counts(q_lens, prefixes, prefill_kernel):
    kv_lens = [a + b for a, b in zip(q_lens, prefixes)]
    q, k_cache, v_cache, table, lens, keys, values = make_planted_case(
        2, 4, 16, kv_lens, q_lens, torch.bfloat16, seed=len(q_lens)
    )
    scale = 128**-0.5
    starts = torch.tensor([0] + q_lens, dtype=torch.int64).cumsum(0).to(torch.int32).cuda()
    out = torch.full_like(q, float("nan"))
    paged_attention_prefill(q, k_cache, v_cache, starts, table, lens, scale, out)
    assert not torch.isnan(out).any(), "unwritten output"
    rel = 4 * unit_roundoff(torch.bfloat16)
    firsts = [sum(q_lens[:b]) for b in range(len(q_lens))]
    figures = {}

    def check_sequence(b):
        q_len, n = q_lens[b], kv_lens[b]
        rows = slice(firsts[b], firsts[b] + q_len)
        # The last row sees every key: every 64-key tile of it must count.
        tiles = [(s, min(n, s + KV_TILE)) for s in range(0, n, KV_TILE)]
        lse, parts = chunk_pieces(q[rows][-1:].double(), keys[b], values[b], tiles, scale)
        figures[f"{q_len}/{n}"] = assert_every_chunk_counts(lse, parts, rel, f"sequence {b} ({n} keys)")
        want = prefill_reference(q[rows], keys[b], values[b], q_len, scale)
        figures[f"{q_len}/{n}"]["error_tol"] = round(
            assert_within_scale(out[rows], want, rel, f"prefill of {q_len} queries over {n} keys"), 3
        )

    check_each(range(len(q_lens)), check_sequence)
    record_result("planted_attention.json", f"prefill_{prefill_kernel}_{len(q_lens)}seq_{max(kv_lens)}", figures)
