"""Turns a scheduled batch into a ForwardBatch, runs the model and samples one token per sampling sequence."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .. import env
from ..kvcache import KVPool
from ..model import ForwardBatch, Qwen3Model
from ..ops.host_gate import HostGate, host_gate_applies
from ..ops.verify_chain import verify_chain_kernel_applies
from ..scheduler import Request, ScheduledBatch
from .cuda_graph import DecodeGraphs, fill_padding
from .messages import TokenLogprobs
from .sampler import ReferenceSampler, Sampler
from .staging import BatchStaging, Layout, staging_for
from .verify import sampling_rows
from .verify_chain import ChainReport, VerifyChain

log = logging.getLogger(__name__)

# Prompt-logprob rows projected through the LM head at once: each is a float32 logits row as wide as the vocabulary.
PROMPT_LOGPROB_SLICE = 256


@dataclass
class PromptRows:
    """The token rows of an eager step whose logits give prompt logprobs: row i predicts targets[i], a prompt
    token of owners[i]."""

    rows: list[int]
    targets: list[int]
    owners: list[Request]


@dataclass
class PooledRows:
    """The token rows of an eager step that end a prefill-only request (pooling.py): row i is owners[i]'s last
    prompt position, whose final hidden state gives its result."""

    rows: list[int]
    owners: list[Request]


@dataclass
class PendingStep:
    """A launched step. An eager step is complete (tokens set); a graph step's tokens are on their way to `host`,
    in pinned memory, and `ready` fires when they are there. A deferred step has run its forward only: its sampler
    waits for ModelRunner.sample_deferred, once the step before it is recorded."""

    requests: list[Request]  # the sampling rows, in order
    tokens: list[int] | None = None
    logprobs: list[TokenLogprobs | None] | None = None
    host: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None
    num_top: int = -1  # the sampler's logprobs width at launch (-1: no row asked)
    deferred: bool = False
    forward_done: torch.cuda.Event | None = None  # a deferred step's: fires when its forward has run
    skipped: frozenset[int] = frozenset()  # sampling rows drawn without their grammar's mask: the engine drops them
    aux_hidden: torch.Tensor | None = None  # the step's hidden states at the aux layers, per token row (eagle3)
    # A verify step that ran behind the host gate: the gate's number (0: none), and what relaunches the step should
    # the gate have run it on padding (the host opened it past its timeout)
    gate: int = 0
    scheduled: ScheduledBatch | None = None
    size: int = 0
    # The verify step chained behind this one on the device (ModelRunner.chain_verify), and the report of how the
    # kernel made it from this one's draws
    chained: PendingStep | None = None
    chain_report: ChainReport | None = None


@dataclass
class GatedVerify:
    """A verify step queued behind the host gate (ModelRunner.arm_verify): its padded size and read-back."""

    seq: int
    size: int
    host: torch.Tensor
    ready: torch.cuda.Event


# The engine's choice of the sampling rows whose grammar mask is not ready (ModelRunner.mask_gate): given the rows'
# requests and whether the device still runs the step's forward (the masks have until then), the rows to skip.
MaskGate = Callable[[list[Request], Callable[[], bool]], frozenset[int]]


class ModelRunner:
    def __init__(
        self,
        model: Qwen3Model,
        kv: KVPool,
        eos_token_ids: list[int],
        seed: int = 0,
        staging: BatchStaging | None = None,
        cuda_graph_max_bs: int = 0,
        sampler: Sampler | None = None,
        verify_graph: tuple[int, int] | None = None,
        capture_aux: bool = False,
    ):
        """verify_graph: (largest batch, tokens per sequence) of speculative decoding's verify steps to capture in
        CUDA graphs (drafts of one length for the whole batch), or None. capture_aux: every step, eager or replayed,
        gives the target's hidden states at model.aux_layers of its token rows (PendingStep.aux_hidden), for an
        EAGLE-3 drafter."""
        self.model = model
        self.kv = kv
        self.device = model.device
        max_model_len = model.cos_sin_cache.shape[0]
        self.staging = staging or staging_for(
            8192, max(256, cuda_graph_max_bs), max_model_len, kv.page_size, self.device
        )
        self._arange = np.arange(self.staging.max_seqs + 1, dtype=np.int64)  # logits_indices / query_start of a graph
        # The engine's sampler (engine/sampler.py): the CUDA one on GPU, else the references.
        self.sampler = sampler or ReferenceSampler(model.cfg.vocab_size, self.device, eos_token_ids, seed)
        self.mask_gate: MaskGate = lambda requests, busy: (
            frozenset()
        )  # the engine's (LLMEngine); none: every mask is waited for
        self.graphs: DecodeGraphs | None = None
        self.capture_aux = capture_aux
        aux_width = len(model.aux_layers) * model.cfg.hidden_size if capture_aux else 0
        self._graph_batches: dict[int, ForwardBatch] = {}
        # Page-table rows already in the staging buffer at the last graph size: (request, pages written) per row.
        # Decode batches keep their order from step to step, so a step usually writes only the new pages.
        self._table_size = 0
        self._table_rows: list[tuple[Request, int]] = []
        if cuda_graph_max_bs > 0:
            # The sampler (frozen by the engine) is captured after the LM head: a decode step is one replay and one
            # read-back.
            self.graphs = DecodeGraphs(
                model, kv, self.staging, cuda_graph_max_bs, self.sampler.graph_hook, aux_width=aux_width
            ).capture()
            self._graph_batches = {size: self.graphs.batch(size) for size in self.graphs.sizes}
            log.info(
                "captured %d CUDA graphs for decode batches up to %d in %.2f s, using %.0f MiB",
                len(self.graphs.sizes),
                self.graphs.max_bs,
                self.graphs.capture_seconds,
                self.graphs.memory_bytes / 2**20,
            )
        self.verify_graphs: DecodeGraphs | None = None
        if self.graphs is not None and verify_graph is not None:
            max_bs, query_len = verify_graph
            self.verify_graphs = DecodeGraphs(
                model, kv, self.staging, max_bs, self.sampler.graph_hook, query_len=query_len, aux_width=aux_width
            ).capture()
            log.info(
                "captured %d CUDA graphs for verify steps of %d tokens per sequence, batches up to %d, in %.2f s",
                len(self.verify_graphs.sizes),
                query_len,
                self.verify_graphs.max_bs,
                self.verify_graphs.capture_seconds,
            )
        # Verify steps queued before their drafts are known (arm_verify), behind the host gate; not with an EAGLE-3
        # drafter (its drafts need the step's hidden states on the host side first anyway).
        self._gate: HostGate | None = None
        self._gated: GatedVerify | None = None
        self._gate_fallbacks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._verify_constants: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # size -> logits_indices, query_start
        self.num_gated_launches = self.num_gate_opens = self.num_gate_cancels = self.num_gate_timeouts = 0
        self.chain: VerifyChain | None = None  # enable_chain's
        if (
            self.verify_graphs is not None
            and not capture_aux
            and hasattr(self.sampler, "pack_rows")
            and env.verify_gate()
            and host_gate_applies(self.device)
        ):
            self._gate = HostGate(self.device)
        # The one read-back of a step: sampled tokens, through pinned memory, then a wait on an event. Two buffers
        # alternate: a step launched ahead must not land on the tokens the host is still reading. The same goes for
        # the rows a step launched ahead takes its input tokens from (indexed like the read-back it goes with).
        on_gpu = self.device.type == "cuda"
        self._flip = 0
        max_rows = getattr(self.sampler, "max_rows", self.staging.max_seqs)
        self._tokens_host = [torch.empty(max_rows, dtype=torch.int64, pin_memory=on_gpu) for _ in range(2)]
        self._tokens_ready = [torch.cuda.Event() if on_gpu else None for _ in range(2)]
        self._source_rows_host = [
            torch.empty(self.staging.max_seqs, dtype=torch.int64, pin_memory=on_gpu) for _ in range(2)
        ]
        self._source_rows = torch.zeros(2, self.staging.max_seqs, dtype=torch.int64, device=self.device)

    def _build(self, scheduled: ScheduledBatch, size: int | None = None) -> tuple[ForwardBatch, int]:
        """The step's ForwardBatch, uploaded, and the padded graph size that replays it (0 = run eager; `size`: that
        size when the caller has it already)."""
        if size is None:
            size = self._graph_size(scheduled)
        if size:
            return self._build_graph_decode(scheduled.chunks, size), size
        return self._build_eager(scheduled), 0

    @staticmethod
    def _prompt_rows(scheduled: ScheduledBatch) -> PromptRows | None:
        """The rows of this (eager) step whose logits some request needs for its prompt logprobs. A graph step never
        has any: its chunks all sample, at the last prompt position or later."""
        rows, targets, owners = [], [], []
        t = 0
        for chunk in scheduled.chunks:
            request, start, end = chunk.request, chunk.start, chunk.end
            if request.wants_prompt_logprobs:
                # The logits at position q give the logprob of token q + 1; only prompt tokens count.
                first = max(request.prompt_logprob_next, start + 1)
                last = min(end, request.num_prompt_tokens - 1)
                for target in range(first, last + 1):
                    rows.append(t + target - 1 - start)
                    targets.append(request.token_ids[target])
                    owners.append(request)
            t += end - start
        return PromptRows(rows, targets, owners) if rows else None

    @staticmethod
    def _pooled_rows(scheduled: ScheduledBatch) -> PooledRows | None:
        """The rows of this step that end a prefill-only request (never a graph step: those chunks do not sample)."""
        rows, owners = [], []
        t = 0
        for chunk in scheduled.chunks:
            t += chunk.num_tokens
            if chunk.pools:
                rows.append(t - 1)
                owners.append(chunk.request)
        return PooledRows(rows, owners) if rows else None

    def _graph_size(self, scheduled: ScheduledBatch) -> int:
        """The captured size that replays this step, or 0 when it runs eagerly."""
        chunks = scheduled.chunks
        graphs = self.graphs
        if (
            graphs is not None
            and len(chunks) <= graphs.max_bs
            and scheduled.is_decode
            and all(c.samples for c in chunks)
            and self.sampler.fits_graph([c.request for c in chunks])
        ):
            return graphs.padded_size(len(chunks))
        return 0

    def _build_graph_decode(self, chunks, size: int, ahead: bool = False) -> ForwardBatch:
        """One token per sequence, written at the graph's layout; rows past the batch are padding. `ahead`: the
        input tokens are not sampled yet (the caller copies them on the device), their ids are left at 0."""
        page_size = self.kv.page_size
        layout = self.graphs.layout(size)
        views = self.staging.host_views(layout)
        page_table = views["page_table"]
        if self._table_size != size:
            self._table_size, self._table_rows = size, []
        written = self._table_rows
        ids, positions, slots, kv_lens = [], [], [], []
        for row, chunk in enumerate(chunks):
            request, pos = chunk.request, chunk.start
            pages = request.pages
            ids.append(0 if ahead else request.token_ids[pos])
            positions.append(pos)
            slots.append(pages[pos // page_size] * page_size + pos % page_size)
            kv_lens.append(chunk.end)
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
        fill_padding(views, n, size)
        views["logits_indices"][:] = self._arange[:size]
        views["query_start"][:] = self._arange[: size + 1]
        self.staging.upload(layout)
        graph_batch = self._graph_batches[size]
        return ForwardBatch(
            input_ids=graph_batch.input_ids,
            positions=graph_batch.positions,
            out_slots=graph_batch.out_slots,
            query_start=graph_batch.query_start,
            kv_lens=graph_batch.kv_lens,
            page_table=graph_batch.page_table,
            logits_indices=graph_batch.logits_indices[:n],
            is_decode=True,
        )

    def _build_eager(self, scheduled: ScheduledBatch) -> ForwardBatch:
        """Any batch, packed at its own shape; page-table rows as wide as its longest sequence, zero-filled."""
        self._table_size = 0  # this layout may overwrite the graph layouts' page-table rows
        page_size = self.kv.page_size
        chunks = scheduled.chunks
        num_samples = sum(c.num_rows for c in chunks)
        width = max(len(c.request.pages) for c in chunks)
        layout = Layout(scheduled.num_tokens, len(chunks), num_samples, width)
        views = self.staging.host_views(layout)
        input_ids, positions, out_slots = views["input_ids"], views["positions"], views["out_slots"]
        query_start, kv_lens, page_table = views["query_start"], views["kv_lens"], views["page_table"]
        logits_indices = views["logits_indices"]
        query_start[0] = 0
        t = s = max_query_len = 0
        for row, chunk in enumerate(chunks):
            request, start, end, draft = chunk.request, chunk.start, chunk.end, chunk.draft
            pages = request.pages
            n = chunk.num_tokens
            max_query_len = max(max_query_len, n)
            input_ids[t : t + end - start] = request.token_ids[start:end]
            if draft:
                input_ids[t + end - start : t + n] = draft
            if n == 1:
                positions[t] = start
                out_slots[t] = pages[start // page_size] * page_size + start % page_size
            else:
                span = np.arange(start, start + n, dtype=np.int64)
                positions[t : t + n] = span
                out_slots[t : t + n] = (
                    np.asarray(pages, dtype=np.int64)[span // page_size] * page_size + span % page_size
                )
            t += n
            query_start[row + 1] = t
            kv_lens[row] = start + n
            page_table[row, : len(pages)] = pages
            page_table[row, len(pages) :] = 0  # the reference paths gather whole rows
            if chunk.samples:  # the last token, and each draft token before it
                rows = chunk.num_rows
                logits_indices[s : s + rows] = np.arange(t - rows, t)
                s += rows
        self.staging.upload(layout)
        v = self.staging.device_views(layout)
        return ForwardBatch(
            input_ids=v["input_ids"],
            positions=v["positions"],
            out_slots=v["out_slots"],
            query_start=v["query_start"],
            kv_lens=v["kv_lens"],
            page_table=v["page_table"],
            logits_indices=v["logits_indices"],
            is_decode=scheduled.is_decode,
            max_query_len=max_query_len,
        )

    def run_model(self, batch: ForwardBatch, graph_size: int = 0) -> torch.Tensor:
        """float32 logits [S, vocab]: a replay of the forward graph of graph_size when non-zero, the eager forward
        otherwise. Never the graph's sampler: _launch_graph replays it after this; an eager step samples itself."""
        if graph_size:
            return self.graphs.replay_forward(graph_size)[: batch.logits_indices.shape[0]]
        return self.model.forward(batch, self.kv)

    def _read_back(self, tokens: torch.Tensor) -> list[int]:
        """The step's one device-to-host transfer: a non-blocking copy into pinned memory, then a wait for it."""
        if self.device.type != "cuda" or tokens.shape[0] > self._tokens_host[0].shape[0]:
            return tokens.tolist()
        host, ready = self._start_read_back(tokens)
        ready.synchronize()
        return host.tolist()

    def _start_read_back(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Queue the copy of the tokens into the next pinned buffer; the event fires when they are there."""
        flip = self._flip
        self._flip ^= 1
        host = self._tokens_host[flip][: tokens.shape[0]]
        host.copy_(tokens, non_blocking=True)
        ready = self._tokens_ready[flip]
        ready.record()
        return host, ready

    def collect(self, pending: PendingStep) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        """The sampled token of each sampling row of a launched step, in order, and their logprobs if asked; waits
        for a graph step's read-back."""
        if pending.tokens is None:
            pending.ready.synchronize()
            if pending.gate and not self._gate.opened(pending.gate):
                # The host opened the gate past its timeout: the step ran on padding. Run it the ordinary way. (Also
                # when the gate armed after it timed out first and overwrote the status word: a host stalled 50 ms;
                # the step then runs twice on the same inputs, which writes the same KV and draws the same tokens.)
                self.num_gate_timeouts += 1
                self.cancel_gate()
                again = self._launch_verify_graph(pending.scheduled, pending.size, pending.requests)
                pending.host, pending.ready, pending.gate = again.host, again.ready, 0
                pending.ready.synchronize()
            pending.tokens = pending.host.tolist()
            if pending.num_top >= 0:  # no step is launched ahead of one that asked, so the buffers are its own
                pending.logprobs = self.sampler.results(pending.requests, pending.tokens)
        return pending.tokens, pending.logprobs

    @torch.inference_mode()
    def launch(self, scheduled: ScheduledBatch, after: PendingStep | None = None) -> PendingStep | None:
        """Starts a step and returns it without waiting for its tokens when it is a graph step (collect waits).

        `after`: the graph step in flight whose sampled tokens this one's rows read, for a decode step chosen by
        Scheduler.schedule_ahead before those tokens reached the host. Such a step runs only as a graph replay with
        the CUDA sampler; None when it cannot (the caller then runs it the ordinary way, once `after` is recorded).
        When its sampler needs what `after` decides (a grammar's mask, logprob buffers not read yet, a counts row to
        rebuild), only its forward runs now: the step comes back deferred, and sample_deferred finishes it once
        `after` is recorded.
        """
        chunks = scheduled.chunks
        if after is not None:
            return self._launch_ahead(chunks, after)
        if not chunks:
            return PendingStep([], tokens=[])
        launched = self.launch_replay(scheduled)  # (it cancels an armed gate unless it opens it)
        if launched is not None:
            return launched
        # (A row whose grammar mask is still computed: the sampler runs after the forward, which the mask has until.)
        batch, graph_size = self._build(scheduled)
        aux = None
        if self.capture_aux and not graph_size:
            width = len(self.model.aux_layers) * self.model.cfg.hidden_size
            aux = torch.empty(batch.num_tokens, width, dtype=self.model.dtype, device=self.device)
        rows = sampling_rows(scheduled)
        tokens, logprobs, skipped = self._run_eager(scheduled, rows, batch, graph_size, aux)
        if graph_size:  # the decode graph's forward ran (its sampler did not): its aux rows, if it wrote them
            aux = self._replayed_aux(self.graphs, len(scheduled.chunks))
        return PendingStep(rows, tokens=tokens, logprobs=logprobs, skipped=skipped, aux_hidden=aux)

    def launch_replay(self, scheduled: ScheduledBatch) -> PendingStep | None:
        """Launch the step when it replays CUDA graphs with their sampler (a verify step, or a decode step whose
        grammar masks are ready): it returns at once and collect waits for its tokens. None, with nothing done, when
        the step would run eagerly (launch then runs it, and returns only once its tokens are on the host)."""
        if scheduled.has_drafts:
            rows = sampling_rows(scheduled)
            size = self._verify_graph_size(scheduled, rows)
            gated = self._gated
            # (a draft row is plain when its request is: the same parameters, grammar and counts)
            if (
                gated is not None
                and size == gated.size
                and all(self.sampler.plain(c.request) for c in scheduled.chunks)
            ):
                return self._open_gate(scheduled, rows)
            self.cancel_gate()
            return self._launch_verify_graph(scheduled, size, rows) if size else None
        self.cancel_gate()
        chunks = scheduled.chunks
        size = self._graph_size(scheduled)
        if size and self.sampler.graph_hook is not None and all(c.request.mask_ready for c in chunks):
            return self._launch_graph(chunks, size)  # the graph samples too: its rows are filled first
        return None

    # ---- speculative decoding's verify steps ----------------------------------------------------------------------

    @property
    def gate_armed(self) -> bool:
        """Whether a verify step waits behind the host gate (arm_verify) for the next launch."""
        return self._gated is not None

    @property
    def can_arm_verify(self) -> bool:
        """Whether arm_verify may queue a verify step now (the gate exists and none is armed)."""
        return self._gate is not None and self._gated is None

    def arm_verify(self, size: int) -> bool:
        """Queue a verify step of padded size `size` (the gate, the verify graphs, the read-back) behind the host gate
        while the step before it runs. The next launch_replay of a verify step of that size whose rows are all plain
        opens the gate with that step's inputs; any other launch cancels it first (its step then runs on padding and
        is dropped). False, with nothing queued, when it cannot."""
        graphs = self.verify_graphs
        if not self.can_arm_verify or size not in graphs.sizes:
            return False
        q = graphs.query_len
        fallback_inputs, fallback_rows = self._gate_fallbacks.get(size) or self._make_gate_fallbacks(size)
        inputs, rows = fallback_inputs.numel(), fallback_rows.numel()
        seq = self._gate.arm(
            (self.staging.host[:inputs], self.staging.dev[:inputs], fallback_inputs),
            (self.sampler.rows_host.view(-1)[:rows], self.sampler.rows.view(-1)[:rows], fallback_rows),
        )
        graphs.replay(size)
        host, ready = self._start_read_back(self.sampler.tokens[: size * q])
        self._gated = GatedVerify(seq, size, host, ready)
        self.num_gated_launches += 1
        return True

    def enable_chain(self, max_model_len: int, n_min: int, n_max: int, synthetic: float | None) -> bool:
        """Let prompt lookup's verify steps be chained on the device (chain_verify); False where they cannot be: no
        verify graphs or CUDA sampler, an EAGLE-3 drafter's hidden states to capture, no kernel, or
        FASTQWEN_VERIFY_CHAIN=0."""
        if (
            self.verify_graphs is None
            or self.capture_aux
            or not hasattr(self.sampler, "plain_rows_launched")
            or not env.verify_chain()
            or not verify_chain_kernel_applies(self.device)
        ):
            return False
        self.chain = VerifyChain(
            self.verify_graphs, self.sampler, self.kv.page_size, max_model_len, n_min, n_max, synthetic
        )
        return True

    def chain_verify(self, after: PendingStep, requests: list[Request], credits: list[float] | None) -> PendingStep:
        """Queue the verify step that follows `after` (a verify step in flight for these requests, in its row order,
        every row plain) with its inputs made on the device from `after`'s draws (engine/verify_chain.py): the pages'
        upload, the kernel, its report (after.chain_report), the verify graphs and the read-back. The returned step
        is `after.chained`; its rows (`requests`) are set by whoever reads the report. `credits`: a chain's start
        (`after` was launched by the host), see VerifyChain.queue."""
        if self._gated is not None:  # (the engine arms the gate or chains, never both)
            raise RuntimeError("chain_verify: a verify step is armed behind the host gate")
        graphs = self.verify_graphs
        size = graphs.padded_size(len(requests))
        after.chain_report = self.chain.queue(requests, size, credits)
        self._table_size = 0  # (it writes a verify layout into the staging buffer, the host's on the CPU)
        graphs.replay(size)
        host, ready = self._start_read_back(self.sampler.tokens[: len(requests) * graphs.query_len])
        self.sampler.plain_rows_launched(len(requests) * graphs.query_len)
        after.chained = PendingStep([], host=host, ready=ready, size=size)
        return after.chained

    def cancel_gate(self) -> None:
        """Let an armed verify step run on padding (its tokens are never read); nothing when none is armed."""
        if self._gated is not None:
            self._gated = None
            self._gate.cancel()
            self._table_size = 0  # (its fallback inputs overwrite the staging buffer where it is the host's: CPU)
            self.num_gate_cancels += 1

    def _make_gate_fallbacks(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A cancelled gate's inputs for a verify step of `size`, on the device: every sequence padding (reads page 0,
        writes no KV) and every sampler row neutral; each a multiple of 16 bytes."""
        graphs = self.verify_graphs
        q = graphs.query_len
        flat, views = self.staging.scratch_views(graphs.layout(size))
        self._fill_verify_inputs(views, ScheduledBatch([]), size)  # (no sequence: all padding)
        words = self.sampler.rows.shape[1]
        row_words = -(-size * q * words // 4) * 4
        if flat.size > self.staging.capacity or row_words > self.sampler.rows.numel():
            raise RuntimeError("arm_verify: the gate's copies do not fit the staging or sampler buffers")
        rows = self.sampler.neutral_rows(-(-row_words // words)).view(-1)[:row_words]
        fallbacks = (torch.from_numpy(flat).to(self.device), rows.contiguous())
        self._gate_fallbacks[size] = fallbacks
        return fallbacks

    def _open_gate(self, scheduled: ScheduledBatch, rows: list) -> PendingStep:
        """The armed verify step's inputs into the pinned buffers the gate copies from, then the gate opened. No wait
        for the buffers' last ordinary uploads: the engine opens a gate only after collecting every step launched
        before it (launch_replay follows the collection of the step in flight), and those uploads came before."""
        gated, self._gated = self._gated, None
        graphs = self.verify_graphs
        self.sampler.pack_rows(rows, pad_to=gated.size * graphs.query_len)
        views = self.staging.host_views(graphs.layout(gated.size), wait=False)
        self._fill_verify_inputs(views, scheduled, gated.size)
        self._gate.open()
        self.num_gate_opens += 1
        return PendingStep(
            rows,
            host=gated.host[: len(rows)],
            ready=gated.ready,
            gate=gated.seq,
            scheduled=scheduled,
            size=gated.size,
        )

    def release_graphs(self) -> None:
        """Destroy the decode and verify CUDA graphs now (the runner steps eagerly, if at all, afterwards). A
        tensor-parallel rank must do this before its NCCL communicator goes: NCCL (2.26 on) holds a communicator's
        teardown, abort included, until every CUDA graph that captured one of its collectives is destroyed."""
        self.cancel_gate()
        for graphs in (self.graphs, self.verify_graphs):
            if graphs is not None:
                graphs.close()
        self.graphs = self.verify_graphs = None
        self._graph_batches = {}

    def _verify_graph_size(self, scheduled: ScheduledBatch, rows: list) -> int:
        """The captured verify size that replays this step, or 0 (eager): every chunk decodes with a draft of the
        captured length, and the sampler's bans fit."""
        graphs = self.verify_graphs
        if graphs is None or len(scheduled.chunks) > graphs.max_bs or self.sampler.graph_hook is None:
            return 0
        q = graphs.query_len
        for c in scheduled.chunks:
            if c.end - c.start != 1 or not c.samples or 1 + len(c.draft) != q:
                return 0
        if not self.sampler.fits_graph(rows):
            return 0
        return graphs.padded_size(len(scheduled.chunks))

    def _launch_verify_graph(self, scheduled: ScheduledBatch, size: int, rows: list) -> PendingStep:
        """Replay the verify graphs (forward, then the sampler over every position) and start the read-back."""
        graphs = self.verify_graphs
        q = graphs.query_len
        self.staging.wait_uploaded()
        self.sampler.prepare(rows, pad_to=size * q)
        layout = graphs.layout(size)
        self._fill_verify_inputs(self.staging.host_views(layout), scheduled, size)
        self.staging.upload(layout)
        graphs.replay(size)
        host, ready = self._start_read_back(self.sampler.tokens[: len(rows)])
        aux = self._replayed_aux(graphs, len(scheduled.chunks) * q)
        return PendingStep(rows, host=host, ready=ready, num_top=self.sampler.num_top, aux_hidden=aux)

    def _fill_verify_inputs(self, views: dict, scheduled: ScheduledBatch, size: int) -> None:
        """A verify step's inputs in the host views of its layout: each sequence's token and draft, their positions,
        KV slots and pages; sequences past the batch become padding. (Python arithmetic on a few values a sequence:
        this runs between two verify steps while the GPU waits, and numpy's per-call cost dominates at 1 + k.)"""
        graphs = self.verify_graphs
        q = graphs.query_len
        self._table_size = 0  # this layout overwrites the decode layouts' page-table rows
        page_size = self.kv.page_size
        ids, positions, slots = views["input_ids"], views["positions"], views["out_slots"]
        kv_lens, page_table = views["kv_lens"], views["page_table"]
        for b, chunk in enumerate(scheduled.chunks):
            request, start, lo = chunk.request, chunk.start, b * q
            pages = request.pages
            ids[lo] = request.token_ids[start]
            ids[lo + 1 : lo + q] = chunk.draft
            positions[lo : lo + q] = range(start, start + q)
            slots[lo : lo + q] = [pages[p // page_size] * page_size + p % page_size for p in range(start, start + q)]
            kv_lens[b] = start + q
            page_table[b, : len(pages)] = pages
        if len(scheduled.chunks) < size:
            graphs.fill_padding(views, len(scheduled.chunks), size)
        constants = self._verify_constants.get(size)
        if constants is None:
            constants = self._verify_constants[size] = (np.arange(size * q), np.arange(0, (size + 1) * q, q))
        views["logits_indices"][:], views["query_start"][:] = constants

    def _replayed_aux(self, graphs: DecodeGraphs, num_rows: int) -> torch.Tensor | None:
        """A copy of the aux hidden states a replay left for its first num_rows token rows (the sequences that are
        not padding), queued after it on the stream: the next replay may overwrite the graphs' buffer before the
        drafter reads them."""
        return graphs.aux[:num_rows].clone() if self.capture_aux else None

    def _launch_ahead(self, chunks, after: PendingStep) -> PendingStep | None:
        if self._gated is not None:  # its step (on padding, once cancelled) would overwrite the tokens read below
            self.cancel_gate()
            return None
        graphs, sampler = self.graphs, self.sampler
        if after.host is None or graphs is None or sampler.graph_hook is None or len(chunks) > graphs.max_bs:
            return None
        requests = [c.request for c in chunks]
        source = {id(r): row for row, r in enumerate(after.requests)}
        if any(id(r) not in source for r in requests):
            return None
        size = graphs.padded_size(len(chunks))
        source_rows = [source[id(r)] for r in requests]
        # A step in flight that wants logprobs must be read before another sampler launch overwrites them.
        if after.num_top < 0 and sampler.can_run_ahead(requests):
            return self._launch_graph(chunks, size, source_rows)
        return self._launch_forward(chunks, size, source_rows)

    def _launch_forward(self, chunks, size: int, source_rows: list[int]) -> PendingStep:
        """The forward of a step launched ahead, without its sampler: its input tokens are copied on the device from
        the step in flight, as for _launch_graph."""
        self.staging.wait_uploaded()
        batch = self._build_graph_decode(chunks, size, ahead=True)
        self._copy_input_tokens(batch, source_rows, self._flip)
        self.graphs.replay_forward(size)
        aux = self._replayed_aux(self.graphs, len(chunks))
        forward_done = torch.cuda.Event()
        forward_done.record()
        return PendingStep([c.request for c in chunks], deferred=True, forward_done=forward_done, aux_hidden=aux)

    def sample_deferred(self, pending: PendingStep, skip: frozenset[int] = frozenset()) -> None:
        """Sample a deferred step on its forward's logits (still in the graphs' buffer: the next forward is launched
        after this) and start its read-back. Called once the step before it is recorded, so its rows are prepared as
        any step's: grammar masks of the tokens committed so far (computed ahead, on the grammars' threads, while the
        GPU runs the step's forward), penalty counts up to date. `skip`: rows drawn as neutral rows, whose tokens the
        caller drops (their grammar's mask was not ready)."""
        self.cancel_gate()
        requests = pending.requests
        n = len(requests)
        self.sampler.prepare(requests, skip=skip)
        self.sampler.launch(self.graphs.logits[:n])
        pending.host, pending.ready = self._start_read_back(self.sampler.tokens[:n])
        pending.num_top = self.sampler.num_top
        pending.deferred = False

    def _copy_input_tokens(self, batch: ForwardBatch, source_rows: list[int], flip: int) -> None:
        """Each row's input token, on the device, from the row of the sampler's last draw that sampled it."""
        n = len(source_rows)
        rows_host = self._source_rows_host[flip][:n]
        rows_host.numpy()[:] = source_rows
        rows = self._source_rows[flip, :n]
        rows.copy_(rows_host, non_blocking=True)
        torch.index_select(self.sampler.tokens, 0, rows, out=batch.input_ids[:n])

    def _launch_graph(self, chunks, size: int, source_rows: list[int] | None = None) -> PendingStep:
        """Replay the decode graph of `size` (sampler included) and start the read-back of its tokens. A step
        launched ahead (source_rows given) copies each row's input token, on the device, from the row of the step
        in flight that samples it."""
        requests = [c.request for c in chunks]
        n = len(requests)
        flip = self._flip  # the buffers of this step's read-back
        # The pinned buffers (sampler rows, then the batch, whose upload records the event) are refilled only once
        # the previous step's uploads have read them.
        self.staging.wait_uploaded()
        ahead = source_rows is not None
        self.sampler.prepare(requests, pad_to=size, ahead=int(ahead))
        batch = self._build_graph_decode(chunks, size, ahead=ahead)
        if ahead:
            self._copy_input_tokens(batch, source_rows, flip)
        self.run_model(batch, size)  # the forward's graph (tests wrap run_model to read a step's logits)
        self.graphs.replay_sampler(size)  # then the sampler's, whose tokens the read-back takes
        host, ready = self._start_read_back(self.sampler.tokens[:n])
        aux = self._replayed_aux(self.graphs, n)
        return PendingStep(requests, host=host, ready=ready, num_top=self.sampler.num_top, aux_hidden=aux)

    def _run_eager(self, scheduled: ScheduledBatch, requests: list, batch: ForwardBatch, graph_size: int, aux=None):
        """The forward and the sampler of an eager step; `requests`: its sampling rows (verify.sampling_rows)."""
        prompt_rows = None if graph_size else self._prompt_rows(scheduled)
        pooled_rows = None if graph_size else self._pooled_rows(scheduled)
        if prompt_rows is None and pooled_rows is None:
            logits = (
                self.model.forward(batch, self.kv, aux_out=aux)
                if aux is not None
                else self.run_model(batch, graph_size)
            )
        else:
            # Final hidden states of extra rows: the prompt-logprob rows, then the pooled ones.
            extra = (prompt_rows.rows if prompt_rows else []) + (pooled_rows.rows if pooled_rows else [])
            rows = torch.tensor(extra, dtype=torch.int64).to(self.device, non_blocking=True)
            logits, hidden = self.model.forward(batch, self.kv, extra_rows=rows, aux_out=aux)
            num_prompt_rows = len(prompt_rows.rows) if prompt_rows else 0
            if prompt_rows is not None:
                self._record_prompt_logprobs(hidden[:num_prompt_rows], prompt_rows)
            if pooled_rows is not None:
                self._record_pooled(hidden[num_prompt_rows:], pooled_rows)
        if logits.shape[0] == 0:  # only unfinished prefill chunks: KV written, nothing to sample
            return [], None, frozenset()
        skipped = self.mask_gate(requests, self._device_busy())
        return *self.sampler.sample(logits[: len(requests)], requests, self._read_back, skipped), skipped

    def _device_busy(self) -> Callable[[], bool]:
        """Whether the device still runs the work launched so far (never, on the CPU: the forward ran already)."""
        if self.device.type != "cuda":
            return lambda: False
        done = torch.cuda.Event()
        done.record()
        return lambda: not done.query()

    def _record_pooled(self, hidden: torch.Tensor, pooled_rows: PooledRows) -> None:
        """Each prefill-only request's result from its last position's final hidden state: embed, the state
        L2-normalized (in float32); score, the softmax over the logits of its token ids (the LM head a slice of rows
        at a time, as for prompt logprobs)."""
        embed = [i for i, r in enumerate(pooled_rows.owners) if r.pooling.task == "embed"]
        score = [i for i, r in enumerate(pooled_rows.owners) if r.pooling.task == "score"]
        if embed:
            vectors = torch.nn.functional.normalize(hidden[embed].float(), dim=-1).tolist()
            for i, vector in zip(embed, vectors):
                pooled_rows.owners[i].pooled = vector
        for s in range(0, len(score), PROMPT_LOGPROB_SLICE):
            part = score[s : s + PROMPT_LOGPROB_SLICE]
            logits = self.model.lm_head_logits(hidden[part])
            for k, i in enumerate(part):
                owner = pooled_rows.owners[i]
                ids = torch.tensor(owner.pooling.token_ids, dtype=torch.int64, device=self.device)
                owner.pooled = torch.softmax(logits[k, ids], dim=-1).tolist()

    def _record_prompt_logprobs(self, hidden: torch.Tensor, prompt_rows: PromptRows) -> None:
        """Logprobs of the prompt tokens these rows predict (raw distribution, as for sampled tokens), appended to each
        owner's pending list: the LM head runs a slice of rows at a time, so memory stays bounded whatever the chunk."""
        targets = torch.tensor(prompt_rows.targets, dtype=torch.int64).to(self.device, non_blocking=True)
        num_top = max(r.params.prompt_logprobs for r in prompt_rows.owners)
        chosen, ranks, top_ids, top_logprobs = [], [], [], []
        for s in range(0, len(prompt_rows.rows), PROMPT_LOGPROB_SLICE):
            logprobs = torch.log_softmax(self.model.lm_head_logits(hidden[s : s + PROMPT_LOGPROB_SLICE]), dim=-1)
            c = logprobs.gather(1, targets[s : s + PROMPT_LOGPROB_SLICE, None])
            chosen += c[:, 0].tolist()
            ranks += ((logprobs > c).sum(dim=-1) + 1).tolist()
            if num_top:
                lp, i = logprobs.topk(num_top, dim=-1)
                top_ids += i.tolist()
                top_logprobs += lp.tolist()
        for k, (request, target) in enumerate(zip(prompt_rows.owners, prompt_rows.targets)):
            n = request.params.prompt_logprobs
            top = list(zip(top_ids[k][:n], top_logprobs[k][:n])) if n else []
            request.pending_prompt_logprobs.append(TokenLogprobs(target, chosen[k], top, ranks[k]))
            request.prompt_logprob_next += 1  # rows of one request are consecutive prompt positions, from its next one
