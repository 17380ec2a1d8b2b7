"""The admission policy: which waiting request joins the running batch at this step, and how much of its prompt
the step computes (mini-sglang calls its own `PrefillAdder`). A policy a reader may want to change, in one place.

The rules, in the order they are applied:
- Nobody is admitted in a step that preempted a running request: pages are short, and whoever came in now would
  be preempted again at the next step.
- First come, first served: only the head of the waiting queue is considered (a preempted request goes back to the
  front); when it cannot come in, nobody behind it does.
- Room: the step has token budget left (max_num_batched_tokens, after the running requests took theirs) and fewer
  than max_num_seqs requests run.
- The prefix cache: the request starts from the longest cached prefix of its tokens; if another chunk of this very
  step computes its next page (the same tokens), it waits one step and takes that page from the cache.
- Pages: the pages its first chunk needs must be free, after evicting unreferenced cache leaves; admission never
  preempts a running request.
- Its first chunk is as much of its prompt as the budget left allows (chunked prefill).

Before a request reaches the scheduler, three checks decide whether it may wait at all: the frontend refuses one
that could never fit the context or the pool (limits.check_fits), the server bounds the waiting queue
(AsyncEngine.enqueue: max_queued_requests, then 503), and one with a grammar waits in the engine until the grammar
is compiled (LLMEngine._admit_compiled).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .request import Request
    from .scheduler import ScheduledChunk, Scheduler


class Admission:
    """The admission policy of one scheduler, which owns the queues and the pages this policy asks it for."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    def has_room(self, budget: int, preempted: bool) -> bool:
        """Whether this step may admit the next waiting request at all (budget, sequence limit, no preemption)."""
        s = self.scheduler
        return not preempted and bool(s.waiting) and budget > 0 and len(s.running) < s.max_num_seqs

    def might_admit(self) -> bool:
        """Whether a step might admit someone now (schedule_ahead chooses a step ahead only when not)."""
        s = self.scheduler
        return bool(s.waiting) and len(s.running) < s.max_num_seqs

    def try_admit_next(self, chunks: list[ScheduledChunk], budget: int) -> int | None:
        """For the head of the waiting queue: how many of its tokens this step computes, its cached prefix matched
        and the pages for them taken; None when it must keep waiting (it then holds nothing)."""
        s = self.scheduler
        request = s.waiting[0]
        s._match_cached_prefix(request)
        if self._computes_same_pages(request, chunks):
            # Another request computes this request's next pages in this very step: wait one step and take them
            # from the cache instead of computing them twice.
            s._drop_cached_prefix(request)
            return None
        n = s._chunk_size(request, budget)
        if n == 0:  # (a preempted request with all but its last token cached, its grammar's mask not ready yet)
            s._drop_cached_prefix(request)
            return None
        # Admission never preempts: a new request waits until pages are free.
        if not s._grow(request, request.cached_len + n):
            s._drop_cached_prefix(request)
            return None
        return n

    def _computes_same_pages(self, request: Request, chunks: list[ScheduledChunk]) -> bool:
        """Does a chunk of this step compute the request's first uncached page, for the same prefix?"""
        s = self.scheduler
        if s.cache is None:
            return False
        end = request.cached_len + s.page_size
        if end > request.reusable_prefix:
            return False
        for chunk in chunks:
            other = chunk.request
            if (
                chunk.start <= request.cached_len
                and chunk.end >= end
                and other.token_ids[:end] == request.token_ids[:end]
            ):
                return True
        return False
