"""Paged attention over the KV pool, for decode (one query token per sequence) and prefill/extend.

K/V caches are [num_pages, page_size, H_kv, D]; page_table[b, i] is the i-th page of sequence b; kv_lens[b] counts
every cached token of b including this step's. Query heads are grouped: head h reads KV head h // (H / H_kv).
The caches hold q's dtype, or FP8 e4m3 with one scale per tensor (k_scale, v_scale: ops/kv_fp8.py); the FP8 kernels
read e4m3, turn it into fp16 in registers (exact) and run the tensor cores in fp16 (q is rounded to fp16, exact for
|q| in [2^-14, 65504]). The references compute in float32 on the dequantized cache and round the output once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._native import check_tensors, dtype_code, kernel_applies, native, stream_of
from .kv_fp8 import dequantize_kv, gather_rows, is_fp8


def attention_kernel_applies(
    on_gpu: bool, dtype: torch.dtype, head_dim: int, kv_dtype: torch.dtype | None = None
) -> bool:
    """Whether paged_attention_decode / _prefill run their CUDA kernel (else the reference) for q on the GPU or not,
    of this dtype and head size, over caches of kv_dtype (default: q's): the rule csrc/attention.h states, read from
    the extension."""
    if not (kernel_applies("paged_attention", on_gpu, dtype) and head_dim == native().ATTENTION_HEAD_DIM):
        return False
    return kv_dtype is None or kv_dtype == dtype or (is_fp8(kv_dtype) and kernel_applies("kv_cache", on_gpu, kv_dtype))


@dataclass
class DecodeWorkspace:
    """Scratch of split-KV decode, allocated once: the plan (chunk offsets per sequence, then each chunk's record,
    written on the device by plan_decode: csrc/attention.h) and the chunks' partial outputs and log-sum-exps, for
    batches of up to max_batch sequences."""

    split_offsets: torch.Tensor  # int32 [_C.decode_plan_ints(max_batch)]: offsets [B + 1], then records (attention.h)
    part_out: torch.Tensor  # float32 [max_batch * num_heads * _C.DECODE_MAX_SPLITS, head_dim]
    part_lse: torch.Tensor  # float32 [max_batch * num_heads * _C.DECODE_MAX_SPLITS]
    max_batch: int
    num_heads: int
    # Set by plan_decode, cleared by the first decode after it: that decode may follow the plan's kernel directly, and
    # the kernel reads the plan before it waits for the kernel before it (csrc/attention.h, plan_fresh).
    plan_fresh: bool = True


def decode_workspace(max_batch: int, num_heads: int, device: torch.device) -> DecodeWorkspace:
    """For the decode kernel (needs the extension: its split limit and head size size the scratch)."""
    m = native()
    rows = max_batch * num_heads * m.DECODE_MAX_SPLITS
    return DecodeWorkspace(
        split_offsets=torch.zeros(m.decode_plan_ints(max_batch), dtype=torch.int32, device=device),
        part_out=torch.empty(rows, m.ATTENTION_HEAD_DIM, dtype=torch.float32, device=device),
        part_lse=torch.empty(rows, dtype=torch.float32, device=device),
        max_batch=max_batch,
        num_heads=num_heads,
    )


def decode_workspace_bytes(max_batch: int, num_heads: int) -> int:
    """Device bytes decode_workspace(max_batch, num_heads) allocates (the split plan and the partial outputs and
    log-sum-exps), for budgeting memory before it exists."""
    m = native()
    rows = max_batch * num_heads * m.DECODE_MAX_SPLITS
    return 4 * (m.decode_plan_ints(max_batch) + rows * m.ATTENTION_HEAD_DIM + rows)


def plan_decode(kv_lens: torch.Tensor, workspace: DecodeWorkspace, k_cache: torch.Tensor) -> None:
    """Once per step, before the layers: how each sequence is cut into chunks, from kv_lens on the device (no host
    sync, so it can be captured in a CUDA graph). The cut depends only on each sequence's own length, on the cache the
    decode reads (k_cache [pages, page_size, H_kv, D]: FP8 chunks are longer, and the KV heads bound the chunks a
    sequence is cut into on this GPU, csrc/attention.h's decode_max_splits) and on the GPU, which keeps a request's
    attention independent of the batch it runs in."""
    batch = kv_lens.shape[0]
    if batch > workspace.max_batch:
        raise ValueError(f"plan_decode: batch {batch} exceeds the workspace's {workspace.max_batch}")
    check_tensors("plan_decode", workspace.split_offsets.device, torch.int32, kv_lens=kv_lens)
    native().paged_attention_decode_plan(
        kv_lens.data_ptr(),
        workspace.split_offsets.data_ptr(),
        batch,
        is_fp8(k_cache.dtype),
        k_cache.shape[2],
        stream_of(kv_lens),
    )
    workspace.plan_fresh = True


def _gather_kv(cache: torch.Tensor, page_table_row: torch.Tensor, kv_len: int, scale: float) -> torch.Tensor:
    """float32 [kv_len, H_kv, D]: the sequence's cached rows, dequantized."""
    page_size = cache.shape[1]
    pos = torch.arange(kv_len, device=cache.device)
    slots = page_table_row[pos // page_size].long() * page_size + pos % page_size
    return dequantize_kv(gather_rows(cache.view(-1, cache.shape[2], cache.shape[3]), slots), scale)


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    workspace: DecodeWorkspace | None = None,
    planned: bool = False,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q [B, H, D] -> out [B, H, D]; sequence b attends to its kv_lens[b] cached tokens.

    page_table and kv_lens are int32. On bf16 / fp16 CUDA tensors with head_dim 128 (caches of q's dtype or FP8
    e4m3, whose values are e4m3 * k_scale and * v_scale) this is the kernel in csrc/attention_decode.cu; it needs a
    workspace (one is made when none is given) whose plan is made here unless planned=True says plan_decode already
    ran for these kv_lens this step. Otherwise the reference.
    """
    batch, num_heads, head_dim = q.shape
    if batch == 0:
        return out
    if attention_kernel_applies(q.is_cuda, q.dtype, head_dim, k_cache.dtype):
        _decode_kernel(q, k_cache, v_cache, page_table, kv_lens, scale, out, workspace, planned, k_scale, v_scale)
        return out
    out.copy_(paged_attention_decode_reference(q, k_cache, v_cache, page_table, kv_lens, scale, k_scale, v_scale))
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch,
    scale: float,
    out: torch.Tensor,
    decode_workspace: DecodeWorkspace | None = None,
    planned: bool = False,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """A model step's attention (batch: a ForwardBatch, model/forward_batch.py): paged_attention_decode when every
    sequence computes one token, else paged_attention_prefill with the batch's longest query run (the batch builder
    knows it: no read-back)."""
    if batch.is_decode:
        return paged_attention_decode(
            q,
            k_cache,
            v_cache,
            batch.page_table,
            batch.kv_lens,
            scale,
            out,
            decode_workspace,
            planned,
            k_scale,
            v_scale,
        )
    return paged_attention_prefill(
        q,
        k_cache,
        v_cache,
        batch.query_start,
        batch.page_table,
        batch.kv_lens,
        scale,
        out,
        batch.max_query_len or None,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def paged_attention_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """float32 math over gathered (and dequantized) pages; returns [B, H, D] in q's dtype."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    max_kv = int(kv_lens.max())
    pos = torch.arange(max_kv, device=q.device)
    invalid = pos[None, :] >= kv_lens[:, None].long()  # [B, max_kv]
    # As the kernel, no page-table entry past a row's kv_len is read: the caller may leave anything there.
    slots = page_table[:, pos // page_size].long().masked_fill(invalid, 0) * page_size + pos % page_size
    keys = dequantize_kv(gather_rows(k_cache.view(-1, num_kv_heads, head_dim), slots), k_scale)  # [B, max_kv, H_kv, D]
    values = dequantize_kv(gather_rows(v_cache.view(-1, num_kv_heads, head_dim), slots), v_scale)
    qg = q.float().view(batch, num_kv_heads, group, head_dim)
    scores = torch.einsum("bkgd,bjkd->bkgj", qg, keys) * scale
    scores.masked_fill_(invalid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bkgj,bjkd->bkgd", probs, values).reshape(batch, num_heads, head_dim).to(q.dtype)


def _check_paged(op: str, batch: int, q, out, k_cache, v_cache, page_table, kv_lens, **more) -> None:
    """The arguments both attention kernels take: shapes first, then device, dtype and contiguity (ValueError)."""
    if out.shape != q.shape:
        raise ValueError(f"{op}: out has shape {tuple(out.shape)}, expected {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[3] != q.shape[2]:
        raise ValueError(f"{op}: k_cache and v_cache must both be [pages, page_size, H_kv, 128]")
    if k_cache.dtype != v_cache.dtype or not (k_cache.dtype == q.dtype or is_fp8(k_cache.dtype)):
        raise ValueError(
            f"{op}: the caches must both hold {q.dtype} or float8_e4m3fn, not {k_cache.dtype} and {v_cache.dtype}"
        )
    if page_table.dim() != 2 or page_table.shape[0] != batch or kv_lens.shape != (batch,):
        raise ValueError(f"{op}: page_table must be [B, max_pages] and kv_lens [B], for B = {batch} sequences")
    check_tensors(
        op,
        q.device,
        q.dtype,
        q=q,
        out=out,
        k_cache=(k_cache, None),
        v_cache=(v_cache, None),
        page_table=(page_table, torch.int32),
        kv_lens=(kv_lens, torch.int32),
        **more,
    )


def _decode_kernel(q, k_cache, v_cache, page_table, kv_lens, scale, out, workspace, planned, k_scale, v_scale) -> None:
    batch, num_heads, head_dim = q.shape
    _check_paged("paged_attention_decode", batch, q, out, k_cache, v_cache, page_table, kv_lens)
    if workspace is None:
        workspace, planned = decode_workspace(batch, num_heads, q.device), False
    if batch > workspace.max_batch or num_heads > workspace.num_heads:
        raise ValueError(
            f"paged_attention_decode: the workspace holds {workspace.max_batch} sequences of "
            f"{workspace.num_heads} heads, not {batch} of {num_heads}"
        )
    check_tensors(
        "paged_attention_decode",
        q.device,
        torch.float32,
        part_out=workspace.part_out,
        part_lse=workspace.part_lse,
        split_offsets=(workspace.split_offsets, torch.int32),
    )
    if not planned:
        plan_decode(kv_lens, workspace, k_cache)
    m = native()
    args = m.DecodeArgs()
    _fill_paged(args, q, out, k_cache, v_cache, page_table, kv_lens, batch, scale, k_scale, v_scale)
    args.split_offsets = workspace.split_offsets.data_ptr()
    args.part_out = workspace.part_out.data_ptr()
    args.part_lse = workspace.part_lse.data_ptr()
    args.workspace_rows = workspace.part_lse.shape[0]
    args.plan_fresh, workspace.plan_fresh = workspace.plan_fresh, False
    m.paged_attention_decode(args)


def _fill_paged(args, q, out, k_cache, v_cache, page_table, kv_lens, batch: int, scale, k_scale, v_scale) -> None:
    """The fields both attention kernels take (csrc/attention.h, PagedAttentionArgs)."""
    args.q, args.out = q.data_ptr(), out.data_ptr()
    args.k_cache, args.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
    args.page_table, args.kv_lens = page_table.data_ptr(), kv_lens.data_ptr()
    args.batch, args.num_heads, args.head_dim = batch, q.shape[1], q.shape[2]
    args.num_pages, args.page_size, args.num_kv_heads = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
    args.max_pages = page_table.shape[1]
    args.scale = scale
    args.dtype, args.kv_dtype = dtype_code(q.dtype), dtype_code(k_cache.dtype)
    args.k_scale, args.v_scale = k_scale, v_scale
    args.stream = stream_of(q)


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    max_query_len: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q [T, H, D] packed by sequence (query_start [B+1]) -> out [T, H, D].

    The q tokens of sequence b are the last (query_start[b+1] - query_start[b]) of its kv_lens[b] tokens, so the
    causal mask is aligned to the end: query i sees keys 0 .. kv_len - q_len + i. On bf16 / fp16 CUDA tensors with
    head_dim 128 this is the tensor-core kernel in csrc/attention_prefill.cu; max_query_len (the longest q_len)
    sizes its grid and is read back from the device when not given. FP8 caches as in paged_attention_decode.
    Otherwise the reference.
    """
    head_dim = q.shape[2]
    if q.shape[0] == 0 or query_start.shape[0] <= 1:
        return out
    if attention_kernel_applies(q.is_cuda, q.dtype, head_dim, k_cache.dtype):
        _prefill_kernel(
            q, k_cache, v_cache, query_start, page_table, kv_lens, scale, out, max_query_len, k_scale, v_scale
        )
        return out
    return paged_attention_prefill_reference(
        q, k_cache, v_cache, query_start, page_table, kv_lens, scale, out, k_scale, v_scale
    )


def _prefill_kernel(
    q, k_cache, v_cache, query_start, page_table, kv_lens, scale, out, max_query_len, k_scale, v_scale
) -> None:
    batch = query_start.shape[0] - 1
    _check_paged(
        "paged_attention_prefill",
        batch,
        q,
        out,
        k_cache,
        v_cache,
        page_table,
        kv_lens,
        query_start=(query_start, torch.int32),
    )
    if max_query_len is None:
        max_query_len = int((query_start[1:] - query_start[:-1]).max())
    m = native()
    args = m.PrefillArgs()
    _fill_paged(args, q, out, k_cache, v_cache, page_table, kv_lens, batch, scale, k_scale, v_scale)
    args.query_start = query_start.data_ptr()
    args.max_query_len = max_query_len
    args.num_tokens = q.shape[0]
    if prefill_uses_hopper_kernel(q, k_cache):
        m.paged_attention_prefill_hopper(args)
    else:
        m.paged_attention_prefill(args)


_hopper_prefill_enabled = True
_hopper_prefill_devices: dict[int, bool] = {}


def prefill_uses_hopper_kernel(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """The one rule between the two prefill kernels: csrc/attention_prefill_hopper.cu (TMA + wgmma) on a Hopper GPU
    the extension was built for (sm_90a), for caches of q's dtype or FP8 e4m3 with pages of 16 or more tokens;
    everything else (smaller pages, other GPUs) takes csrc/attention_prefill.cu."""
    cache_ok = k_cache.dtype in (q.dtype, torch.float8_e4m3fn)
    if not (_hopper_prefill_enabled and q.is_cuda and cache_ok and k_cache.shape[1] >= 16):
        return False
    device = q.device.index if q.device.index is not None else torch.cuda.current_device()
    if device not in _hopper_prefill_devices:
        _hopper_prefill_devices[device] = bool(native().paged_attention_prefill_hopper_available(device))
    return _hopper_prefill_devices[device]


def set_hopper_prefill(enabled: bool) -> bool:
    """Whether prefill may take the Hopper kernel (default on); returns the previous setting. For tests and
    benchmarks that compare the two kernels."""
    global _hopper_prefill_enabled
    previous, _hopper_prefill_enabled = _hopper_prefill_enabled, bool(enabled)
    return previous


def paged_attention_prefill_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """float32 math per sequence over gathered (and dequantized) pages, written into out."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    starts = query_start.tolist()
    lens = kv_lens.tolist()
    for b, kv_len in enumerate(lens):
        s, e = starts[b], starts[b + 1]
        q_len = e - s
        if q_len == 0:
            continue
        keys = _gather_kv(k_cache, page_table[b], kv_len, k_scale)
        values = _gather_kv(v_cache, page_table[b], kv_len, v_scale)
        qg = q[s:e].float().view(q_len, num_kv_heads, group, head_dim)
        scores = torch.einsum("ikgd,jkd->kgij", qg, keys) * scale  # [H_kv, g, q_len, kv_len]
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
        k_pos = torch.arange(kv_len, device=q.device)
        scores.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        result = torch.einsum("kgij,jkd->ikgd", probs, values).reshape(q_len, num_heads, head_dim)
        out[s:e].copy_(result)
    return out
