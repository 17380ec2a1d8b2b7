"""The engine's samplers: logits in, one token per sampling row out (and logprobs where asked). One interface,
`Sampler`, two implementations; the engine makes one at start (`make_sampler`) and the model runner only ever talks
to that one:

- `GpuSampler`: the CUDA sampler (ops.sample's kernel) with its state on the device: persistent per-row parameter
  buffers, a penalty counts table with a slot per request that has penalties, min_tokens bans, a seed per request.
  It can join the decode CUDA graphs (`graph_hook`).
- `ReferenceSampler`: the PyTorch references (penalties from the token lists, the reference draw, logprobs), for the
  CPU and for FASTQWEN_GPU_SAMPLER=0. It holds no state between steps.

GpuSampler, each step: `prepare(requests)` packs every row's parameters on the host into pinned memory and uploads
them into persistent device buffers (one copy each); `launch(logits)` runs the kernel from those buffers only (no
host work, no allocation); `results` reads the logprobs back. For CUDA graphs, `freeze()` fixes every buffer the
kernel reads (counts table allocated, bans of a fixed width), `graph_hook(logits, size)` is what a decode graph
captures after its LM head, and `prepare(requests, pad_to=size)` makes the padding rows greedy rows that count
nothing. A step whose bans are wider than the frozen width does not replay a graph (`fits_graph` says so): it runs
eagerly, with a ban buffer of its own that grows as needed. The kernel counts each drawn token into its request's row
of the counts table, so the table never needs the token lists again; a request whose row was reassigned (or whose
tokens changed behind the sampler's back) gets its row rebuilt from its token lists once. What the sampler keeps per
request is the request's typed `sampler` field (scheduler.SamplerState).

logit_bias entries and bans share one sparse list per row (id, value; a ban's value is -inf), fixed-width for the
graphs (GRAPH_BAN_WIDTH) and eager above it. Structured output: a request with a grammar (`Request.grammar`) gets its
row of a token bitmask (int32 words, vocab / 32) copied in before each draw from the mask its grammar computed ahead,
on a worker thread (grammar.copy_masks: the scheduler samples a request only once that mask is ready),
and uploaded with the rows; a per-row flag tells the kernel which rows read it, so unconstrained rows cost nothing.
The mask of a step depends on the token of the step before, so a batch holding a constrained request is never sampled
ahead (can_run_ahead): the engine launches such a step's forward ahead and its sampler once the step before is
recorded (ModelRunner.sample_deferred). Rows whose mask is not ready when their step samples are skipped (`skip`:
drawn without a mask, as neutral rows in GpuSampler, and dropped by the engine) and decode again in a later step.

Speculative decoding's verify steps (engine/verify.py): a request's row 0 is followed by a `DraftRow` per draft
position, position i the request with the draft's first i tokens committed, so its penalties must count them. The
reference sampler reads that from the rows' token lists. GpuSampler gives each draft position a counts row of its own
for the step, filled on the device from the request's row plus the draft's first i tokens (`_fill_draft_rows`), into
which the kernel counts that position's draw as usual: the row of position i then counts exactly the tokens committed
if the step keeps i draft tokens and that position's draw. Once the step is recorded, the next prepare keeps the row
of the last kept position as the request's and frees the others (`_settle`), so the committed counts never include a
rejected token.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import torch

from .. import env, ops
from ..grammar import copy_masks
from ..ops.sampling import (
    SamplingBatch,
    pack_sampler_rows,
    penalty_row,
    sample_kernel_applies,
    sampler_row_layout,
    sampler_workspace,
    step_seed,
)
from ..sampling_params import MAX_LOGPROBS
from ..scheduler import Request
from .messages import TokenLogprobs
from .verify import DraftRow

Tokens = tuple[list[int], "list[TokenLogprobs | None] | None"]
ReadBack = Callable[[torch.Tensor], list[int]]

# Width of the sparse bias / ban list the graphs are captured with: EOS ids, stop ids and a modest logit_bias. Wider
# steps run eagerly.
GRAPH_BAN_WIDTH = 64


def make_sampler(vocab: int, max_rows: int, device: torch.device, eos_token_ids: list[int], seed: int) -> Sampler:
    """The CUDA sampler where its kernel runs on this device (FASTQWEN_GPU_SAMPLER=0 forces the references), else
    the reference sampler."""
    use_gpu = sample_kernel_applies(device.type == "cuda", torch.float32)
    if use_gpu and env.gpu_sampler():
        return GpuSampler(vocab, max_rows, device, eos_token_ids, seed)
    return ReferenceSampler(vocab, device, eos_token_ids, seed)


def effective_top_k(top_k: int, vocab: int) -> int:
    """top_k as both samplers apply it: at or above the vocabulary (or any size, even past int64) it keeps every
    token, which is off (0)."""
    return top_k if 0 < top_k < vocab else 0


class Sampler:
    """What the model runner asks of a sampler."""

    # The kernel to capture after the LM head of a decode graph (logits [size, vocab], size), or None when sampling
    # runs after the replay. A sampler with a hook also serves prepare / tokens / num_top / results for graph steps.
    graph_hook: Callable[[torch.Tensor, int], None] | None = None

    def __init__(self, vocab: int, device: torch.device, eos_token_ids: list[int]):
        self.vocab = vocab
        self.device = device
        self.eos_token_ids = list(eos_token_ids)

    def sample(
        self, logits: torch.Tensor, requests: list[Request], read_back: ReadBack, skip: frozenset[int] = frozenset()
    ) -> Tokens:
        """One token per row of logits [S, vocab] (row i samples requests[i]); read_back brings a token tensor to
        the host. Returns (tokens, logprobs or None when no row asked). `skip`: rows whose draws the caller drops
        (their grammar's mask is not ready): drawn without it, their state untouched."""
        raise NotImplementedError

    def fits_graph(self, requests: list[Request], ahead: int = 0) -> bool:
        """Whether a decode step of these requests may replay a graph."""
        return True

    def can_run_ahead(self, requests: list[Request]) -> bool:
        """Whether the step after the one in flight for these requests can be launched before its tokens are known."""
        return False

    def freeze(self) -> None:
        """Called before the graphs are captured: every buffer graph_hook reads must stay where it is."""

    def banned(self, r: Request, ahead: int = 0) -> list[int]:
        """Token ids the request may not draw this step (`ahead` steps past its recorded tokens): its stop ids and
        EOS until min_tokens are out."""
        p = r.params
        if r.num_output_tokens + ahead >= p.min_tokens:
            return []
        return list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)

    def adjustments(self, r: Request, ahead: int = 0) -> tuple[list[int], list[float]]:
        """The request's sparse logit changes this step: its logit_bias, then its bans (value -inf)."""
        bias = r.params.logit_bias or {}
        bans = self.banned(r, ahead)
        return list(bias) + bans, list(bias.values()) + [float("-inf")] * len(bans)

    def mask_words(self) -> int:
        return (self.vocab + 31) // 32


