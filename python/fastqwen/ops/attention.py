"""Paged attention over the KV pool, for decode (one query token per sequence) and prefill/extend.

K/V caches are [num_pages, page_size, H_kv, D]; page_table[b, i] is the i-th page of sequence b; kv_lens[b] counts
every cached token of b including this step's. Query heads are grouped: head h reads KV head h // (H / H_kv).
The references compute in float32 and round the output once.
"""

from __future__ import annotations

import torch


def _gather_kv(cache: torch.Tensor, page_table_row: torch.Tensor, kv_len: int) -> torch.Tensor:
    page_size = cache.shape[1]
    pos = torch.arange(kv_len, device=cache.device)
    slots = page_table_row[pos // page_size].long() * page_size + pos % page_size
    return cache.view(-1, cache.shape[2], cache.shape[3])[slots]  # [kv_len, H_kv, D]


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """q [B, H, D] -> out [B, H, D]; sequence b attends to its kv_lens[b] cached tokens."""
    batch, num_heads, head_dim = q.shape
    if batch == 0:
        return out
    num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    max_kv = int(kv_lens.max())
    pos = torch.arange(max_kv, device=q.device)
    slots = page_table[:, pos // page_size].long() * page_size + pos % page_size  # [B, max_kv]
    keys = k_cache.view(-1, num_kv_heads, head_dim)[slots].float()  # [B, max_kv, H_kv, D]
    values = v_cache.view(-1, num_kv_heads, head_dim)[slots].float()
    qg = q.float().view(batch, num_kv_heads, group, head_dim)
    scores = torch.einsum("bkgd,bjkd->bkgj", qg, keys) * scale
    invalid = pos[None, :] >= kv_lens[:, None].long()  # [B, max_kv]
    scores.masked_fill_(invalid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    result = torch.einsum("bkgj,bjkd->bkgd", probs, values).reshape(batch, num_heads, head_dim)
    out.copy_(result)
    return out


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """q [T, H, D] packed by sequence (query_start [B+1]) -> out [T, H, D].

    The q tokens of sequence b are the last (query_start[b+1] - query_start[b]) of its kv_lens[b] tokens, so the
    causal mask is aligned to the end: query i sees keys 0 .. kv_len - q_len + i.
    """
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
        keys = _gather_kv(k_cache, page_table[b], kv_len).float()
        values = _gather_kv(v_cache, page_table[b], kv_len).float()
        qg = q[s:e].float().view(q_len, num_kv_heads, group, head_dim)
        scores = torch.einsum("ikgd,jkd->kgij", qg, keys) * scale  # [H_kv, g, q_len, kv_len]
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
        k_pos = torch.arange(kv_len, device=q.device)
        scores.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        result = torch.einsum("kgij,jkd->ikgd", probs, values).reshape(q_len, num_heads, head_dim)
        out[s:e].copy_(result)
    return out
