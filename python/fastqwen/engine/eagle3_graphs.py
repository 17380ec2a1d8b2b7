"""CUDA graphs of the EAGLE-3 head's draft steps (engine/eagle3_drafter.py): the k - 1 decode steps that turn each
request's first draft token into a draft of k, for a whole batch, as one graph replay instead of k - 1 eager forwards
of some thirty kernel launches each (the host, not the GPU, was what a draft step waited for).

A graph is captured per (batch size rounded up to a power of two, page-table width rounded up to a power of two, at
least 8), the first time a draft needs it. What changes from one replay to the next lives in static buffers the graph
reads: the first tokens and features (copied on the device from the step that made them), and per step each row's
position, KV slot and KV length, and the rows' page tables (one packed copy from pinned memory, not waiting for the
kernels queued before it). Rows past the batch are padding: KV slot -1 (nothing written), one cached entry on page 0
(read, not used). The replay writes each step's tokens into a static [k - 1, batch] buffer, which the drafter copies
before the next replay. The graphs' activations come from one private memory pool, outside the KV budget: a few MB
a graph at Qwen3-8B's head (its 32,000-token logits of up to max_batch rows), at most log2(max_batch) + 1 batch
sizes times the widths the requests' lengths reach.

The head's advance over the positions a verify step kept (1 to k + 1 a request) replays graphs too, keyed the same
way: each request takes k + 1 rows, its kept ones first, as the last rows of its entries (KV length = its first
entry + k + 1); the rows past its kept ones are padding, written nowhere and attended only by themselves (the causal
mask keeps them out of the kept rows), and the request's result is read at its last kept row. An advance over more
rows (a prompt's) runs eagerly.
"""

from __future__ import annotations

import torch

from ..kvcache import KVPool
from ..model.eagle3 import Eagle3Head
from ..model.forward_batch import ForwardBatch
from .cuda_graph import no_collection


def _bucket(n: int, least: int = 1) -> int:
    size = least
    while size < n:
        size *= 2
    return size


