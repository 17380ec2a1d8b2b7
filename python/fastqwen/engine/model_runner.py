"""Turns a scheduled batch into a ForwardBatch, runs the model and samples one token per sampling sequence."""

from __future__ import annotations

import logging

import numpy as np
import torch

from .. import ops
from ..kvcache import KVPool
from ..model import ForwardBatch, Qwen3Model
from ..ops.sampling import SamplingBatch, step_seed
from ..scheduler import Request, ScheduledBatch, TokenLogprobs
from .cuda_graph import DecodeGraphs, fill_padding
from .sampler import GpuSampler
from .staging import BatchStaging, Layout, staging_for

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: Qwen3Model,
        kv: KVPool,
        eos_token_ids: list[int],
        seed: int = 0,
        staging: BatchStaging | None = None,
        cuda_graph_max_bs: int = 0,
        sampler: GpuSampler | None = None,
    ):
        self.model = model
        self.kv = kv
        self.device = model.device
        self.eos_token_ids = list(eos_token_ids)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        max_model_len = model.cos_sin_cache.shape[0]
        self.staging = staging or staging_for(8192, 256, max_model_len, kv.page_size, self.device)
        self._arange = np.arange(self.staging.max_seqs + 1, dtype=np.int64)  # logits_indices / query_start of a graph
        # The CUDA sampler on GPU (penalty counts kept on the device, engine/sampler.py); None: the references.
        self.sampler = sampler
        self.graphs: DecodeGraphs | None = None
        self._graph_batches: dict[int, ForwardBatch] = {}
        # Page-table rows already in the staging buffer at the last graph size: (request, pages written) per row.
        # Decode batches keep their order from step to step, so a step usually writes only the new pages.
        self._table_size = 0
        self._table_rows: list[tuple[Request, int]] = []
        if cuda_graph_max_bs > 0:
            # The sampler (frozen by the engine) is captured after the LM head: a decode step is one replay and one
            # read-back.
            post_logits = self.sampler.launch_captured if self.sampler is not None else None
            self.graphs = DecodeGraphs(model, kv, self.staging, cuda_graph_max_bs, post_logits).capture()
            self._graph_batches = {size: self.graphs.batch(size) for size in self.graphs.sizes}
            log.info(
                "captured %d CUDA graphs for decode batches up to %d in %.2f s, using %.0f MiB",
                len(self.graphs.sizes), self.graphs.max_bs, self.graphs.capture_seconds,
                self.graphs.memory_bytes / 2**20,
            )  # fmt: skip
        # The one read-back of a step: sampled tokens, through pinned memory, then a wait on this event.
        self._tokens_host = torch.empty(self.staging.max_seqs, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self._tokens_ready = torch.cuda.Event() if self.device.type == "cuda" else None

    def _to_device(self, values, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def build_batch(self, scheduled: ScheduledBatch) -> ForwardBatch:
        return self._build(scheduled)[0]

    def _build(self, scheduled: ScheduledBatch) -> tuple[ForwardBatch, int]:
        """The step's ForwardBatch, uploaded, and the padded graph size that replays it (0 = run eager)."""
        chunks = scheduled.chunks
        graphs = self.graphs
        if (
            graphs is not None and len(chunks) <= graphs.max_bs and scheduled.is_decode and all(c.samples for c in chunks)
            and (self.sampler is None or self.sampler.fits_graph([c.request for c in chunks]))
        ):  # fmt: skip
            size = graphs.padded_size(len(chunks))
            return self._build_graph_decode(chunks, size), size
        return self._build_eager(scheduled), 0

    def _build_graph_decode(self, chunks, size: int) -> ForwardBatch:
        """One token per sequence, written at the graph's layout; rows past the batch are padding."""
        page_size = self.kv.page_size
        layout = self.graphs.layout(size)
        views = self.staging.host_views(layout)
        page_table = views["page_table"]
        if self._table_size != size:
            self._table_size, self._table_rows = size, []
        written = self._table_rows
        ids, positions, slots, kv_lens, temperatures = [], [], [], [], []
        for row, chunk in enumerate(chunks):
            request, pos = chunk.request, chunk.start
            pages = request.pages
            ids.append(request.token_ids[pos])
            positions.append(pos)
            slots.append(pages[pos // page_size] * page_size + pos % page_size)
            kv_lens.append(chunk.end)
            temperatures.append(request.params.temperature)
            # A running request's pages only grow. The kernel reads no entry past kv_len: stale tails are harmless.
            if row < len(written) and written[row][0] is request:
                have = written[row][1]
                if len(pages) > have:
                    page_table[row, have : len(pages)] = pages[have:]
                    written[row] = (request, len(pages))
            else:
                page_table[row, : len(pages)] = pages
                if row < len(written):
                    written[row] = (request, len(pages))
                else:
                    written.append((request, len(pages)))
        n = len(chunks)
        views["input_ids"][:n] = ids
        views["positions"][:n] = positions
        views["out_slots"][:n] = slots
        views["kv_lens"][:n] = kv_lens
        views["temperatures"][:n] = temperatures
        fill_padding(views, n, size)
        views["logits_indices"][:] = self._arange[:size]
        views["query_start"][:] = self._arange[: size + 1]
        self.staging.upload(layout)
        graph_batch = self._graph_batches[size]
        return ForwardBatch(
            input_ids=graph_batch.input_ids, positions=graph_batch.positions, out_slots=graph_batch.out_slots,
            query_start=graph_batch.query_start, kv_lens=graph_batch.kv_lens, page_table=graph_batch.page_table,
            logits_indices=graph_batch.logits_indices[:n], temperatures=graph_batch.temperatures[:n],
            is_decode=True, all_greedy=all(t == 0.0 for t in temperatures),
        )  # fmt: skip

    def _build_eager(self, scheduled: ScheduledBatch) -> ForwardBatch:
        """Any batch, packed at its own shape; page-table rows as wide as its longest sequence, zero-filled."""
        self._table_size = 0  # this layout may overwrite the graph layouts' page-table rows
        page_size = self.kv.page_size
        chunks = scheduled.chunks
        num_samples = sum(1 for c in chunks if c.samples)
        width = max(len(c.request.pages) for c in chunks)
        layout = Layout(scheduled.num_tokens, len(chunks), num_samples, width)
        views = self.staging.host_views(layout)
        input_ids, positions, out_slots = views["input_ids"], views["positions"], views["out_slots"]
        query_start, kv_lens, page_table = views["query_start"], views["kv_lens"], views["page_table"]
        logits_indices, temperatures = views["logits_indices"], views["temperatures"]
        query_start[0] = 0
        t = s = max_query_len = 0
        for row, chunk in enumerate(chunks):
            request, start, end = chunk.request, chunk.start, chunk.end
            pages = request.pages
            n = end - start
            max_query_len = max(max_query_len, n)
            input_ids[t : t + n] = request.token_ids[start:end]
            if n == 1:
                positions[t] = start
                out_slots[t] = pages[start // page_size] * page_size + start % page_size
            else:
                span = np.arange(start, end, dtype=np.int64)
                positions[t : t + n] = span
                out_slots[t : t + n] = np.asarray(pages, dtype=np.int64)[span // page_size] * page_size + span % page_size
            t += n
            query_start[row + 1] = t
            kv_lens[row] = end
            page_table[row, : len(pages)] = pages
            page_table[row, len(pages) :] = 0  # the reference paths gather whole rows
            if chunk.samples:
                logits_indices[s] = t - 1
                temperatures[s] = request.params.temperature
                s += 1
        self.staging.upload(layout)
        v = self.staging.device_views(layout)
        return ForwardBatch(
            input_ids=v["input_ids"], positions=v["positions"], out_slots=v["out_slots"],
            query_start=v["query_start"], kv_lens=v["kv_lens"], page_table=v["page_table"],
            logits_indices=v["logits_indices"], temperatures=v["temperatures"], is_decode=scheduled.is_decode,
            all_greedy=not temperatures.any(),
            max_query_len=max_query_len,
        )  # fmt: skip

    def run_model(self, batch: ForwardBatch, graph_size: int = 0) -> torch.Tensor:
        """float32 logits [S, vocab]: a replay of the graph of graph_size when non-zero, the eager forward otherwise."""
        if graph_size:
            return self.graphs.replay(graph_size)[: batch.logits_indices.shape[0]]
        return self.model.forward(batch, self.kv)

    def _read_back(self, tokens: torch.Tensor) -> list[int]:
        """The step's one device-to-host transfer: a non-blocking copy into pinned memory, then a wait for it."""
        if self._tokens_ready is None or tokens.shape[0] > self._tokens_host.shape[0]:
            return tokens.tolist()
        host = self._tokens_host[: tokens.shape[0]]
        host.copy_(tokens, non_blocking=True)
        self._tokens_ready.record()
        self._tokens_ready.synchronize()
        return host.tolist()

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
        batch, graph_size = self._build(scheduled)
        if graph_size and self.sampler is not None:  # the graph samples too: its rows are filled before the replay
            requests = [c.request for c in scheduled.chunks]
            self.sampler.prepare(requests, pad_to=graph_size)
            self.run_model(batch, graph_size)
            token_list = self._read_back(self.sampler.tokens[: len(requests)])
            return token_list, self.sampler.results(requests, token_list)
        logits = self.run_model(batch, graph_size)
        if logits.shape[0] == 0:  # only unfinished prefill chunks: KV written, nothing to sample
            return [], None
        requests = [c.request for c in scheduled.chunks if c.samples]
        if self.sampler is not None:
            return self.sampler.sample(logits[: len(requests)], requests, self._read_back)
        want_logprobs = [r.params.logprobs for r in requests]
        raw = logits.clone() if any(n is not None for n in want_logprobs) else None
        self._process_logits(logits, requests)
        tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=self.device)
        ops.sample(logits, self._sampling_batch(requests, batch.temperatures), tokens, generator=self.generator)
        if raw is None:
            return self._read_back(tokens), None
        num_top = max(n for n in want_logprobs if n is not None)
        chosen, top_ids, top_logprobs = ops.compute_logprobs(raw, tokens, num_top)
        token_list = self._read_back(tokens)
        chosen, top_ids, top_logprobs = chosen.tolist(), top_ids.tolist(), top_logprobs.tolist()
        logprobs = [
            None if n is None else TokenLogprobs(token_list[i], chosen[i], list(zip(top_ids[i][:n], top_logprobs[i][:n])))
            for i, n in enumerate(want_logprobs)
        ]
        return token_list, logprobs