class ReferenceSampler(Sampler):
    """The PyTorch references of ops.sampling, from each request's token lists; unseeded rows draw from one
    generator seeded with the engine's seed."""

    def __init__(self, vocab: int, device: torch.device, eos_token_ids: list[int], seed: int = 0):
        super().__init__(vocab, device, eos_token_ids)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def _to_device(self, values, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def sample(
        self, logits: torch.Tensor, requests: list[Request], read_back: ReadBack, skip: frozenset[int] = frozenset()
    ) -> Tokens:
        want_logprobs = [r.params.logprobs for r in requests]
        raw = logits.clone() if any(n is not None for n in want_logprobs) else None
        self._process_logits(logits, requests, skip)
        tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        ops.draw_reference(logits, self._sampling_batch(requests), tokens, generator=self.generator)
        if raw is None:
            return read_back(tokens), None
        num_top = max(n for n in want_logprobs if n is not None)
        chosen, top_ids, top_logprobs = ops.compute_logprobs(raw, tokens, num_top)
        token_list = read_back(tokens)
        chosen, top_ids, top_logprobs = chosen.tolist(), top_ids.tolist(), top_logprobs.tolist()
        logprobs = [
            None
            if n is None
            else TokenLogprobs(token_list[i], chosen[i], list(zip(top_ids[i][:n], top_logprobs[i][:n])))
            for i, n in enumerate(want_logprobs)
        ]
        return token_list, logprobs

    def _sampling_batch(self, requests: list[Request]) -> SamplingBatch:
        params = [r.params for r in requests]
        temperatures = self._to_device([p.temperature for p in params], torch.float32)
        sampled = [p for p in params if not p.is_greedy]
        if not sampled:  # all greedy: the argmax needs none of the per-row tensors
            return SamplingBatch(temperatures, None, None, None, [], all_greedy=True, needs_filter=False)
        top_k = [effective_top_k(p.top_k, self.vocab) for p in params]
        return SamplingBatch(
            temperatures=temperatures,
            top_k=self._to_device(top_k, torch.int64),
            top_p=self._to_device([p.top_p for p in params], torch.float32),
            min_p=self._to_device([p.min_p for p in params], torch.float32),
            seeds=[
                None if p.seed is None else step_seed(p.seed, r.num_output_tokens) for p, r in zip(params, requests)
            ],
            all_greedy=False,
            needs_filter=any(k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for k, p in zip(top_k, params) if not p.is_greedy),
        )

    def _process_logits(
        self, logits: torch.Tensor, requests: list[Request], skip: frozenset[int] = frozenset()
    ) -> None:
        """Penalties and min_tokens blocking, and grammar masks (but not of the `skip` rows), in place on the raw
        logits."""
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
        biased = [(i, r.params.logit_bias) for i, r in enumerate(requests) if r.params.logit_bias]
        if biased:
            ops.bias_tokens(
                logits, [i for i, _ in biased], [list(b) for _, b in biased], [list(b.values()) for _, b in biased]
            )
        bans = [(i, self.banned(r)) for i, r in enumerate(requests)]
        bans = [(i, b) for i, b in bans if b]
        if bans:
            ops.block_tokens(logits, [i for i, _ in bans], [b for _, b in bans])
        constrained = [(r.grammar, i) for i, r in enumerate(requests) if r.grammar is not None and i not in skip]
        if constrained:
            mask = np.zeros((len(requests), self.mask_words()), dtype=np.int32)
            copy_masks(constrained, mask)
            ops.apply_token_bitmask(logits, [i for _, i in constrained], torch.from_numpy(mask))


class GpuSampler(Sampler):
    def __init__(self, vocab: int, max_rows: int, device: torch.device, eos_token_ids: list[int], seed: int = 0):
        super().__init__(vocab, device, eos_token_ids)
        self.max_rows = max_rows
        self.rng = random.Random(seed)  # seeds of requests that gave none
        layout = sampler_row_layout()
        self._step_words = (layout.word("step_lo"), layout.word("step_hi"))
        self._slot_word, self._bans_word = layout.word("slot"), layout.word("num_blocked")
        self._masked_word = layout.word("masked")
        pin = device.type == "cuda"
        self.rows_host = torch.zeros(max_rows, layout.words, dtype=torch.int32, pin_memory=pin)
        self._rows_host_np = self.rows_host.numpy()
        self._rows_host_words = self._rows_host_np.view(np.uint32)
        self.rows = torch.zeros(max_rows, layout.words, dtype=torch.int32, device=device)
        self.tokens = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.logprobs = torch.zeros(max_rows, dtype=torch.float32, device=device)
        self.top_ids = torch.zeros(max_rows, MAX_LOGPROBS, dtype=torch.int64, device=device)
        self.top_logprobs = torch.zeros(max_rows, MAX_LOGPROBS, dtype=torch.float32, device=device)
        # Bans and biases: the buffers the graphs read (GRAPH_BAN_WIDTH wide once frozen), and wider ones for eager
        # steps: ids (blocked) and the value each adds (bias, -inf for a ban).
        self.blocked_host, self.blocked, self.bias_host, self.bias = self._ban_buffers(GRAPH_BAN_WIDTH)
        self._wide_bans: tuple[torch.Tensor, ...] | None = None
        self._launch_blocked, self._launch_bias = self.blocked, self.bias  # what the next launch reads
        # Grammar bitmasks, a row per sampling row; only rows flagged `masked` are read.
        self.mask_host = torch.zeros(max_rows, self.mask_words(), dtype=torch.int32, pin_memory=pin)
        self.mask = torch.zeros(max_rows, self.mask_words(), dtype=torch.int32, device=device)
        self.workspace = sampler_workspace(max_rows, vocab, device)
        # Recorded after each prepare's uploads: the next prepare refills the pinned buffers only once they are read
        # (a deferred step's sampler uploads after its forward, which the caller's own upload wait does not cover).
        self._uploaded = torch.cuda.Event() if pin else None  # (waiting on it before its first record returns at once)
        self.counts: torch.Tensor | None = None  # [max_rows, vocab] int32, made on the first request with penalties
        self.slot_owner: list[Request | None] = [None] * max_rows
        self.num_rows = 0
        self.num_top = -1
        self.frozen = False  # captured in CUDA graphs: no buffer may be replaced
        # Every row starts neutral (greedy, no counts slot, no logprobs): a graph's warm-up and capture run them.
        self._neutral_row = pack_sampler_rows([0.0]).numpy()[0]
        pack_sampler_rows([0.0] * max_rows, out=self.rows_host)
        self.rows.copy_(self.rows_host)

    @property
    def blocked_width(self) -> int:
        return self.blocked.shape[1]

    def graph_hook(self, logits: torch.Tensor, size: int) -> None:
        """The kernel over a graph's padded rows, reading only frozen buffers; logprobs and top-N are always wired
        (rows whose top_n is -1 skip them), so one graph serves every step."""
        assert self.frozen, "freeze() before capturing"
        ops.sample(
            logits[:size],
            self.rows[:size],
            self.tokens[:size],
            self.workspace,
            self.logprobs[:size],
            self.top_ids[:size],
            self.top_logprobs[:size],
            counts=self.counts,
            blocked=self.blocked[:size],
            bias=self.bias[:size],
            mask=self.mask[:size],
        )

    def freeze(self) -> None:
        if self.counts is None:
            self.counts = torch.zeros(self.max_rows, self.vocab, dtype=torch.int32, device=self.device)
        self.frozen = True

    def fits_graph(self, requests: list[Request], ahead: int = 0) -> bool:
        """Whether this step's logit_bias entries and min_tokens bans fit the captured width (wider ones run the
        eager path)."""
        width = self.blocked_width
        return all(len(r.params.logit_bias or ()) + len(self.banned(r, ahead)) <= width for r in requests)

    def can_run_ahead(self, requests: list[Request]) -> bool:
        """Whether the step after the one just prepared for these requests can be prepared before that one's tokens
        reach the host: no row wants logprobs (they would overwrite the buffers the host has still to read), the
        bans fit the graphs, no row has a grammar (its mask needs the token in flight), and every penalty row is
        counted on the device up to the token in flight (a row rebuilt from the token lists would miss it; so is one
        that a verify step left to settle)."""
        for r in requests:
            p = r.params
            if p.logprobs is not None or r.grammar is not None:
                return False
            if p.has_penalties:
                state = r.sampler
                if (
                    state.slot is None
                    or state.verified is not None
                    or self.slot_owner[state.slot] is not r
                    or state.counted != r.num_output_tokens + 1
                ):
                    return False
        return self.fits_graph(requests, ahead=1)

    # ---- per request state ------------------------------------------------------------------------------------------

    def _seed(self, r: Request) -> int:
        if r.params.seed is not None:
            return r.params.seed
        state = r.sampler
        if state.seed is None:
            state.seed = self.rng.getrandbits(64)
        return state.seed

    def _slot(self, r: Request, batch_ids: set[int], ahead: int = 0) -> int:
        """The request's counts row, (re)built from its token lists when it has none or it went stale."""
        state = r.sampler
        slot = state.slot
        if slot is not None and self.slot_owner[slot] is r and state.counted == r.num_output_tokens + ahead:
            return slot
        if ahead:
            raise RuntimeError("GpuSampler: a penalty row cannot be rebuilt ahead of its tokens (check can_run_ahead)")
        if self.counts is None:
            self.counts = torch.zeros(self.max_rows, self.vocab, dtype=torch.int32, device=self.device)
        if slot is None or self.slot_owner[slot] is not r:
            slot = self._free_slot(batch_ids)
        self.slot_owner[slot] = r
        state.slot = slot
        self.counts[slot] = penalty_row(r.prompt_ids, r.output_ids, self.vocab, self.device)
        return slot

    def _draft_slot(self, row: DraftRow, batch_ids: set[int]) -> int:
        """A counts row of a verified position for this step, owned by its request (filled by _fill_draft_rows)."""
        slot = self._free_slot(batch_ids)
        self.slot_owner[slot] = row.request
        return slot

    def _settle(self, r: Request) -> None:
        """After a verify step is recorded: the counts row of the position that drew the request's last kept token
        becomes its row (it counts the kept draft tokens and that draw, nothing rejected); the step's other rows are
        freed. A request that kept nothing (failed, or finished meanwhile) gets its row rebuilt when it samples again."""
        state = r.sampler
        before, positions = state.verified
        state.verified = None
        kept = r.num_output_tokens - before
        keep = positions[kept - 1] if 1 <= kept <= len(positions) else None
        for slot in positions:
            if slot != keep and self.slot_owner[slot] is r:
                self.slot_owner[slot] = None
        if keep is not None and self.slot_owner[keep] is r:
            state.slot, state.counted = keep, r.num_output_tokens
        else:
            state.slot, state.counted = None, -1

    def _fill_draft_rows(self, fills: list[tuple[int, int, tuple[int, ...]]]) -> None:
        """(slot of a verified position, slot of its request's row, the draft tokens before that position): each
        position's row becomes its request's row (as of this step, before its kernel counts anything) plus those
        tokens. On the stream, before the launch: one small upload, a row gather (a temporary of those rows) and a
        scatter-add."""
        n = len(fills)
        rows = [slot for slot, _, draft in fills for _ in draft]
        tokens = [t for _, _, draft in fills for t in draft]
        index = torch.tensor(
            [slot for slot, _, _ in fills] + [base for _, base, _ in fills] + rows + tokens, dtype=torch.int64
        ).to(self.device, non_blocking=True)
        targets, sources, rows_at, tokens_at = index.split([n, n, len(rows), len(tokens)])
        self.counts.index_copy_(0, targets, self.counts.index_select(0, sources))
        ones = torch.ones(len(rows), dtype=self.counts.dtype, device=self.device)
        self.counts.view(-1).index_add_(0, rows_at * self.vocab + tokens_at, ones)

    def _free_slot(self, batch_ids: set[int]) -> int:
        for i, owner in enumerate(self.slot_owner):
            if owner is None or owner.finished:
                return i
        for i, owner in enumerate(self.slot_owner):  # a request not in this step: its row is rebuilt if it returns
            if id(owner) not in batch_ids:
                return i
        raise RuntimeError("GpuSampler: more rows with penalties than slots")

    # ---- one step ---------------------------------------------------------------------------------------------------

    def _packed_row(self, r: Request) -> np.ndarray:
        """The request's row with step 0, no slot and no bans, packed (and validated) once per request."""
        state = r.sampler
        if state.row is None:
            p = r.params
            state.row = pack_sampler_rows(
                [p.temperature],
                [effective_top_k(p.top_k, self.vocab)],
                [p.top_p],
                [p.min_p],
                seed=[self._seed(r)],
                step=[0],
                repetition=[p.repetition_penalty],
                presence=[p.presence_penalty],
                frequency=[p.frequency_penalty],
                top_n=[-1 if p.logprobs is None else p.logprobs],
            ).numpy()[0]
        return state.row

    @staticmethod
    def plain(r: Request) -> bool:
        """Whether prepare() would upload this row and nothing else (no penalty counts, bans, bias, grammar mask or
        logprobs): the rows pack_rows takes."""
        p = r.params
        if p.has_penalties or p.logit_bias or p.min_tokens or p.logprobs is not None or r.grammar is not None:
            return False
        return r.sampler.verified is None

    def pack_rows(self, requests: list[Request], pad_to: int) -> None:
        """prepare() of plain rows (see plain) without its upload: the rows land in rows_host only, for a copy that
        is queued already (the host gate's, csrc/host_gate.cu). No wait for prepare's last upload: the gate opens only
        once every step launched before it has been collected, so that upload has long been read."""
        n = len(requests)
        if max(n, pad_to) > self.max_rows:
            raise ValueError(f"GpuSampler: {max(n, pad_to)} rows, at most {self.max_rows}")
        host, words = self._rows_host_np, self._rows_host_words
        step_lo, step_hi = self._step_words
        for i, r in enumerate(requests):  # (row by row: a verify step of one request has only 1 + k)
            host[i] = self._packed_row(r)
            step = r.num_output_tokens
            words[i, step_lo] = step & 0xFFFFFFFF
            words[i, step_hi] = step >> 32
        if pad_to > n:
            host[n:pad_to] = self._neutral_row
        self.plain_rows_launched(n)

    @property
    def step_words(self) -> tuple[int, int]:
        """The words of a packed row that hold its step (low, high): a chained verify step advances them on the
        device (engine/verify_chain.py)."""
        return self._step_words

    def plain_rows_launched(self, num_rows: int) -> None:
        """The next launch draws num_rows plain rows (packed by pack_rows, or the last step's rows with their steps
        advanced on the device by a chained verify step, engine/verify_chain.py): what prepare() would have set."""
        self._launch_blocked, self._launch_bias = self.blocked, self.bias
        self.num_rows = num_rows
        self.num_top = -1

    def neutral_rows(self, count: int) -> torch.Tensor:
        """count neutral rows (greedy, no slot, no logprobs) on the device: a gated step's rows when it is cancelled."""
        return torch.from_numpy(np.tile(self._neutral_row, (count, 1))).to(self.device)

    def prepare(
        self, requests: list[Request], pad_to: int = 0, ahead: int = 0, skip: frozenset[int] = frozenset()
    ) -> None:
        """Pack and upload the rows' parameters (and refresh counts rows) for the next launch; rows from
        len(requests) up to pad_to (a graph's padded size) become neutral greedy rows. `ahead` = 1: the step after
        the one in flight, whose tokens the requests do not have yet. `skip`: rows that become neutral rows too
        (their draws are dropped: requests whose grammar mask is not ready; a skipped request's draft rows go with it).
        Draft rows (a verify step's, never ahead) get counts rows of their own (see the module's docstring)."""
        n = len(requests)
        if max(n, pad_to) > self.max_rows:
            raise ValueError(f"GpuSampler: {max(n, pad_to)} rows, at most {self.max_rows}")
        batch_ids = {id(r) for r in requests}
        draft_rows = []
        for i, r in enumerate(requests):  # before any slot is taken: the last verify step's rows not kept are freed
            if type(r) is DraftRow:
                draft_rows.append(i)
            elif r.sampler.verified is not None:
                self._settle(r)
        if draft_rows:
            if ahead:
                raise RuntimeError("GpuSampler: a verify step is never prepared ahead of its tokens")
            if skip:
                skipped = {id(requests[i]) for i in skip}
                skip = skip | {i for i in draft_rows if id(requests[i].request) in skipped}
        if self._uploaded is not None:
            self._uploaded.synchronize()
        host = self.rows_host.numpy()
        if n:
            host[:n] = np.stack([self._packed_row(r) for r in requests])
        steps = np.fromiter((r.num_output_tokens + ahead for r in requests), dtype=np.uint64, count=n)
        words = host.view(np.uint32)
        step_lo, step_hi = self._step_words
        words[:n, step_lo] = (steps & np.uint64(0xFFFFFFFF)).astype(np.uint32)
        words[:n, step_hi] = (steps >> np.uint64(32)).astype(np.uint32)
        bans: list[tuple[int, list[int], list[float]]] = []
        slots: list[Request] = []
        verified: dict[int, tuple[Request, list[int]]] = {}  # request id -> (request, counts row of each position)
        fills: list[tuple[int, int, tuple[int, ...]]] = []
        constrained: list[tuple[object, int]] = []
        num_top = -1
        for i in skip:
            host[i] = self._neutral_row
        for i, r in enumerate(requests):  # the rare per-row extras: penalties, bias and bans, grammars, logprobs
            if i in skip:
                continue
            p = r.params
            if p.has_penalties:
                if isinstance(r, DraftRow):  # (its request's row came just before, with the same parameters)
                    slot = self._draft_slot(r, batch_ids)
                    positions = verified[id(r.request)][1]
                    fills.append((slot, positions[0], r.draft))
                    positions.append(slot)
                else:
                    slot = self._slot(r, batch_ids, ahead)
                    verified[id(r)] = (r, [slot])
                    slots.append(r)
                host[i, self._slot_word] = slot
            if p.logit_bias or p.min_tokens:
                ids, values = self.adjustments(r, ahead)
                if ids:
                    bans.append((i, ids, values))
                    host[i, self._bans_word] = len(ids)
            if r.grammar is not None and not r.finished:  # (a request finished since its step was chosen: no mask)
                if ahead:
                    raise RuntimeError(
                        "GpuSampler: a grammar row cannot be prepared ahead of its token (check can_run_ahead)"
                    )
                constrained.append((r.grammar, i))
                host[i, self._masked_word] = 1
            if p.logprobs is not None and p.logprobs > num_top:
                num_top = p.logprobs
        if fills:
            self._fill_draft_rows(fills)
            for r, positions in verified.values():
                if len(positions) > 1:
                    r.sampler.verified = (r.num_output_tokens, tuple(positions))
        self._upload_bans(bans, n, graph=pad_to > 0)
        if constrained:
            masks = self.mask_host.numpy()
            copy_masks(constrained, masks)  # each computed ahead: a wait only if the caller did not wait
            self.mask[:n].copy_(self.mask_host[:n], non_blocking=True)
        if pad_to > n:
            host[n:pad_to] = self._neutral_row
        rows = max(n, pad_to)
        self.rows[:rows].copy_(self.rows_host[:rows], non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()
        for r in slots:
            r.sampler.counted = r.num_output_tokens + ahead + 1  # the launch counts the token it draws
        self.num_rows = n
        self.num_top = num_top

    def _ban_buffers(self, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids host, ids device, values host, values device), [max_rows, width] each."""
        pin = self.device.type == "cuda"
        host = torch.full((self.max_rows, width), -1, dtype=torch.int32, pin_memory=pin)
        values = torch.zeros((self.max_rows, width), dtype=torch.float32, pin_memory=pin)
        return (
            host,
            torch.full((self.max_rows, width), -1, dtype=torch.int32, device=self.device),
            values,
            torch.zeros((self.max_rows, width), dtype=torch.float32, device=self.device),
        )

    def _upload_bans(self, bans: list[tuple[int, list[int], list[float]]], n: int, graph: bool) -> None:
        """Write the step's bans where its launch reads them: the captured buffers when they are wide enough (a
        graph step always, see fits_graph), else buffers of a width of their own, grown to a power of two."""
        width = max((len(b) for _, b, _ in bans), default=0)
        if width <= self.blocked_width:
            host, dev, vhost, vdev = self.blocked_host, self.blocked, self.bias_host, self.bias
        elif graph:
            raise RuntimeError(f"GpuSampler: bans of {width} ids in a graph step (check fits_graph first)")
        elif not self.frozen:  # nothing captured the buffers yet: widen them
            buffers = self._ban_buffers(1 << (width - 1).bit_length())
            self.blocked_host, self.blocked, self.bias_host, self.bias = host, dev, vhost, vdev = buffers
        else:
            if self._wide_bans is None or self._wide_bans[1].shape[1] < width:
                self._wide_bans = self._ban_buffers(1 << (width - 1).bit_length())
            host, dev, vhost, vdev = self._wide_bans
        self._launch_blocked, self._launch_bias = dev, vdev
        if bans:
            blocked, values = host.numpy(), vhost.numpy()
            blocked[:n] = -1
            for i, b, v in bans:
                blocked[i, : len(b)] = b
                values[i, : len(v)] = v
            dev[:n].copy_(host[:n], non_blocking=True)
            vdev[:n].copy_(vhost[:n], non_blocking=True)

    def launch(self, logits: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """The kernel over the first `rows` rows of logits, from the buffers `prepare` filled. Returns the tokens."""
        n = self.num_rows if rows is None else rows
        top = self.num_top > 0
        ops.sample(
            logits[:n],
            self.rows[:n],
            self.tokens[:n],
            self.workspace,
            self.logprobs[:n],
            self.top_ids[:n] if top else None,
            self.top_logprobs[:n] if top else None,
            counts=self.counts,
            blocked=self._launch_blocked[:n],
            bias=self._launch_bias[:n],
            mask=self.mask[:n],
        )
        return self.tokens[:n]

    def results(self, requests: list[Request], token_list: list[int]) -> list[TokenLogprobs | None] | None:
        """Logprobs of the step (after the tokens were read back), or None when no row asked."""
        if self.num_top < 0:
            return None
        n = len(requests)
        chosen = self.logprobs[:n].tolist()
        width = max(0, self.num_top)
        ids = self.top_ids[:n, :width].tolist() if width else [[] for _ in range(n)]
        lps = self.top_logprobs[:n, :width].tolist() if width else [[] for _ in range(n)]
        out: list[TokenLogprobs | None] = []
        for i, r in enumerate(requests):
            k = r.params.logprobs
            out.append(
                None if k is None else TokenLogprobs(token_list[i], chosen[i], list(zip(ids[i][:k], lps[i][:k])))
            )
        return out

    def sample(
        self, logits: torch.Tensor, requests: list[Request], read_back: ReadBack, skip: frozenset[int] = frozenset()
    ) -> Tokens:
        self.prepare(requests, skip=skip)
        tokens = self.launch(logits.contiguous() if not logits.is_contiguous() else logits)
        token_list = read_back(tokens)
        return token_list, self.results(requests, token_list)
