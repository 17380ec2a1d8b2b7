"""The overlap schedule on the CPU: a decode step chosen by Scheduler.schedule_ahead before the previous step's
tokens are recorded. Driven like LLMEngine.step drives it, with a made-up model whose token at each position depends
only on the request and the position, so every request must produce exactly the same tokens as when each step is
recorded before the next is chosen, whatever the interleaving of admissions, aborts, evictions and stops."""

from __future__ import annotations

import random
import zlib

from fastqwen.config import GenerationDefaults
from fastqwen.kvcache import PageAllocator, RadixCache, check_kv_invariants
from fastqwen.sampling_params import SamplingParams
from fastqwen.scheduler import Request, Scheduler
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EOS = 0
MAX_MODEL_LEN = 64


def token_at(rid: int, position: int) -> int:
    """The made-up model: the token sampled for position `position` of request `rid`; EOS about one time in 12."""
    return zlib.crc32(f"{rid}:{position}".encode()) % 12


def expected_output(request: Request) -> list[int]:
    """What the request must generate: tokens until EOS, max_tokens or the context length."""
    out = []
    position = request.num_prompt_tokens
    while True:
        token = token_at(request.rid, position)
        out.append(token)
        position += 1
        if token == EOS or len(out) >= request.params.max_tokens or position >= MAX_MODEL_LEN:
            return out


class Driver:
    """Runs a Scheduler the way LLMEngine.step does, with or without the overlap schedule."""

    def __init__(self, num_pages: int, page_size: int, budget: int, max_seqs: int, overlap: bool):
        self.allocator = PageAllocator(num_pages)
        self.cache = RadixCache(self.allocator, page_size)
        self.scheduler = Scheduler(self.allocator, page_size, max_seqs, budget, MAX_MODEL_LEN, [EOS], self.cache)
        self.overlap = overlap
        self.ahead = None  # (batch, tokens) launched, not recorded
        self.num_ahead = 0
        self.requests: list[Request] = []
        self.aborted: set[int] = set()
        self.rng = random.Random(0)

    def check(self) -> None:
        check_kv_invariants(self.allocator, self.cache, self.scheduler.running, self.scheduler.waiting)

    @staticmethod
    def launch(batch, ahead: bool) -> list[int]:
        """The tokens the model samples: one per sampling chunk, or per chunk of a step chosen ahead (each of its rows
        samples the token after the one in flight)."""
        return [token_at(c.request.rid, c.end) for c in batch.chunks if ahead or c.samples]

    def admit(self, prompt_len: int, max_tokens: int) -> None:
        rid = len(self.requests)
        prompt = [1 + (rid + i) % 3 if i < 6 else self.rng.randrange(1, 12) for i in range(prompt_len)]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens).with_defaults(GenerationDefaults())
        request = Request(rid=rid, prompt_ids=prompt, params=params, arrival=rid)
        self.requests.append(request)
        try:
            self.scheduler.add(request)
        except ValueError:
            self.aborted.add(rid)  # too long for the little pool: rejected, holds nothing

    def step(self) -> None:
        if self.ahead is not None:
            (batch, tokens), self.ahead = self.ahead, None
        else:
            batch = self.scheduler.schedule()
            tokens = self.launch(batch, ahead=False)
        if self.overlap:
            following = self.scheduler.schedule_ahead(batch)
            if following is not None:
                self.ahead = (following, self.launch(following, ahead=True))
                self.num_ahead += 1
        self.scheduler.update(batch, tokens)

    def abort(self, pick: int) -> None:
        everyone = list(self.scheduler.running) + list(self.scheduler.waiting)
        if everyone:
            victim = everyone[pick % len(everyone)]
            self.aborted.add(victim.rid)
            self.scheduler.abort(victim.rid)

    def evict(self, pages: int) -> None:
        self.cache.evict(pages)

    def busy(self) -> bool:
        return self.scheduler.has_work() or self.ahead is not None

    def run_to_end(self) -> None:
        for _ in range(5000):
            if not self.busy():
                return
            self.step()
            self.check()
        raise AssertionError("did not finish")


_operation = st.one_of(
    st.tuples(st.just("admit"), st.integers(1, 20), st.integers(1, 30)),
    st.tuples(st.just("step")),
    st.tuples(st.just("step")),
    st.tuples(st.just("step")),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("evict"), st.integers(1, 10)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_pages=st.integers(6, 40),
    page_size=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(1, 24),
    max_seqs=st.integers(1, 6),
    operations=st.lists(_operation, min_size=1, max_size=80),
)
def test_overlap_gives_the_same_tokens_and_keeps_the_invariants(num_pages, page_size, budget, max_seqs, operations):
    driver = Driver(num_pages, page_size, budget, max_seqs, overlap=True)
    for op in operations:
        getattr(driver, op[0])(*op[1:])
        driver.check()
    driver.run_to_end()
    for request in driver.requests:
        assert request.finished or request.rid in driver.aborted
        if request.rid not in driver.aborted:
            assert request.output_ids == expected_output(request), request.rid
    driver.cache.reset()
    driver.check()
    assert driver.allocator.num_free() == num_pages


def test_steps_are_chosen_ahead_and_match_the_plain_schedule():
    """A steady decode batch is chosen ahead at every step but the first; the tokens equal those of the plain
    schedule; requests that stop on EOS meanwhile get nothing from the step in flight."""
    runs = {}
    for overlap in (False, True):
        driver = Driver(num_pages=200, page_size=4, budget=64, max_seqs=8, overlap=overlap)
        for i, max_tokens in enumerate([4, 30, 6, 40, 8, 12, 3, 25]):
            driver.admit(prompt_len=5 + i, max_tokens=max_tokens)
        driver.run_to_end()
        runs[overlap] = driver
        assert not driver.aborted
    plain, overlapped = runs[False], runs[True]
    assert plain.num_ahead == 0 and overlapped.num_ahead > 10
    for a, b in zip(plain.requests, overlapped.requests):
        assert a.output_ids == b.output_ids == expected_output(a)
        assert a.finish_reason == b.finish_reason
    assert any(r.finish_reason.value == "stop" for r in overlapped.requests), "no request stopped on EOS: weak test"
    assert any(r.finish_reason.value == "length" for r in overlapped.requests)


def test_no_step_is_chosen_ahead_when_it_could_differ():
    """A waiting request with a free seat, a prefill in the batch, or a batch that misses a running request: the next
    step is left to schedule(). Requests at their last token are left out of the step chosen ahead."""
    driver = Driver(num_pages=100, page_size=4, budget=64, max_seqs=4, overlap=True)
    driver.admit(prompt_len=6, max_tokens=30)
    driver.admit(prompt_len=6, max_tokens=2)
    scheduler = driver.scheduler
    prefill = scheduler.schedule()
    assert not prefill.is_decode and scheduler.schedule_ahead(prefill) is None
    scheduler.update(prefill, Driver.launch(prefill, ahead=False))
    decode = scheduler.schedule()
    assert decode.is_decode and len(decode.chunks) == 2
    following = scheduler.schedule_ahead(decode)
    # The second request gets its 2nd and last token from `decode`: only the first one continues.
    assert following is not None and [c.request.rid for c in following.chunks] == [0]
    chunk = following.chunks[0]
    assert chunk.start == len(chunk.request.token_ids) and chunk.end == chunk.start + 1
    assert len(chunk.request.pages) * 4 >= chunk.end  # its page for the next token is there already
    driver.admit(prompt_len=6, max_tokens=5)  # waiting, with a free seat: admission would change the next step
    assert scheduler.schedule_ahead(decode) is None
