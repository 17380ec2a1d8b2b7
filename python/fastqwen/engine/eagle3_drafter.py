"""The `eagle3` drafter: an EAGLE-3 head (model/eagle3.py) drafting from the target's hidden states, for every
drafting request of a step in one batch. It lives in the engine, beside the model it reads; the speculator
(speculative/) asks it for drafts as it asks the token-id drafters.

The head's KV lives in a paged pool of its own (one layer, the target's page size). Per request the drafter keeps its
entries: K and V of the positions the target computed and kept, each built from the target's aux hidden states at p
and the token at p + 1, in increasing positions (entry i lies in the request's page i // page_size), and the head's
prediction after the last of them. After every step (`advance`, with that step's aux hidden states) it drops every
entry at or past each request's first position in the step (positions recomputed after a preemption) and runs the
head over the positions the step kept, all requests in one forward. The first `propose` of a step drafts for every
request whose last position the head has seen, in one batch: the first token is that prediction, each next one
feeds the head its own output before the final norm, at the next position (k - 1 decode steps of the whole batch);
the entries of those draft positions are dropped again and their pages given back (the target's hidden states
replace them once it has verified), so the head's pool never holds a token the target has not kept.

Positions the request got from the prefix cache were never computed here: the head attends to what it has (its
entries need not start at position 0; RoPE is applied at each entry's own position). A preempted request's pages go
back at once (`release`), as its target pages do; when it runs again the head starts from what that step computes.
When the head's pool has no pages left for a request, that request's entries are dropped and it gets no draft this
step (its next steps start over from what they compute).

Ownership (checked by `check_invariants`): every page of the head's pool is free or held once, by exactly one
request's state, and a state holds exactly the pages its entries fill.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kvcache import KVPool
from ..kvcache.invariants import InvariantError
from ..model.eagle3 import Eagle3Head
from ..model.forward_batch import ForwardBatch


@dataclass
class _State:
    pages: list[int] = field(default_factory=list)  # the head pool's pages of the entries, in order
    # The entries' positions as runs (first position, count), increasing: contiguous but where the head skipped
    # positions it never computed (a prefix-cache hit).
    runs: list[list[int]] = field(default_factory=list)
    num_entries: int = 0
    end: int = 0  # one past the last position seen
    # The head's prediction for the token at `end + 1`: a 0-d tensor on the head's device, read back with the draft
    # it starts (one read-back a step for all drafts).
    next_token: torch.Tensor | None = None
    feature: torch.Tensor | None = None  # the head's output at end - 1, before its final norm [hidden]
    decoding: bool = False  # the last advance reached the request's last token: a draft may follow
    draft: list[int] | None = None  # this step's draft, once made (until the next advance)


def _to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device`; to a GPU through pinned memory, not waiting for the kernels queued before it
    (PyTorch's pinned allocator keeps the block until the copy has run)."""
    if device.type != "cuda":
        return values.to(device)
    return values.pin_memory().to(device, non_blocking=True)


