"""Verify steps chained on the device: prompt lookup's next verify step queued behind the one in flight, its inputs
made by a kernel from that step's draws (ops/verify_chain.py), so the GPU never waits for the host between them.

Without it the host stands between two verify steps: it reads the tokens, records them, drafts, and writes the next
inputs, and the GPU waits for all of that (0.18 ms a step on an H100 even behind the host gate). With it the host
runs one step behind, as it does for decode steps launched ahead: while the GPU runs step N+1 (made on the device
from step N), the host records step N, learns from the kernel's report what step N+1 holds (each sequence's accepted
count in step N and its new draft, which are the host's own rules: the engine checks that they agree), and queues step
N+2 behind N+1.

What the device keeps per sequence of the batch: its tokens (`history`, uploaded when a chain starts, then appended
to by the kernel), their count, and the forced-acceptance credit of a benchmark's synthetic acceptance. The page
table rows are the host's: before each chained step it grows every request's pages for the longest outcome
(Scheduler.reserve_ahead) and uploads the rows, which the kernel turns into KV slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..ops.verify_chain import ChainInputs, verify_chain
from ..scheduler import Request
from .cuda_graph import DecodeGraphs


@dataclass
class ChainReport:
    """What a chained step's kernel reports, on its way to pinned memory: per sequence, the draft tokens accepted in
    the step before and the chained step's input ids (its last token, then its draft)."""

    host: torch.Tensor
    ready: torch.cuda.Event | None
    batch: int
    q: int

    def read(self) -> tuple[list[int], list[int]]:
        if self.ready is not None:
            self.ready.synchronize()
        values = self.host[: self.batch * (self.q + 1)].tolist()
        return values[: self.batch], values[self.batch :]


class VerifyChain:
    """The device state and buffers of chained verify steps for one runner's verify graphs and CUDA sampler."""

    def __init__(
        self,
        graphs: DecodeGraphs,
        sampler,
        page_size: int,
        max_model_len: int,
        n_min: int,
        n_max: int,
        synthetic: float | None,
    ):
        device = graphs.staging.device
        self.graphs, self.sampler = graphs, sampler
        self.page_size, self.n_min, self.n_max, self.synthetic = page_size, n_min, n_max, synthetic
        self.q = q = graphs.query_len
        max_bs, width = graphs.max_bs, graphs.staging.max_width
        pin = device.type == "cuda"
        self.history = torch.zeros(max_bs, max_model_len, dtype=torch.int32, device=device)
        self.lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.credit = torch.zeros(max_bs, dtype=torch.float64, device=device)
        self.report = torch.zeros(max_bs * (q + 1), dtype=torch.int32, device=device)
        self._history_host = torch.zeros(max_bs, max_model_len, dtype=torch.int32, pin_memory=pin)
        self._lens_host = torch.zeros(max_bs, dtype=torch.int32, pin_memory=pin)
        self._credit_host = torch.zeros(max_bs, dtype=torch.float64, pin_memory=pin)
        # One pinned page table and report buffer suffice: the host writes them for step N+2 only after it has read
        # the report of step N+1, which the GPU copies after the uploads for N+1.
        self._pages_host = torch.zeros(max_bs, width, dtype=torch.int32, pin_memory=pin)
        self._report_host = torch.zeros(max_bs * (q + 1), dtype=torch.int32, pin_memory=pin)
        self._report_ready = torch.cuda.Event() if pin else None
        self.num_starts = 0
        self.num_steps = 0

    def queue(self, requests: list[Request], size: int, credits: list[float] | None) -> ChainReport:
        """Queue, behind the verify step of padded size `size` in flight for these requests (in its row order), the
        uploads and the kernel that turn it into the next one, and the report's copy; the caller replays the graphs
        after this. `credits` (a chain's start: the step in flight was launched by the host): each request's tokens so far
        and these forced-acceptance credits (Speculator.synthetic_credit) go up first; None when that step is chained
        itself."""
        graphs, q = self.graphs, self.q
        batch = len(requests)
        views = graphs.staging.device_views(graphs.layout(size))
        pages = self._pages_host.numpy()
        for b, request in enumerate(requests):
            pages[b, : len(request.pages)] = request.pages
        views["page_table"][:batch].copy_(self._pages_host[:batch], non_blocking=True)
        if credits is not None:
            history, lens = self._history_host.numpy(), self._lens_host.numpy()
            for b, request in enumerate(requests):
                tokens = request.token_ids
                history[b, : len(tokens)] = tokens
                lens[b] = len(tokens)
                self.history[b, : len(tokens)].copy_(self._history_host[b, : len(tokens)], non_blocking=True)
            self.lens[:batch].copy_(self._lens_host[:batch], non_blocking=True)
            self._credit_host.numpy()[:batch] = np.asarray(credits, dtype=np.float64)
            self.credit[:batch].copy_(self._credit_host[:batch], non_blocking=True)
            self.num_starts += 1
        verify_chain(
            ChainInputs(
                tokens=self.sampler.tokens,
                input_ids=views["input_ids"],
                positions=views["positions"],
                out_slots=views["out_slots"],
                kv_lens=views["kv_lens"],
                page_table=views["page_table"],
                rows=self.sampler.rows,
                history=self.history,
                lens=self.lens,
                credit=self.credit,
                report=self.report,
            ),
            batch,
            q,
            self.page_size,
            self.sampler.step_words,
            self.n_min,
            self.n_max,
            self.synthetic,
        )
        host = self._report_host
        host[: batch * (q + 1)].copy_(self.report[: batch * (q + 1)], non_blocking=True)
        if self._report_ready is not None:
            self._report_ready.record()
        self.num_steps += 1
        return ChainReport(host, self._report_ready, batch, q)
