"""The KV pool: K and V pages for every layer, allocated once, plus the allocator that hands the pages out."""

from __future__ import annotations

import torch

from .allocator import PageAllocator


class KVPool:
    """k[layer] and v[layer] are [num_pages, page_size, H_kv, head_dim]; a flat slot is page * page_size + offset.

    dtype is the model's, or torch.float8_e4m3fn: then each layer's K and V hold value / scale in e4m3 (one byte an
    entry, so twice the tokens in the same memory), with one scale per tensor: k_scales[layer], v_scales[layer]
    (1.0 unless a checkpoint provides them). A 16-bit pool's scales are 1.0.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        k_scales: list[float] | None = None,
        v_scales: list[float] | None = None,
    ):
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two, not {page_size}")
        if num_pages < 1:
            raise ValueError(f"the KV pool needs at least one page, not {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = dtype
        self.k_scales = self._scales(k_scales, num_layers, dtype, "k_scales")
        self.v_scales = self._scales(v_scales, num_layers, dtype, "v_scales")
        shape = (num_layers, 2, num_pages, page_size, num_kv_heads, head_dim)
        self._storage = torch.zeros(shape, dtype=dtype, device=device)
        self.allocator = PageAllocator(num_pages)

    @staticmethod
    def _scales(scales: list[float] | None, num_layers: int, dtype: torch.dtype, name: str) -> list[float]:
        if scales is None:
            return [1.0] * num_layers
        scales = [float(s) for s in scales]
        if len(scales) != num_layers:
            raise ValueError(f"{name} needs one scale per layer ({num_layers}), got {len(scales)}")
        if dtype != torch.float8_e4m3fn and any(s != 1.0 for s in scales):
            raise ValueError(f"{name}: only an FP8 pool is scaled")
        if not all(0.0 < s < float("inf") for s in scales):
            raise ValueError(f"{name} must be positive and finite")
        return scales

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
