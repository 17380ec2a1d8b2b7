"""The decode attention's PyTorch reference keeps the kernel's contract: it reads no page-table entry past a row's
kv_len (the engine leaves stale entries there, from other layouts that share the staging buffer), and it equals
float64 softmax attention over each row's own keys."""

from __future__ import annotations

import torch
from fastqwen.ops import paged_attention_decode


def test_decode_reads_no_page_past_kv_len():
    torch.manual_seed(0)
    pages, page_size, kv_heads, heads, dim = 6, 4, 2, 4, 128
    k_cache = torch.randn(pages, page_size, kv_heads, dim)
    v_cache = torch.randn(pages, page_size, kv_heads, dim)
    q = torch.randn(2, heads, dim)
    kv_lens = torch.tensor([3, 9], dtype=torch.int32)
    # Row 0 needs one page; its other entries hold what no pool has (as a slot value left by a verify layout).
    page_table = torch.tensor([[5, 10**6, -7], [2, 0, 4]], dtype=torch.int32)
    out = torch.empty_like(q)
    paged_attention_decode(q, k_cache, v_cache, page_table, kv_lens, 0.1, out=out)
    for b, n in enumerate(kv_lens.tolist()):
        rows = [(int(page_table[b, p // page_size]), p % page_size) for p in range(n)]
        keys = torch.stack([k_cache[pg, s] for pg, s in rows]).double()  # [n, H_kv, D]
        values = torch.stack([v_cache[pg, s] for pg, s in rows]).double()
        for h in range(heads):
            kh = h // (heads // kv_heads)
            weights = torch.softmax(keys[:, kh] @ q[b, h].double() * 0.1, dim=0)
            want = weights @ values[:, kh]
            torch.testing.assert_close(out[b, h].double(), want, atol=1e-5, rtol=1e-5)