class Eagle3Drafter:
    # Its drafts come from kernels on the head's device, queued behind whatever the engine queued before them: the
    # engine does not queue the next verify step behind its host gate (LLMEngine._arm_next_verify).
    drafts_on_device = True

    def __init__(self, head: Eagle3Head, num_tokens: int, pool: KVPool, graphs: bool = False):
        """graphs: the draft steps and the advances over a verify step's kept positions replay CUDA graphs
        (engine/eagle3_graphs.py) where the head runs its kernels (its decode attention has a workspace; the
        references read back and cannot be captured)."""
        self.head = head
        self.num_tokens = num_tokens
        self.pool = pool
        self.page_size = pool.page_size
        self._states: dict[int, _State] = {}
        self.graphs = None
        if graphs and head.decode_workspace is not None:
            from .eagle3_graphs import DraftGraphs

            self.graphs = DraftGraphs(head, pool, num_tokens - 1)

    # ---- the speculator's drafter interface -----------------------------------------------------------------

    def advance_batch(self, items) -> None:
        """items: (request, start, aux_hidden [R, ...]) per request: the target computed and kept its positions
        start .. start + R - 1 (aux_hidden: their hidden states at the head's aux layers); the token after each is in
        request.token_ids. One forward of the head over all of them."""
        rows: list[tuple[_State, int, int, list[int]]] = []  # (state, first entry, start, next tokens)
        features = []
        for request, start, aux_hidden in items:
            state = self._states.setdefault(request.rid, _State())
            self._truncate(state, start)
            count = aux_hidden.shape[0]
            if not self._reserve(state, state.num_entries + count):
                self._drop(request.rid)  # no room: this request starts over at its next step
                continue
            rows.append((state, state.num_entries, start, request.token_ids[start + 1 : start + count + 1]))
            features.append(aux_hidden)
            state.num_entries += count
            if state.runs and state.runs[-1][0] + state.runs[-1][1] == start:
                state.runs[-1][1] += count
            else:
                state.runs.append([start, count])
            state.end = start + count
            state.decoding = state.end == len(request.token_ids) - 1
            state.draft = None
        if not rows:
            return
        graphs = self.graphs
        if graphs is not None and max(len(tokens) for *_, tokens in rows) <= graphs.advance_rows:
            # (a verify step's kept positions; a prompt's run eagerly)
            draft_ids, outputs = graphs.advance(
                [(s.pages, first, start, tokens) for s, first, start, tokens in rows], features, self.page_size
            )
        else:
            batch = self._batch([(s, first, start, tokens) for s, first, start, tokens in rows])
            draft_ids, outputs = self.head.forward(batch, self.pool, torch.cat(features))
        for (state, *_), token, output in zip(rows, draft_ids, outputs):
            state.next_token, state.feature = token, output

    def propose(self, rid: int, tokens: list[int], num_prompt_tokens: int, limit: int) -> tuple[list[int], float]:
        state = self._states.get(rid)
        if state is None or not state.decoding or state.end != len(tokens) - 1:
            return [], 0.0  # the head has not seen the request's last position (nothing computed here yet)
        if state.draft is None:
            self._draft_all()
        k = min(self.num_tokens, limit)
        return state.draft[:k], float(k)

    def release(self, rid: int) -> None:
        """The request was preempted: its entries and pages go (its computed KV is gone from the target too)."""
        self._drop(rid)

    def finish(self, rid: int, tokens: list[int], num_prompt_tokens: int) -> None:
        self._drop(rid)

    # ---- drafting -------------------------------------------------------------------------------------------

    def _draft_all(self) -> None:
        """Every request whose last position the head has seen and that has no draft yet gets its full draft
        (proposals take a prefix of it), max_batch requests per batch; then the draft entries are dropped."""
        waiting = [s for s in self._states.values() if s.decoding and s.draft is None]
        if not waiting:
            return
        # The drafts stay on the device until every step of every batch is queued: one read-back for all of them.
        tokens = {id(s): [s.next_token] for s in waiting}
        k = self.num_tokens
        if k > 1:  # the first token needs no step of its own
            for i in range(0, len(waiting), self.head.max_batch):
                self._draft_steps(waiting[i : i + self.head.max_batch], k, tokens)
        flat = [t for s in waiting for t in tokens[id(s)]]
        values = torch.stack(flat).tolist()
        at = 0
        for state in waiting:
            n = len(tokens[id(state)])
            state.draft, at = values[at : at + n], at + n

    def _draft_steps(self, states: list[_State], k: int, tokens: dict[int, list[torch.Tensor]]) -> None:
        """The k - 1 decode steps of the head for `states` (those with room for k - 1 more entries), each step's
        tokens (on the device) fed to the next; tokens[id(state)] gets each step's draft token."""
        kept = {id(s): s.num_entries for s in states}
        states = [s for s in states if self._reserve(s, s.num_entries + k - 1)]  # without room: the 1-token draft
        if not states:
            return
        features = torch.stack([s.feature for s in states])
        input_ids = torch.stack([s.next_token for s in states])
        if self.graphs is not None:
            rows = [(s.pages, s.num_entries, s.end) for s in states]
            steps = self.graphs.run(input_ids, features, rows, self.page_size)
            for r, state in enumerate(states):
                tokens[id(state)].extend(steps[:, r])
                self._give_back(state)  # (its entries did not move: the draft steps' entries are dropped at once)
            return
        for i in range(1, k):
            batch = self._batch([(s, s.num_entries, s.end + i - 1, [0]) for s in states], input_ids=input_ids)
            input_ids, features = self.head.forward(batch, self.pool, features)
            for state, token in zip(states, input_ids):
                tokens[id(state)].append(token)
                state.num_entries += 1
        for state in states:
            state.num_entries = kept[id(state)]
            self._give_back(state)

    # ---- the head's pages -----------------------------------------------------------------------------------

    def _batch(
        self, rows: list[tuple[_State, int, int, list[int]]], input_ids: torch.Tensor | None = None
    ) -> ForwardBatch:
        """A ForwardBatch of requests' rows: (state, the entry of its first row, the position of its first row, the
        token at p + 1 of each row); the rows are the request's last entries. input_ids: the rows' tokens already on
        the device (the lists then only count the rows)."""
        page_size, device = self.page_size, self.head.device
        token_ids, positions, slots, query_start, kv_lens, tables = [], [], [], [0], [], []
        for state, first, start, tokens in rows:
            count = len(tokens)
            token_ids.extend(tokens)
            positions.extend(range(start, start + count))
            slots.extend(state.pages[e // page_size] * page_size + e % page_size for e in range(first, first + count))
            query_start.append(query_start[-1] + count)
            kv_lens.append(first + count)
            tables.append(state.pages)
        width = max(len(t) for t in tables)
        table = [t + [0] * (width - len(t)) for t in tables]
        lengths = [b - a for a, b in zip(query_start, query_start[1:])]
        rows_n, seqs = len(positions), len(rows)
        # Two packed copies (int64, int32) instead of one a field: on a GPU from pinned memory without waiting, where
        # a copy from a Python list waits for every kernel queued before it.
        wide = _to_device(
            torch.tensor(token_ids + positions + slots + [end - 1 for end in query_start[1:]], dtype=torch.int64),
            device,
        )
        narrow = _to_device(
            torch.tensor(query_start + kv_lens + [p for row in table for p in row], dtype=torch.int32), device
        )
        if input_ids is None:
            input_ids = wide[:rows_n]
        return ForwardBatch(
            input_ids=input_ids,
            positions=wide[rows_n : 2 * rows_n],
            out_slots=wide[2 * rows_n : 3 * rows_n],
            query_start=narrow[: seqs + 1],
            kv_lens=narrow[seqs + 1 : 2 * seqs + 1],
            page_table=narrow[2 * seqs + 1 :].view(seqs, width),
            logits_indices=wide[3 * rows_n :],
            is_decode=max(lengths) == 1,
            max_query_len=max(lengths),
        )

    def _truncate(self, state: _State, start: int) -> None:
        """Drop every entry at position >= start (recomputed positions) and give back the pages left empty."""
        while state.runs and state.runs[-1][0] >= start:
            state.num_entries -= state.runs.pop()[1]
        if state.runs and state.runs[-1][0] + state.runs[-1][1] > start:
            cut = state.runs[-1][0] + state.runs[-1][1] - start
            state.runs[-1][1] -= cut
            state.num_entries -= cut
        state.end = min(state.end, start)
        self._give_back(state)

    def _reserve(self, state: _State, num_entries: int) -> bool:
        """Pages for num_entries entries; False (nothing taken) when the pool has too few."""
        need = -(-num_entries // self.page_size) - len(state.pages)
        if need <= 0:
            return True
        pages = self.pool.allocator.alloc(need)
        if pages is None:
            return False
        state.pages.extend(pages)
        return True

    def _give_back(self, state: _State) -> None:
        keep = -(-state.num_entries // self.page_size)
        if len(state.pages) > keep:
            self.pool.allocator.decref(state.pages[keep:])
            del state.pages[keep:]

    def _drop(self, rid: int) -> None:
        state = self._states.pop(rid, None)
        if state is not None and state.pages:
            self.pool.allocator.decref(state.pages)

    def check_invariants(self, running) -> None:
        """The head pool's ownership (see the module's docstring), and no entry at or past a running request's
        computed length (no rejected draft token, nothing of a request that is not running); InvariantError."""
        allocator = self.pool.allocator
        try:
            allocator.check()
        except RuntimeError as e:
            raise InvariantError(f"the EAGLE-3 head's allocator: {e}") from e
        computed = {r.rid: r.cached_len for r in running}
        held: list[int] = []  # every page once per state that holds it
        for rid, state in self._states.items():
            if rid not in computed:
                raise InvariantError(f"the EAGLE-3 head keeps KV of request {rid}, which is not running", state.pages)
            if len(state.pages) != -(-state.num_entries // self.page_size):
                raise InvariantError(
                    f"request {rid}'s head state holds {len(state.pages)} pages for {state.num_entries} entries",
                    state.pages,
                )
            if state.num_entries != sum(n for _, n in state.runs) or state.end > computed[rid]:
                raise InvariantError(
                    f"request {rid}'s head KV reaches position {state.end}, past its {computed[rid]} computed "
                    f"tokens (or its {state.num_entries} entries disagree with its runs {state.runs})",
                    state.pages,
                )
            held += state.pages
        wrong = allocator.refcount_mismatches(held)
        if wrong:
            raise InvariantError(
                f"{len(wrong)} pages of the EAGLE-3 head's pool with the wrong reference count, the first "
                f"{wrong[0]}: refcount {allocator.refcount(wrong[0])}, held {held.count(wrong[0])} times",
                wrong,
            )
