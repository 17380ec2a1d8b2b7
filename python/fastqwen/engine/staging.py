"""One step's batch tensors, built in a pinned host buffer and sent to the device with one asynchronous copy.

Every tensor of a ForwardBatch is a view into one int32 buffer, at offsets that depend only on the step's shape
(tokens, sequences, sampling rows, page-table width). The host buffer (pinned on GPU) and the device buffer share
the layout, so the whole batch crosses PCIe in one non-blocking copy and the step never waits for it. A CUDA graph
captured for one shape reads the device views of that shape: filling the host views of the same shape and
uploading is all a replay needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Layout:
    """Offsets (in int32 elements) of each tensor; 64-bit tensors come first so they stay 8-byte aligned."""

    num_tokens: int
    num_seqs: int
    num_samples: int
    width: int  # pages per page-table row

    def _sizes(self) -> list[tuple[str, int]]:
        t, b, s = self.num_tokens, self.num_seqs, self.num_samples
        return [
            ("input_ids", 2 * t),
            ("positions", 2 * t),
            ("out_slots", 2 * t),
            ("logits_indices", 2 * s),
            ("query_start", b + 1),
            ("kv_lens", b),
            ("page_table", b * self.width),
        ]

    def offsets(self) -> dict[str, tuple[int, int]]:
        spans, at = {}, 0
        for name, size in self._sizes():
            spans[name] = (at, at + size)
            at += size
        return spans

    @property
    def size(self) -> int:
        return sum(size for _, size in self._sizes())


_VIEW_DTYPES = {"input_ids": "int64", "positions": "int64", "out_slots": "int64", "logits_indices": "int64"}


def _views(flat, layout: Layout, view) -> dict:
    """name -> view of `flat` (numpy or torch) with the tensor's dtype; page_table as [B, width]."""
    out = {}
    for name, (lo, hi) in layout.offsets().items():
        part = flat[lo:hi]
        if name in _VIEW_DTYPES:
            part = view(part, _VIEW_DTYPES[name])
        out[name] = part
    out["page_table"] = out["page_table"].reshape(layout.num_seqs, layout.width)
    return out


class BatchStaging:
    """The pinned host buffer, its device twin, and the one copy between them."""

    def __init__(self, max_tokens: int, max_seqs: int, max_width: int, device: torch.device):
        self.device = device
        self.max_seqs = max_seqs
        self.max_width = max_width
        capacity = -(-Layout(max_tokens, max_seqs, max_seqs, max_width).size // 4) * 4  # (16-byte copies: host gate)
        self.on_gpu = device.type == "cuda"
        self.host = torch.zeros(capacity, dtype=torch.int32, pin_memory=self.on_gpu)
        # On the CPU the model reads the host buffer itself: no copy.
        self.dev = torch.zeros(capacity, dtype=torch.int32, device=device) if self.on_gpu else self.host
        self._host_np = self.host.numpy()
        self._host_view_cache: dict[Layout, dict[str, np.ndarray]] = {}
        self.capacity = capacity
        # The host buffer may be refilled only after the previous upload has read it; a step that samples has
        # already waited for its tokens, so this wait is normally over before it starts.
        self._uploaded = torch.cuda.Event() if self.on_gpu else None

    def host_views(self, layout: Layout, wait: bool = True) -> dict[str, np.ndarray]:
        """Views of the pinned buffer at the layout's offsets, once the last upload has read it (`wait`; False only
        where the caller knows it has: ModelRunner._open_gate)."""
        if layout.size > self.capacity:
            raise RuntimeError(f"batch of {layout} does not fit the staging buffer ({self.capacity} int32)")
        if wait:
            self.wait_uploaded()
        views = self._host_view_cache.get(layout)
        if views is None:  # (views of one buffer at fixed offsets: made once per layout; steps repeat their layouts)
            if len(self._host_view_cache) >= 256:
                self._host_view_cache.clear()
            views = self._host_view_cache[layout] = _views(self._host_np, layout, lambda a, dt: a.view(np.dtype(dt)))
        return views

    def scratch_views(self, layout: Layout) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """A fresh host array of the layout's size (rounded up to 16 bytes) and its views: inputs built apart from
        the pinned buffer (a gated step's padding, sent to the device once)."""
        flat = np.zeros(-(-layout.size // 4) * 4, dtype=np.int32)
        return flat, _views(flat, layout, lambda a, dt: a.view(np.dtype(dt)))

    def wait_uploaded(self) -> None:
        """Wait until the last upload (and every copy queued before it) has read the pinned memory."""
        if self._uploaded is not None:
            self._uploaded.synchronize()

    def device_views(self, layout: Layout) -> dict[str, torch.Tensor]:
        return _views(self.dev, layout, lambda t, dt: t.view(getattr(torch, dt)))

    def upload(self, layout: Layout) -> None:
        """One non-blocking host-to-device copy of the layout's prefix of the buffer."""
        if not self.on_gpu:
            return
        n = layout.size
        self.dev[:n].copy_(self.host[:n], non_blocking=True)
        self._uploaded.record()


def staging_for(
    max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, page_size: int, device: torch.device
) -> BatchStaging:
    """A staging buffer for the largest step the scheduler can produce; page-table rows hold a whole context."""
    width = -(-max_model_len // page_size)
    return BatchStaging(max(max_num_batched_tokens, max_num_seqs), max_num_seqs, width, device)
