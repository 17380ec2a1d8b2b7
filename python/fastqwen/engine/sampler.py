"""Engine-side state of the CUDA sampler: persistent per-row parameter buffers, the penalty counts table with a slot
per request that has penalties, min_tokens bans, and a seed per request.

Each step: `prepare(requests)` packs every row's parameters on the host into pinned memory and uploads them into
persistent device buffers (one copy each); `launch(logits)` runs the kernel from those buffers only (no host
work, no allocation); `results` reads the tokens and logprobs back. For CUDA graphs, `freeze()` fixes every buffer
the kernel reads (counts table allocated, bans of a fixed width), `launch_captured(logits, size)` is what a decode
graph captures after its LM head, and `prepare(requests, pad_to=size)` makes the padding rows greedy rows that
count nothing; `fits_graph(requests)` says whether a step's bans fit the frozen width. The kernel counts each drawn
token into its request's row of the counts table, so the table never needs the token lists again; a request whose
row was reassigned (or whose tokens changed behind the sampler's back) gets its row rebuilt from its token lists
once.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from .. import env
from ..ops.sampling import (
    SAMPLER_ROW_WORDS,
    pack_sampler_rows,
    penalty_row,
    sample_on_gpu,
    sampler_available,
    sampler_workspace,
)
from ..scheduler import Request
from .messages import TokenLogprobs
from ..sampling_params import MAX_LOGPROBS

_SEED = "_sampler_seed"  # attributes the sampler keeps on a Request
_SLOT = "_sampler_slot"
_COUNTED = "_sampler_counted"
_ROW = "_sampler_row"


class GpuSampler:
    def __init__(self, vocab: int, max_rows: int, device: torch.device, eos_token_ids: list[int], seed: int = 0):
        self.vocab = vocab
        self.max_rows = max_rows
        self.device = device
        self.eos_token_ids = list(eos_token_ids)
        self.rng = random.Random(seed)  # seeds of requests that gave none
        pin = device.type == "cuda"
        self.rows_host = torch.zeros(max_rows, SAMPLER_ROW_WORDS, dtype=torch.int32, pin_memory=pin)
        self.rows = torch.zeros(max_rows, SAMPLER_ROW_WORDS, dtype=torch.int32, device=device)
        self.tokens = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.logprobs = torch.zeros(max_rows, dtype=torch.float32, device=device)
        self.top_ids = torch.zeros(max_rows, MAX_LOGPROBS, dtype=torch.int64, device=device)
        self.top_logprobs = torch.zeros(max_rows, MAX_LOGPROBS, dtype=torch.float32, device=device)
        self.blocked_width = 8
        self.blocked_host = torch.full((max_rows, self.blocked_width), -1, dtype=torch.int32, pin_memory=pin)
        self.blocked = torch.full((max_rows, self.blocked_width), -1, dtype=torch.int32, device=device)
        self.workspace = sampler_workspace(max_rows, vocab, device)
        self.counts: torch.Tensor | None = None  # [max_rows, vocab] int32, made on the first request with penalties
        self.slot_owner: list[Request | None] = [None] * max_rows
        self.num_rows = 0
        self.num_top = -1
        self.frozen = False  # captured in CUDA graphs: no buffer may be replaced
        # Every row starts neutral (greedy, no counts slot, no logprobs): a graph's warm-up and capture run them.
        self._neutral_row = pack_sampler_rows([0.0]).numpy()[0]
        pack_sampler_rows([0.0] * max_rows, out=self.rows_host)
        self.rows.copy_(self.rows_host)

    def freeze(self) -> None:
        """Allocate everything the kernel reads up front, before graphs capture launch_captured."""
        if self.counts is None:
            self.counts = torch.zeros(self.max_rows, self.vocab, dtype=torch.int32, device=self.device)
        self.frozen = True

    def fits_graph(self, requests: list[Request], ahead: int = 0) -> bool:
        """Whether this step's min_tokens bans fit the frozen ban width (wider ones run the eager path)."""
        return all(len(self._banned(r, ahead)) <= self.blocked_width for r in requests)

    def can_run_ahead(self, requests: list[Request]) -> bool:
        """Whether the step after the one just prepared for these requests can be prepared before that one's tokens
        reach the host: no row wants logprobs (they would overwrite the buffers the host has still to read), the
        bans fit the graphs, and every penalty row is counted on the device up to the token in flight (a row rebuilt
        from the token lists would miss it)."""
        for r in requests:
            p = r.params
            if p.logprobs is not None:
                return False
            if p.has_penalties:
                slot = getattr(r, _SLOT, None)
                if slot is None or self.slot_owner[slot] is not r or getattr(r, _COUNTED, -1) != r.num_output_tokens + 1:
                    return False
        return self.fits_graph(requests, ahead=1)

    def _banned(self, r: Request, ahead: int = 0) -> list[int]:
        """Token ids the request may not draw this step (`ahead` steps past its recorded tokens): its stop ids and
        EOS until min_tokens are out."""
        p = r.params
        if r.num_output_tokens + ahead >= p.min_tokens:
            return []
        return list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)

    @staticmethod
    def available(device: torch.device) -> bool:
        return sampler_available(device) and env.gpu_sampler()

    # ---- per request state ------------------------------------------------------------------------------------------

    def _seed(self, r: Request) -> int:
        if r.params.seed is not None:
            return r.params.seed
        seed = getattr(r, _SEED, None)
        if seed is None:
            seed = self.rng.getrandbits(64)
            setattr(r, _SEED, seed)
        return seed

    def _slot(self, r: Request, batch_ids: set[int], ahead: int = 0) -> int:
        """The request's counts row, (re)built from its token lists when it has none or it went stale."""
        slot = getattr(r, _SLOT, None)
        if slot is not None and self.slot_owner[slot] is r and getattr(r, _COUNTED, -1) == r.num_output_tokens + ahead:
            return slot
        if ahead:
            raise RuntimeError("GpuSampler: a penalty row cannot be rebuilt ahead of its tokens (check can_run_ahead)")
        if self.counts is None:
            self.counts = torch.zeros(self.max_rows, self.vocab, dtype=torch.int32, device=self.device)
        if slot is None or self.slot_owner[slot] is not r:
            slot = self._free_slot(batch_ids)
        self.slot_owner[slot] = r
        setattr(r, _SLOT, slot)
        self.counts[slot] = penalty_row(r.prompt_ids, r.output_ids, self.vocab, self.device)
        return slot

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
        row = getattr(r, _ROW, None)
        if row is None:
            p = r.params
            row = pack_sampler_rows(
                [p.temperature], [p.top_k], [p.top_p], [p.min_p], seed=[self._seed(r)], step=[0],
                repetition=[p.repetition_penalty], presence=[p.presence_penalty], frequency=[p.frequency_penalty],
                top_n=[-1 if p.logprobs is None else p.logprobs],
            ).numpy()[0]  # fmt: skip
            setattr(r, _ROW, row)
        return row

    def prepare(self, requests: list[Request], pad_to: int = 0, ahead: int = 0) -> None:
        """Pack and upload the rows' parameters (and refresh counts rows) for the next launch; rows from
        len(requests) up to pad_to (a graph's padded size) become neutral greedy rows. `ahead` = 1: the step after
        the one in flight, whose tokens the requests do not have yet."""
        n = len(requests)
        if max(n, pad_to) > self.max_rows:
            raise ValueError(f"GpuSampler: {max(n, pad_to)} rows, at most {self.max_rows}")
        batch_ids = {id(r) for r in requests}
        host = self.rows_host.numpy()
        if n:
            host[:n] = np.stack([self._packed_row(r) for r in requests])
        steps = np.fromiter((r.num_output_tokens + ahead for r in requests), dtype=np.uint64, count=n)
        words = host.view(np.uint32)
        words[:n, 6] = (steps & np.uint64(0xFFFFFFFF)).astype(np.uint32)
        words[:n, 7] = (steps >> np.uint64(32)).astype(np.uint32)
        bans: list[tuple[int, list[int]]] = []
        slots: list[tuple[Request, int]] = []
        num_top = -1
        for i, r in enumerate(requests):  # the rare per-row extras: penalties, min_tokens bans, logprobs
            p = r.params
            if p.has_penalties:
                slot = self._slot(r, batch_ids, ahead)
                host[i, 8] = slot
                slots.append((r, slot))
            ban = self._banned(r, ahead)
            if ban:
                bans.append((i, ban))
                host[i, 12] = len(ban)
            if p.logprobs is not None and p.logprobs > num_top:
                num_top = p.logprobs
        width = max((len(b) for _, b in bans), default=0)
        if width > self.blocked_width:
            if self.frozen:
                raise RuntimeError("GpuSampler: bans wider than the frozen width (check fits_graph first)")
            self._grow_blocked(width)
        if bans:
            blocked = self.blocked_host.numpy()
            blocked[:n] = -1
            for i, b in bans:
                blocked[i, : len(b)] = b
            self.blocked[:n].copy_(self.blocked_host[:n], non_blocking=True)
        if pad_to > n:
            host[n:pad_to] = self._neutral_row
        rows = max(n, pad_to)
        self.rows[:rows].copy_(self.rows_host[:rows], non_blocking=True)
        for r, _ in slots:
            setattr(r, _COUNTED, r.num_output_tokens + ahead + 1)  # the launch counts the token it draws
        self.num_rows = n
        self.num_top = num_top

    def _grow_blocked(self, width: int) -> None:
        self.blocked_width = 1 << (width - 1).bit_length()
        pin = self.device.type == "cuda"
        self.blocked_host = torch.full((self.max_rows, self.blocked_width), -1, dtype=torch.int32, pin_memory=pin)
        self.blocked = torch.full((self.max_rows, self.blocked_width), -1, dtype=torch.int32, device=self.device)

    def launch(self, logits: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """The kernel over the first `rows` rows of logits, from the buffers `prepare` filled. Returns the tokens."""
        n = self.num_rows if rows is None else rows
        top = self.num_top > 0
        sample_on_gpu(
            logits[:n], self.rows[:n], self.tokens[:n], self.workspace, self.logprobs[:n],
            self.top_ids[:n] if top else None, self.top_logprobs[:n] if top else None,
            counts=self.counts, blocked=self.blocked[:n],
        )  # fmt: skip
        return self.tokens[:n]

    def launch_captured(self, logits: torch.Tensor, size: int) -> None:
        """The kernel over a graph's padded rows, reading only frozen buffers; logprobs and top-N are always wired
        (rows whose top_n is -1 skip them), so one graph serves every step."""
        assert self.frozen, "freeze() before capturing"
        sample_on_gpu(
            logits[:size], self.rows[:size], self.tokens[:size], self.workspace, self.logprobs[:size],
            self.top_ids[:size], self.top_logprobs[:size], counts=self.counts, blocked=self.blocked[:size],
        )  # fmt: skip

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
            out.append(None if k is None else TokenLogprobs(token_list[i], chosen[i], list(zip(ids[i][:k], lps[i][:k]))))
        return out

    def sample(self, logits: torch.Tensor, requests: list[Request], read_back=None):
        """prepare + launch + read back: (tokens, logprobs or None)."""
        self.prepare(requests)
        tokens = self.launch(logits.contiguous() if not logits.is_contiguous() else logits)
        token_list = read_back(tokens) if read_back is not None else tokens.tolist()
        return token_list, self.results(requests, token_list)

