"""Turns a scheduled batch into a ForwardBatch, runs the model and samples one token per sampling sequence."""

from __future__ import annotations

import torch

from .. import ops
from ..kvcache import KVPool
from ..model import DECODE_SPLITS, ForwardBatch, Qwen3Model
from ..ops.sampling import SamplingBatch, step_seed
from ..scheduler import Request, ScheduledBatch, TokenLogprobs


class ModelRunner:
    def __init__(self, model: Qwen3Model, kv: KVPool, eos_token_ids: list[int], seed: int = 0):
        self.model = model
        self.kv = kv
        self.device = model.device
        self.eos_token_ids = list(eos_token_ids)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def _to_device(self, values, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

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

        return ForwardBatch(
            input_ids=self._to_device(input_ids, torch.int64),
            positions=self._to_device(positions, torch.int64),
            out_slots=self._to_device(out_slots, torch.int64),
            query_start=self._to_device(query_start, torch.int32),
            kv_lens=self._to_device(kv_lens, torch.int32),
            page_table=self._to_device(page_table, torch.int32).view(len(page_table), max_pages),
            logits_indices=self._to_device(logits_indices, torch.int64),
            temperatures=self._to_device(temperatures, torch.float32),
            is_decode=scheduled.is_decode,
            all_greedy=all(t == 0.0 for t in temperatures),
            decode_splits=self._decode_splits(scheduled),
        )

    def _decode_splits(self, scheduled: ScheduledBatch) -> int:
        """A fixed split count (see DECODE_SPLITS) when the decode kernel runs; 1 on the reference path."""
        if not scheduled.is_decode or self.model.decode_workspace is None:
            return 1
        return DECODE_SPLITS

    def _sampling_batch(self, requests: list[Request], temperatures: torch.Tensor) -> SamplingBatch:
        params = [r.params for r in requests]
        sampled = [p for p in params if not p.is_greedy]
        if not sampled:  # all greedy: the argmax needs none of the per-row tensors
            return SamplingBatch(temperatures, None, None, None, [], all_greedy=True, needs_filter=False)
        return SamplingBatch(
            temperatures=temperatures,
            top_k=self._to_device([p.top_k for p in params], torch.int64),
            top_p=self._to_device([p.top_p for p in params], torch.float32),
            min_p=self._to_device([p.min_p for p in params], torch.float32),
            seeds=[None if p.seed is None else step_seed(p.seed, r.num_output_tokens) for p, r in zip(params, requests)],
            all_greedy=not sampled,
            needs_filter=any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in sampled),
        )

    def _process_logits(self, logits: torch.Tensor, requests: list[Request]) -> None:
        """Penalties and min_tokens blocking, in place on the raw logits."""
        rows = [i for i, r in enumerate(requests) if r.params.has_penalties]
        if rows:
            ops.apply_penalties(
                logits,
                rows,
                [self._to_device(requests[i].prompt_ids, torch.int64) for i in rows],
                [self._to_device(requests[i].output_ids, torch.int64) for i in rows],
                [requests[i].params.repetition_penalty for i in rows],
                [requests[i].params.presence_penalty for i in rows],
                [requests[i].params.frequency_penalty for i in rows],
            )
        blocked_rows, blocked = [], []
        for i, r in enumerate(requests):
            if r.num_output_tokens < r.params.min_tokens:
                blocked_rows.append(i)
                blocked.append(r.params.stop_token_ids + ([] if r.params.ignore_eos else self.eos_token_ids))
        if blocked_rows:
            ops.block_tokens(logits, blocked_rows, blocked)

    @torch.inference_mode()
    def step(self, scheduled: ScheduledBatch) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        """Runs one step; returns the sampled token of each sampling chunk, in order, and their logprobs if asked."""
        if not scheduled.chunks:
            return [], None
        batch = self.build_batch(scheduled)
        logits = self.model.forward(batch, self.kv)
        if logits.shape[0] == 0:  # only unfinished prefill chunks: KV written, nothing to sample
            return [], None
        requests = [c.request for c in scheduled.chunks if c.samples]
        want_logprobs = [r.params.logprobs for r in requests]
        raw = logits.clone() if any(n is not None for n in want_logprobs) else None
        self._process_logits(logits, requests)
        tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=self.device)
        ops.sample(logits, self._sampling_batch(requests, batch.temperatures), tokens, generator=self.generator)
        if raw is None:
            return tokens.tolist(), None
        num_top = max(n for n in want_logprobs if n is not None)
        chosen, top_ids, top_logprobs = ops.compute_logprobs(raw, tokens, num_top)
        token_list = tokens.tolist()
        chosen, top_ids, top_logprobs = chosen.tolist(), top_ids.tolist(), top_logprobs.tolist()
        logprobs = [
            None if n is None else TokenLogprobs(token_list[i], chosen[i], list(zip(top_ids[i][:n], top_logprobs[i][:n])))
            for i, n in enumerate(want_logprobs)
        ]
        return token_list, logprobs
