"""The scheduler's contracts, driven directly without a model: what one step may compute (the token budget) and
whom a page shortage preempts. The outputs cannot show either (a step over budget and a different victim give the
same tokens), so these tests read the schedule itself."""

from __future__ import annotations

import random

import pytest
from fastqwen.config import GenerationDefaults
from fastqwen.kvcache import PageAllocator
from fastqwen.sampling_params import SamplingParams
from fastqwen.scheduler import Request, Scheduler


def _request(rid: int, prompt_len: int, max_tokens: int) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True).with_defaults(GenerationDefaults())
    return Request(rid=rid, prompt_ids=[1 + (rid + i) % 50 for i in range(prompt_len)], params=params, arrival=rid)


def _step(scheduler: Scheduler):
    """One step as the engine takes it, with a made-up token (never EOS: token 0 is the EOS here) per sampling chunk."""
    batch = scheduler.schedule()
    scheduler.update(batch, [7] * sum(c.samples for c in batch.chunks))
    return batch


@pytest.mark.parametrize("budget", [1, 7, 16])
def test_every_step_computes_exactly_the_budget_while_enough_work_waits(budget):
    """Contract: a step computes at most max_num_batched_tokens tokens, and exactly that many while the requests hold
    at least that much work (pages and sequence slots plentiful, no prefix cache, no grammar). Mixed prompt lengths,
    shorter and longer than the budget, so prefills are chunked and mixed with decodes; requests also arrive while
    others run.

    Mutation check (run once, not committed): Scheduler._chunk_size taking min(uncomputed, budget + 1) fails this
    test (a 7-token budget computes 8 at the first step)."""
    rng = random.Random(budget)
    scheduler = Scheduler(PageAllocator(4096), 4, 64, budget, 4096, [0])
    lengths = [rng.choice([1, 2, 3, budget - 1, budget, budget + 1, 2 * budget + 3, 40]) for _ in range(24)]
    lengths = [max(n, 1) for n in lengths]
    for rid, n in enumerate(lengths[:12]):
        scheduler.add(_request(rid, n, max_tokens=rng.randint(1, 5)))
    later = list(enumerate(lengths[12:], start=12))
    steps = full_steps = 0
    while scheduler.has_work() or later:
        if later and steps % 3 == 0:
            rid, n = later.pop(0)
            scheduler.add(_request(rid, n, max_tokens=rng.randint(1, 5)))
        work = sum(r.uncomputed for r in list(scheduler.running) + list(scheduler.waiting))
        batch = _step(scheduler)
        sizes = [c.end - c.start for c in batch.chunks]
        assert all(s >= 1 for s in sizes), sizes
        assert sum(sizes) <= budget, f"step {steps} computed {sizes}, {sum(sizes)} tokens over a budget of {budget}"
        assert sum(sizes) == min(budget, work), f"step {steps} computed {sum(sizes)} of {work} waiting, budget {budget}"
        full_steps += sum(sizes) == budget
        steps += 1
        assert steps < 2000
    assert full_steps >= 5, "too few steps had a full budget of work: the test checks too little"


def test_a_page_shortage_preempts_the_newest_running_request():
    """Contract: when a running request needs a page and none is free, the newest running request (the last
    admitted) is preempted, not an older one; it goes back to the front of the queue, and the others keep their pages.

    Pages of 2 tokens, 7 in the pool. A and B have 2-token prompts, C and D 3-token ones: after the first step (all
    four prefilled, 6 pages taken, 1 free) each decodes; A takes the free page, B needs one more; C and D need
    none. Preempting D (the newest) frees 2 pages and everyone else decodes; preempting C (the bug below) would
    also let the step run, so only the victim's identity shows the rule.

    Mutation check (run once, not committed): Scheduler.schedule choosing the oldest pending request as the victim
    (min instead of max by arrival) fails this test (C is preempted)."""
    allocator = PageAllocator(7)
    scheduler = Scheduler(allocator, 2, 8, 64, 64, [0])
    a, b, c, d = (_request(rid, n, max_tokens=10) for rid, n in enumerate([2, 2, 3, 3]))
    for request in (a, b, c, d):
        scheduler.add(request)
    first = _step(scheduler)
    assert [ch.request for ch in first.chunks] == [a, b, c, d] and allocator.num_free() == 1
    second = _step(scheduler)
    assert scheduler.num_preemptions == 1
    assert d.num_preemptions == 1 and list(scheduler.waiting) == [d], "the newest running request was not the victim"
    assert [ch.request for ch in second.chunks] == [a, b, c] and scheduler.running == [a, b, c]
    assert (a.num_preemptions, b.num_preemptions, c.num_preemptions) == (0, 0, 0)
    assert d.pages == [] and d.cached_len == 0
