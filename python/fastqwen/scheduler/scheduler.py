"""Continuous batching: which tokens of which requests the next step computes.

Prefill, chunked prefill and decode are one operation: compute token_ids[cached_len:cached_len + n]. A chunk that
reaches the end of token_ids samples the next token. Each step, running requests go first (decodes, then unfinished
prefills), then waiting requests are admitted as the admission policy allows (admission.py: token budget, sequence
limit, free pages, the prefix cache).
When a running request needs a page and none is free, unreferenced prefix-cache pages are evicted first; if that is
not enough, the newest running request is preempted: its computed prefix goes to the prefix cache, its pages are
released, and it goes back to the front of the queue, to be recomputed (cheaply, from the cache) later.

A request with a grammar whose mask missed its step (the engine dropped the row: the grammar computes each mask on a
worker thread, and this one was not ready when the step sampled) waits for it (Request.waits_for_mask): its chunk
stops one token short of sampling, and a decode has nothing to compute, so the request sits steps out (keeping its
pages) instead of holding the batch.

With a prefix cache, an admitted request starts from the longest cached prefix of its tokens (always leaving one
token to compute, and none over a prompt position whose logprobs were asked for: Request.reusable_prefix), and every
request's computed whole pages go into the cache after each prefill chunk and when it stops. Pages have two kinds of
owners, requests and the cache, each holding and releasing only its own reference.

update() records a step's tokens and stops a request on EOS or a stop id, max_tokens, the context length, or its
grammar (complete, or given up). With the overlap schedule, schedule_ahead() picks the next decode step before this
one's tokens are known, only where it is the step schedule() would give.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

from ..kvcache.radix_cache import RadixCache
from ..limits import check_fits
from ..speculative import Speculator
from .admission import Admission
from .request import FinishReason, Request, RequestState


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # first token computed (== request.cached_len when scheduled)
    end: int  # one past the last of its own tokens
    # Speculative decoding: tokens proposed to follow the request's last one, computed after it in the same step
    # (their KV written at end, end + 1, ...), each position sampled: the engine keeps the run the target agrees with.
    draft: tuple[int, ...] = ()
    # Draft tokens from this index on only fill the chunk up to the verify graphs' length (from the cut: a draft cut
    # short near max_tokens or by its grammar; from 0: a request without a draft in a step where others draft). They
    # are never accepted nor counted, and their positions draw under the last real position's grammar mask (their
    # draws are dropped). None: every draft token is a real guess.
    filled_from: int | None = None

    @property
    def real_draft(self) -> tuple[int, ...]:
        return self.draft if self.filled_from is None else self.draft[: self.filled_from]

    @property
    def samples(self) -> bool:
        return self.end == len(self.request.token_ids) and self.request.pooling is None

    @property
    def pools(self) -> bool:
        """The last chunk of a prefill-only request: its last position is pooled, not sampled, and it finishes."""
        return self.end == len(self.request.token_ids) and self.request.pooling is not None

    @property
    def num_tokens(self) -> int:
        return self.end - self.start + len(self.draft)

    @property
    def num_rows(self) -> int:
        """Its sampling rows: one per verified position (none for a prefill chunk that stops short)."""
        return 1 + len(self.draft) if self.samples else 0


@dataclass
class ScheduledBatch:
    chunks: list[ScheduledChunk]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_decode(self) -> bool:
        return all(c.num_tokens == 1 for c in self.chunks)

    @property
    def has_drafts(self) -> bool:
        return any(c.draft for c in self.chunks)


class Scheduler:
    def __init__(
        self,
        allocator,
        page_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: list[int],
        cache: RadixCache | None = None,
        speculator: Speculator | None = None,
    ):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        self.allocator = allocator
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # in admission order
        self.cache = cache
        self.num_preemptions = 0
        self.num_computed_tokens = 0  # tokens of every step recorded: prefill work actually done, plus decodes
        self.admission = Admission(self)  # who joins the running batch, and when
        self.speculator = speculator  # drafts for decoding requests (speculative/), or None

    # ---- requests in and out -------------------------------------------------------------------------------

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise InvalidRequestError for a request that could never run here."""
        check_fits(num_prompt_tokens, max_tokens, self.max_model_len, self.page_size, self.allocator.num_total())

    def add(self, request: Request) -> None:
        self.check_fits(request.num_prompt_tokens, request.params.max_tokens)
        request.state = RequestState.WAITING
        self.waiting.append(request)

    def abort(self, rid: int) -> Request | None:
        """Stop a request wherever it is and release its pages at once. Returns it, or None if unknown."""
        for request in self.waiting:
            if request.rid == rid:
                self.waiting.remove(request)
                self._finish(request, FinishReason.ABORT)
                return request
        for request in self.running:
            if request.rid == rid:
                self.running.remove(request)
                self._finish(request, FinishReason.ABORT)
                return request
        return None

    def fail(self, request: Request) -> None:
        """Drop a request whose step failed: like abort, but nothing more of it goes into the prefix cache (the failed
        step may have half-written its KV; what it put there before came from steps that completed)."""
        self.waiting = collections.deque(r for r in self.waiting if r is not request)
        self.running = [r for r in self.running if r is not request]
        self._release(request)
        request.state = RequestState.FINISHED
        request.finish_reason = FinishReason.ERROR
        if self.speculator is not None:
            self.speculator.finish(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ------------------------------------------------------------------------------------------

    def schedule(self, admit: bool = True) -> ScheduledBatch:
        """The next step: running requests first (decodes, then prefill chunks), then waiting ones as admission allows;
        `admit` False leaves the waiting ones for a later step."""
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        # Decodes first so a long prefill chunk never starves them; both in admission order.
        pending = sorted(self.running, key=lambda r: (r.uncomputed > 1, r.arrival))
        speculating = self.speculator is not None and self.speculator.active(len(self.running))
        preempted = False
        while pending and budget > 0:
            request = pending.pop(0)
            n = self._chunk_size(request, budget)
            if n == 0:
                continue  # its grammar's mask is not ready: it decodes in a later step
            draft = self._draft(request, budget - 1) if speculating and n == request.uncomputed == 1 else ()
            if draft and not self._grow(request, request.cached_len + 1 + len(draft)):
                draft = ()  # no pages for the draft: decode without it before preempting anyone
            while not self._grow(request, request.cached_len + n):
                victim = max(pending, key=lambda r: r.arrival) if pending else request
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                pending.remove(victim)
            else:
                chunks.append(ScheduledChunk(request, request.cached_len, request.cached_len + n, draft))
                budget -= n + len(draft)
        # Then waiting requests, as the admission policy (admission.py) allows.
        while admit and self.admission.has_room(budget, preempted):
            n = self.admission.try_admit_next(chunks, budget)
            if n is None:
                break
            request = self.waiting.popleft()
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                if self.cache is not None:
                    request.num_cached_tokens = min(request.cached_len, request.num_prompt_tokens)
            request.state = RequestState.RUNNING
            self.running.append(request)
            chunks.append(ScheduledChunk(request, request.cached_len, request.cached_len + n))
            budget -= n
        if speculating and self.speculator.pad_drafts:
            self._fill_drafts(chunks, budget)
        return ScheduledBatch(chunks)

    def _fill_drafts(self, chunks: list[ScheduledChunk], budget: int) -> None:
        """Verify graphs replay a step only when every chunk decodes with a draft of their one length: in a step of
        decodes where some draft, a draft cut short (near max_tokens, or by its grammar) and a chunk without one (its
        request paused for low acceptance, left with only the token the step samples, or cut to nothing by its
        grammar) are filled up with filler (ScheduledChunk.filled_from) instead of running the whole step eagerly;
        tokens past max_tokens are computed and dropped (update stops the request there). Not for a request without
        the room in the context, pages or budget."""
        k = self.speculator.num_tokens
        if not any(c.draft for c in chunks) or not all(c.end - c.start == 1 and c.samples for c in chunks):
            return
        for i, chunk in enumerate(chunks):
            request, short = chunk.request, k - len(chunk.draft)
            if short <= 0 or budget < short or self.max_model_len - len(request.token_ids) - 1 < k:
                continue
            if not self._grow(request, chunk.end + k):
                continue
            draft = chunk.draft + (request.token_ids[-1],) * short
            chunks[i] = ScheduledChunk(request, chunk.start, chunk.end, draft, filled_from=len(chunk.draft))
            budget -= short

    def schedule_ahead(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """The decode step that follows `batch`, chosen before `batch`'s tokens are known, so the engine can launch it
        while the host records `batch` (the token each row reads is the one `batch` samples, still on the device).

        Only when it is the step schedule() would give, up to what the tokens decide: `batch` decoded every running
        request and nothing waiting could be admitted. Requests that reach max_tokens or the context with this
        token are left out. One that stops on an EOS or a stop id, or is aborted meanwhile (a stop string), computes
        one token in vain: its result is dropped (update skips finished requests) and its KV write goes to a page
        it held, past anything it gave the prefix cache. None when the step cannot be chosen ahead (a prefill, an
        admission, a page shortage that needs a preemption).
        """
        if not batch.chunks or not batch.is_decode or len(batch.chunks) != len(self.running):
            return None
        speculator = self.speculator
        if speculator is not None and speculator.active(len(self.running)):
            # A draft follows this step's tokens: the next step is chosen once they are known, unless no request may
            # draft (every one is paused for low acceptance).
            if any([speculator.may_draft(r) for r in self.running]):
                return None
        if self.admission.might_admit():
            return None
        chunks = []
        for chunk in batch.chunks:
            request = chunk.request
            if request.finished or not chunk.samples:
                return None
            pos = len(request.token_ids)  # where the token being sampled now goes
            if request.num_output_tokens + 1 >= request.params.max_tokens or pos + 1 >= self.max_model_len:
                continue  # this token is its last
            if not self._grow(request, pos + 1):
                return None  # pages grown for earlier rows stay: their requests need them next step anyway
            chunks.append(ScheduledChunk(request, pos, pos + 1))
        if not chunks:
            return None
        return ScheduledBatch(chunks)

    def update(
        self, batch: ScheduledBatch, sampled: list[int | list[int]], ahead: bool = False
    ) -> list[tuple[Request, int, int]]:
        """Record a step's results: sampled[i] belongs to the i-th sampling chunk, its token, or for a chunk with a
        draft the tokens it emits (the accepted draft tokens, then the target's next one).

        Returns (request, i, n) for every request that got new tokens, finished or not: the first n of sampled[i]'s
        tokens were kept (fewer than emitted when one of them stops the request). A request that finished (or was
        aborted) after the step was launched gets nothing. `ahead`: a chained verify step follows this one already
        (reserve_ahead): its requests keep their reserved pages; otherwise the reservations end here.
        """
        self.num_computed_tokens += batch.num_tokens
        advanced = []
        index = -1
        for chunk in batch.chunks:
            request = chunk.request
            index += chunk.samples
            if request.finished:
                continue
            request.cached_len = chunk.end
            if chunk.pools:  # the model runner put its result in request.pooled
                self.running.remove(request)
                self._finish(request, FinishReason.STOP)
                continue
            if not chunk.samples:
                continue
            emitted = sampled[index]
            tokens = emitted if isinstance(emitted, list) else [emitted]
            request.mask_missed = False
            kept = 0
            reason = None
            for token in tokens:
                request.token_ids.append(token)
                kept += 1
                reason = self._stop_reason(request, token)
                if request.grammar is not None and not request.grammar.advance(token):
                    if request.grammar.error is not None:  # it gave up (whatever the token was, EOS included)
                        request.stop_reason, reason = None, FinishReason.ERROR
                    elif reason is not FinishReason.STOP:
                        request.stop_reason, reason = None, FinishReason.STOP  # the grammar is complete
                if reason is not None:
                    break
            # The KV of the accepted draft tokens is valid (each equals the token kept at its position); the rest
            # of the draft's KV lies past cached_len, is never read, and its pages are given back.
            request.cached_len = chunk.end + min(kept - 1, len(chunk.draft))
            advanced.append((request, index, kept))
            if reason is not None:
                self.running.remove(request)
                self._finish(request, reason)
            elif chunk.draft or request.reserved_len:
                if not ahead:
                    request.reserved_len = 0
                self._trim_pages(request)
        if self.cache is not None:
            for chunk in batch.chunks:  # share freshly prefilled pages with requests admitted from now on
                if chunk.end - chunk.start > 1 and not chunk.request.finished:
                    self._cache_computed_prefix(chunk.request)
        return advanced

    # ---- internals ----------------------------------------------------------------------------------------

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        """EOS and stop ids (none before min_tokens), then max_tokens and the context length. Stop strings are text:
        the frontend matches them and aborts the request."""
        params = request.params
        if request.num_output_tokens > params.min_tokens:
            if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
                request.stop_reason = token
                return FinishReason.STOP
        if request.num_output_tokens >= params.max_tokens or len(request.token_ids) >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _chunk_size(self, request: Request, budget: int) -> int:
        """How many of the request's uncomputed tokens this step computes: as many as the budget allows, but never
        its last one (the one that samples) while it waits for its grammar's mask."""
        n = min(request.uncomputed, budget)
        if n == request.uncomputed and request.waits_for_mask:
            n -= 1
        return n

    def _draft(self, request: Request, budget: int) -> tuple[int, ...]:
        """The speculator's draft for a decoding request: no longer than the budget, and leaving room in max_tokens
        and the context for the token the step samples anyway (_fill_drafts fills it up for the verify graphs)."""
        limit = min(
            budget,
            request.params.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - len(request.token_ids) - 1,
        )
        return self.speculator.propose(request, limit) if limit > 0 else ()

    def reserve_ahead(self, requests: list[Request], num_tokens: int) -> bool:
        """Pages for num_tokens tokens past each request's recorded ones (its last one included), held until the
        update that ends the reservation: a chained verify step (engine/verify_chain.py) is launched before the host
        knows where the step before it ends, so its pages are grown for the longest outcome and kept past trims
        while it is in flight. False when the pages cannot all be had without a preemption (nothing is reserved;
        pages grown for earlier requests go back at their next trim)."""
        for request in requests:
            end = len(request.token_ids) - 1 + num_tokens
            if end > self.max_model_len or not self._grow(request, end):
                return False
        for request in requests:
            request.reserved_len = len(request.token_ids) - 1 + num_tokens
        return True

    def _trim_pages(self, request: Request) -> None:
        """Give back the pages a verify step grew for draft tokens that were rejected (past the request's tokens and
        its reservation)."""
        keep = self._pages_for(max(len(request.token_ids), request.reserved_len))
        if len(request.pages) > keep:
            self.allocator.decref(request.pages[keep:])
            del request.pages[keep:]

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _grow(self, request: Request, num_tokens: int) -> bool:
        """Give the request pages for num_tokens tokens of KV, evicting cached prefixes if needed; False (and
        nothing taken) if even that leaves too few."""
        need = self._pages_for(num_tokens) - len(request.pages)
        if need <= 0:
            return True
        pages = self.allocator.alloc(need)
        if pages is None and self.cache is not None:
            self.cache.evict(need - self.allocator.num_free())
            pages = self.allocator.alloc(need)
        if pages is None:
            return False
        request.pages.extend(pages)
        return True

    # ---- the prefix cache ----------------------------------------------------------------------------------

    def _match_cached_prefix(self, request: Request) -> None:
        """Start a request that holds no pages from the longest cached prefix of its tokens."""
        if self.cache is None or request.pages:
            return
        pages, node = self.cache.match_prefix(request.token_ids[: request.reusable_prefix])
        if not pages:
            return
        self.allocator.incref(pages)
        self.cache.lock(node)
        request.pages = pages
        request.cache_node = node
        request.cached_len = len(pages) * self.page_size

    def _drop_cached_prefix(self, request: Request) -> None:
        """Undo _match_cached_prefix for a request that stays waiting: waiting requests hold nothing."""
        self._release(request)
        request.cached_len = 0

    def _cache_computed_prefix(self, request: Request) -> None:
        """Put the request's computed whole pages into the cache and lock the path it now ends at."""
        if self.cache is None:
            return
        num_pages = request.cached_len // self.page_size
        if num_pages == 0 or num_pages * self.page_size <= request.cached_in_tree:
            return
        node = self.cache.insert(request.token_ids[: num_pages * self.page_size], request.pages[:num_pages])
        self.cache.lock(node)
        if request.cache_node is not None:
            self.cache.unlock(request.cache_node)
        request.cache_node = node
        request.cached_in_tree = num_pages * self.page_size

    def _release(self, request: Request) -> None:
        """Drop everything the request holds: its lock on the cache path, and its own page references."""
        if request.cache_node is not None:
            self.cache.unlock(request.cache_node)
            request.cache_node = None
        request.cached_in_tree = 0
        request.reserved_len = 0
        if request.pages:
            self.allocator.decref(request.pages)
            request.pages = []

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._cache_computed_prefix(request)
        self._release(request)
        request.cached_len = 0
        request.state = RequestState.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        if self.speculator is not None:
            self.speculator.preempt(request)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        self._cache_computed_prefix(request)
        self._release(request)
        request.state = RequestState.FINISHED
        request.finish_reason = reason
        if self.speculator is not None:
            self.speculator.finish(request)