class _Graph:
    """One captured (batch, width): its graph and the static buffers it reads and writes."""

    def __init__(self, head: Eagle3Head, steps: int, batch: int, width: int):
        device, hidden = head.device, head.config.hidden_size
        self.batch, self.width, self.steps = batch, width, steps
        self.tokens = torch.zeros(batch, dtype=torch.int64, device=device)
        self.features = torch.zeros(batch, hidden, dtype=head.dtype, device=device)
        # Per step: positions, then KV slots (int64); per step: KV lengths, then the page table (int32).
        self.wide = torch.zeros(steps * 2 * batch, dtype=torch.int64, device=device)
        self.narrow = torch.zeros(steps * batch + batch * width, dtype=torch.int32, device=device)
        self.query_start = torch.arange(batch + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(batch, dtype=torch.int64, device=device)
        self.out = torch.zeros(steps, batch, dtype=torch.int64, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None

    def step_batch(self, i: int, input_ids: torch.Tensor) -> ForwardBatch:
        b = self.batch
        wide = self.wide[i * 2 * b : (i + 1) * 2 * b]
        return ForwardBatch(
            input_ids=input_ids,
            positions=wide[:b],
            out_slots=wide[b:],
            query_start=self.query_start,
            kv_lens=self.narrow[i * b : (i + 1) * b],
            page_table=self.narrow[self.steps * b :].view(b, self.width),
            logits_indices=self.logits_indices,
            is_decode=True,
            max_query_len=1,
        )

    def forward(self, head: Eagle3Head, pool: KVPool) -> None:
        tokens, features = self.tokens, self.features
        for i in range(self.steps):
            tokens, features = head.forward(self.step_batch(i, tokens), pool, features)
            self.out[i].copy_(tokens)

    def fill_padding(self) -> None:
        """Every row padding: no KV written, one entry on page 0."""
        b = self.batch
        for i in range(self.steps):
            self.wide[i * 2 * b : i * 2 * b + b].zero_()
            self.wide[i * 2 * b + b : (i + 1) * 2 * b].fill_(-1)
            self.narrow[i * b : (i + 1) * b].fill_(1)
        self.narrow[self.steps * b :].zero_()


class _AdvanceGraph:
    """One captured advance of (batch, rows a request, width): its graph and the static buffers it reads and writes."""

    def __init__(self, head: Eagle3Head, batch: int, rows: int, width: int, feature_width: int):
        device = head.device
        self.batch, self.rows, self.width = batch, rows, width
        t = batch * rows
        self.features = torch.zeros(t, feature_width, dtype=head.dtype, device=device)
        # input ids, positions, KV slots (one a row), then the row read per request (int64); KV lengths, then the
        # page table (int32)
        self.wide = torch.zeros(3 * t + batch, dtype=torch.int64, device=device)
        self.narrow = torch.zeros(batch + batch * width, dtype=torch.int32, device=device)
        self.query_start = torch.arange(0, t + 1, rows, dtype=torch.int32, device=device)
        self.draft_ids = torch.zeros(batch, dtype=torch.int64, device=device)
        self.outputs = torch.zeros(batch, head.config.hidden_size, dtype=head.dtype, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None

    def forward(self, head: Eagle3Head, pool: KVPool) -> None:
        b, t = self.batch, self.batch * self.rows
        batch = ForwardBatch(
            input_ids=self.wide[:t],
            positions=self.wide[t : 2 * t],
            out_slots=self.wide[2 * t : 3 * t],
            query_start=self.query_start,
            kv_lens=self.narrow[:b],
            page_table=self.narrow[b:].view(b, self.width),
            logits_indices=self.wide[3 * t :],
            is_decode=False,
            max_query_len=self.rows,
        )
        draft_ids, outputs = head.forward(batch, pool, self.features)
        self.draft_ids.copy_(draft_ids)
        self.outputs.copy_(outputs)


class DraftGraphs:
    """The drafter's graphs of `steps` draft steps of the head over its pool, by (padded batch, page-table width),
    and of its advances over up to steps + 2 (= k + 1) rows a request."""

    def __init__(self, head: Eagle3Head, pool: KVPool, steps: int):
        self.head, self.pool, self.steps = head, pool, steps
        self.advance_rows = steps + 2
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._advance_graphs: dict[tuple[int, int], _AdvanceGraph] = {}
        self._mempool = torch.cuda.graph_pool_handle()
        self.captures = 0
        self.advances = 0  # advances replayed from a graph

    @torch.inference_mode()
    def advance(
        self, rows: list[tuple[list[int], int, int, list[int]]], features: list[torch.Tensor], page_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """rows: per request (its pages, the entry of its first kept row, that row's position, the token after each
        kept row), at most advance_rows kept rows each, their entries' pages held; features: each request's
        [kept, n_aux * target_hidden] on the device. Returns (the head's draft id after each request's last kept row
        [n], its output there [n, hidden]) on the device (copies: the next replay reuses the buffers)."""
        n, q = len(rows), self.advance_rows
        width = _bucket(max(-(-(first + q) // page_size) for _, first, _, _ in rows), 8)
        key = (_bucket(n), width)
        g = self._advance_graphs.get(key) or self._capture_advance(*key, features[0].shape[1])
        b, t = g.batch, g.batch * q
        wide = [0] * t + [0] * t + [-1] * t + [r * q + q - 1 for r in range(b)]  # (padding: no KV written)
        narrow = [q] * b + [0] * (b * width)
        g.features.zero_()
        for r, ((pages, first, position, tokens), feature) in enumerate(zip(rows, features)):
            kept, lo = len(tokens), r * q
            for i in range(q):
                wide[t + lo + i] = position + min(i, kept - 1)  # (padding rows repeat the last kept position)
            for i, token in enumerate(tokens):
                entry = first + i
                wide[lo + i] = token
                wide[2 * t + lo + i] = pages[entry // page_size] * page_size + entry % page_size
            wide[3 * t + r] = lo + kept - 1
            narrow[r] = first + q
            narrow[b + r * width : b + r * width + len(pages)] = pages
            g.features[lo : lo + kept].copy_(feature)
        g.wide.copy_(torch.tensor(wide, dtype=torch.int64).pin_memory(), non_blocking=True)
        g.narrow.copy_(torch.tensor(narrow, dtype=torch.int32).pin_memory(), non_blocking=True)
        g.graph.replay()
        self.advances += 1
        return g.draft_ids[:n].clone(), g.outputs[:n].clone()

    @torch.inference_mode()
    def _capture_advance(self, batch: int, width: int, feature_width: int) -> _AdvanceGraph:
        g = _AdvanceGraph(self.head, batch, self.advance_rows, width, feature_width)
        q, t = self.advance_rows, batch * self.advance_rows
        g.wide[2 * t : 3 * t].fill_(-1)  # (capture on padding: every row writes nowhere)
        g.wide[3 * t :].copy_(torch.arange(q - 1, t, q, device=g.wide.device))
        g.narrow[:batch].fill_(q)
        g.graph = self._captured(lambda: g.forward(self.head, self.pool))
        self._advance_graphs[(batch, width)] = g
        self.captures += 1
        return g

    @torch.inference_mode()  # (the buffers were made in it: their in-place updates must be too)
    def run(
        self,
        first_tokens: torch.Tensor,
        features: torch.Tensor,
        rows: list[tuple[list[int], int, int]],
        page_size: int,
    ) -> torch.Tensor:
        """first_tokens [B] and features [B, hidden] on the device; rows: per request (its pages, the entry of its
        first draft step, that step's position), the pages already holding k - 1 more entries. Returns the steps'
        tokens [k - 1, B] on the device (a copy: the next replay reuses the buffer)."""
        n = len(rows)
        width = _bucket(max(len(pages) for pages, _, _ in rows), 8)
        key = (_bucket(n), width)
        g = self._graphs.get(key)
        if g is None:
            g = self._capture(*key)
        b, steps = g.batch, self.steps
        wide = [0] * (steps * 2 * b)
        narrow = [1] * (steps * b) + [0] * (b * width)
        for i in range(steps):
            base = i * 2 * b
            wide[base + b : base + 2 * b] = [-1] * b  # (padding rows write no KV)
        for r, (pages, first, position) in enumerate(rows):
            for i in range(steps):
                entry = first + i
                wide[i * 2 * b + r] = position + i
                wide[i * 2 * b + b + r] = pages[entry // page_size] * page_size + entry % page_size
                narrow[i * b + r] = entry + 1
            at = steps * b + r * width
            narrow[at : at + len(pages)] = pages
        g.wide.copy_(torch.tensor(wide, dtype=torch.int64).pin_memory(), non_blocking=True)
        g.narrow.copy_(torch.tensor(narrow, dtype=torch.int32).pin_memory(), non_blocking=True)
        g.tokens[:n].copy_(first_tokens)
        g.features[:n].copy_(features)
        g.graph.replay()
        return g.out[:, :n].clone()

    @torch.inference_mode()
    def _capture(self, batch: int, width: int) -> _Graph:
        g = _Graph(self.head, self.steps, batch, width)
        g.fill_padding()
        g.graph = self._captured(lambda: g.forward(self.head, self.pool))
        self._graphs[(batch, width)] = g
        self.captures += 1
        return g

    def _captured(self, forward) -> torch.cuda.CUDAGraph:
        """A graph of forward() (which reads and writes static buffers only), in the drafter's memory pool."""
        device = self.head.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            forward()  # warm-up outside the capture (cuBLAS settles its workspace)
        graph = torch.cuda.CUDAGraph()
        with (
            no_collection(),
            torch.cuda.graph(graph, pool=self._mempool, stream=stream, capture_error_mode="thread_local"),
        ):
            forward()
        torch.cuda.current_stream(device).wait_stream(stream)
        return graph
