"""Turns a scheduled batch into a ForwardBatch, runs the model and samples one token per sampling sequence."""

from __future__ import annotations

import torch

from .. import ops
from ..kvcache import KVPool
from ..model import ForwardBatch, Qwen3Model
from ..scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model: Qwen3Model, kv: KVPool, seed: int = 0):
        self.model = model
        self.kv = kv
        self.device = model.device
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def build_batch(self, scheduled: ScheduledBatch) -> ForwardBatch:
        """Built with plain Python lists on the host, then copied to the device once per tensor."""
        page_size = self.kv.page_size
        input_ids: list[int] = []
        positions: list[int] = []
        out_slots: list[int] = []
        query_start = [0]
        kv_lens: list[int] = []
        logits_indices: list[int] = []
        temperatures: list[float] = []
        max_pages = max((len(c.request.pages) for c in scheduled.chunks), default=0)
        page_table = []
        for chunk in scheduled.chunks:
            request = chunk.request
            pages = request.pages
            input_ids.extend(request.token_ids[chunk.start : chunk.end])
            span = range(chunk.start, chunk.end)
            positions.extend(span)
            out_slots.extend(pages[p // page_size] * page_size + p % page_size for p in span)
            query_start.append(len(input_ids))
            kv_lens.append(chunk.end)
            page_table.append(pages + [0] * (max_pages - len(pages)))
            if chunk.samples:
                logits_indices.append(len(input_ids) - 1)
                temperatures.append(request.params.temperature)

        def to_device(values, dtype):
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

        return ForwardBatch(
            input_ids=to_device(input_ids, torch.int64),
            positions=to_device(positions, torch.int64),
            out_slots=to_device(out_slots, torch.int64),
            query_start=to_device(query_start, torch.int32),
            kv_lens=to_device(kv_lens, torch.int32),
            page_table=to_device(page_table, torch.int32).view(len(page_table), max_pages),
            logits_indices=to_device(logits_indices, torch.int64),
            temperatures=to_device(temperatures, torch.float32),
            is_decode=scheduled.is_decode,
            all_greedy=all(t == 0.0 for t in temperatures),
        )

    def step(self, scheduled: ScheduledBatch) -> list[int]:
        """Runs one step; returns the sampled token of each sampling chunk, in order."""
        if not scheduled.chunks:
            return []
        batch = self.build_batch(scheduled)
        logits = self.model.forward(batch, self.kv)
        if logits.shape[0] == 0:  # only unfinished prefill chunks: KV written, nothing to sample
            return []
        tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=self.device)
        ops.sample(logits, batch.temperatures, tokens, generator=self.generator, all_greedy=batch.all_greedy)
        return tokens.tolist()
