"""The KV pool: K and V pages for every layer, allocated once, plus the allocator that hands the pages out."""

from __future__ import annotations

import torch

from .allocator import PageAllocator


class KVPool:
    """k[layer] and v[layer] are [num_pages, page_size, H_kv, head_dim]; a flat slot is page * page_size + offset."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two, not {page_size}")
        if num_pages < 1:
            raise ValueError(f"the KV pool needs at least one page, not {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        shape = (num_layers, 2, num_pages, page_size, num_kv_heads, head_dim)
        self._storage = torch.zeros(shape, dtype=dtype, device=device)
        self.allocator = PageAllocator(num_pages)

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def k(self, layer: int) -> torch.Tensor:
        return self._storage[layer, 0]

    def v(self, layer: int) -> torch.Tensor:
        return self._storage[layer, 1]

    @property
    def num_bytes(self) -> int:
        return self._storage.numel() * self._storage.element_size()
