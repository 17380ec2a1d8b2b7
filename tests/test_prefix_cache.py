"""The radix prefix cache: identical outputs with and without it, ownership invariants under random interleavings,
and the prefill work it saves."""

from __future__ import annotations

import random

import pytest
from checkpoints import make_checkpoint
from fastqwen import LLM, SamplingParams
from fastqwen.kvcache import PageAllocator, RadixCache, check_kv_invariants
from fastqwen.sampling_params import SamplingParams as SP
from fastqwen.scheduler import Request, Scheduler
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("prefix"))
    make_checkpoint(path, tied=False, num_heads=4, num_kv_heads=2, seed=31, max_positions=2048)
    return path


def engines(folder, **kwargs):
    common = dict(dtype="float32", device="cpu", page_size=4, num_pages=kwargs.pop("num_pages", 1024), **kwargs)
    return LLM(folder, enable_prefix_caching=True, **common), LLM(folder, enable_prefix_caching=False, **common)


def words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(380) for _ in range(n)]


def clean(llm: LLM) -> None:
    llm.engine.check_invariants()
    if llm.engine.cache is not None:
        llm.engine.cache.reset()
    allocator = llm.engine.kv.allocator
    assert allocator.num_free() == allocator.num_total()


def test_shared_system_prompt(folder):
    rng = random.Random(1)
    system = words(rng, 41)
    prompts = [system + words(rng, rng.randint(1, 20)) for _ in range(8)]
    cached, plain = engines(folder)
    first = cached.generate(prompts[:1], GREEDY, use_tqdm=False)  # the system prompt is now cached
    together = cached.generate(prompts[1:], GREEDY, use_tqdm=False)
    expected = plain.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in first + together] == [o.token_ids for o in expected]
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens == 40 for o in together), [o.num_cached_tokens for o in together]
    assert all(o.num_cached_tokens == 0 for o in expected)
    clean(cached)


def test_multi_turn_conversation(folder):
    rng = random.Random(2)
    cached, plain = engines(folder)
    history_c = history_p = words(rng, 23)
    previous: list[int] = []  # the last turn's prompt and answer
    for turn in range(4):
        out_c = cached.generate([history_c], GREEDY, use_tqdm=False)[0]
        out_p = plain.generate([history_p], GREEDY, use_tqdm=False)[0]
        assert out_c.token_ids == out_p.token_ids
        if turn > 0:  # the previous turn's prompt and answer are cached, in whole pages
            assert out_c.num_cached_tokens >= len(previous) - 4, (out_c.num_cached_tokens, len(previous))
        previous = history_c + out_c.token_ids
        user = words(rng, 7)
        history_c = previous + user
        history_p = history_p + out_p.token_ids + user
    clean(cached)


def test_prefix_prompts_and_fully_cached_prompts(folder):
    rng = random.Random(3)
    cached, plain = engines(folder)
    long = words(rng, 33)
    prompts = [long, long[:17], long[:16], long[:32], long, long + [5]]
    got = [cached.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    expected = plain.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    # The second run of `long` finds it whole: its last token is still computed, so 32 of 33 come from the cache.
    assert got[4].num_cached_tokens == 32
    assert got[2].num_cached_tokens == 12, "16 tokens: at most 15 may match, in whole pages of 4"
    clean(cached)


def test_eviction_and_preemption_together(folder):
    rng = random.Random(4)
    system = words(rng, 24)
    prompts = [system + words(rng, rng.randint(5, 15)) for _ in range(10)] + [words(rng, 30) for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    _, plain = engines(folder)
    expected = plain.generate(prompts, params, use_tqdm=False)
    small, _ = engines(folder, num_pages=40)  # 14 sequences of up to 69 tokens need far more than 40 pages
    evictions = []
    evict = small.engine.cache.evict

    def counting_evict(n):
        freed = evict(n)
        evictions.append(freed)
        return freed

    small.engine.cache.evict = counting_evict
    got = small.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert small.engine.scheduler.num_preemptions > 0, "the pool never ran short"
    assert sum(evictions) > 0, "nothing was ever evicted"
    clean(small)


def test_shared_prefix_workload_computes_a_fraction_of_the_prefill(folder):
    """64 requests with a 1024-token shared system prompt and 64-token distinct suffixes."""
    rng = random.Random(5)
    system = words(rng, 1024)
    prompts = [system + words(rng, 64) for _ in range(64)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    kwargs = dict(dtype="float32", device="cpu", page_size=16, num_pages=8192, max_num_batched_tokens=8192)
    cached = LLM(folder, enable_prefix_caching=True, **kwargs)
    plain = LLM(folder, enable_prefix_caching=False, **kwargs)
    got = cached.generate(prompts, params, use_tqdm=False)
    expected = plain.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    with_cache = cached.engine.scheduler.num_computed_tokens
    without = plain.engine.scheduler.num_computed_tokens
    assert without == 64 * 1088
    assert with_cache <= 0.15 * without, f"computed {with_cache} of {without} prefill tokens"
    assert sum(o.num_cached_tokens for o in got) == 63 * 1024
    clean(cached)


def test_eviction_takes_the_least_recently_used_prefix(folder):
    """Through the engine: prompts A, B, C are cached in that order, then A is used again; a prompt D that needs
    more pages than are free evicts B (least recently used), not A (used last) nor C. Afterwards A still hits the
    cache and B does not.

    Mutation check (run once on the CPU, not committed): making RadixCache.evict take the most recently used leaf
    first (heap key -last_access) makes this test fail (A is evicted, B kept); so does evicting in insertion order
    (A first)."""
    rng = random.Random(6)
    a, b, c = (words(rng, 16) for _ in range(3))  # 4 pages of 4 tokens each, all cached when the request ends
    d = words(rng, 24)  # 6 pages
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm = LLM(folder, dtype="float32", device="cpu", page_size=4, num_pages=16)
    cache = llm.engine.cache
    for prompt in (a, b, c):
        assert llm.generate([prompt], one, use_tqdm=False)[0].num_cached_tokens == 0
    assert cache.num_pages == 12 and llm.engine.kv.allocator.num_free() == 4
    assert llm.generate([a], one, use_tqdm=False)[0].num_cached_tokens == 12  # A is now the most recently used
    evictions = []
    evict = cache.evict
    cache.evict = lambda n: evictions.append(evict(n)) or evictions[-1]
    assert llm.generate([d], one, use_tqdm=False)[0].num_cached_tokens == 0
    assert evictions == [4], f"D needed 2 more pages than were free; one 4-page leaf should go, freed {evictions}"
    assert llm.generate([a], one, use_tqdm=False)[0].num_cached_tokens == 12, "A (used last) was evicted"
    assert llm.generate([c], one, use_tqdm=False)[0].num_cached_tokens == 12, "C was evicted before B"
    assert llm.generate([b], one, use_tqdm=False)[0].num_cached_tokens == 0, "B (least recently used) was kept"
    clean(llm)


def test_a_hit_makes_a_prefix_the_most_recently_used():
    """Contract of RadixCache alone: a match_prefix hit refreshes the matched path's last use, so of two cached
    prefixes, the one inserted first but hit since is evicted after the other. (Through the engine a finished
    request re-inserts its prefix, which refreshes it too; this holds the order without that.)

    Mutation check (run once, not committed): removing the refresh in match_prefix's loop (node.last_access = now)
    fails this test (A, the older insert, is evicted)."""
    allocator = PageAllocator(8)
    cache = RadixCache(allocator, 2)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]  # two pages each
    for tokens in (a, b):
        pages = allocator.alloc(2)
        cache.insert(tokens, pages)
        allocator.decref(pages)  # the tree's reference is now the only one
    hit, _ = cache.match_prefix(a + [9])
    assert len(hit) == 2 and allocator.num_free() == 4
    assert cache.evict(2) == 2 and allocator.num_free() == 6
    assert cache.match_prefix(b + [9])[0] == [], "B (least recently used) was kept"
    assert cache.match_prefix(a + [9])[0] == hit, "A (hit last) was evicted"


# ---- property-based: the scheduler, the cache and the allocator without a model ------------------------------


class _Driver:
    """Drives a Scheduler like the engine does, with made-up tokens instead of a model."""

    def __init__(self, num_pages: int, page_size: int, budget: int):
        self.allocator = PageAllocator(num_pages)
        self.cache = RadixCache(self.allocator, page_size)
        self.scheduler = Scheduler(self.allocator, page_size, 6, budget, 64, [0], self.cache)
        self.next_rid = 0
        self.rng = random.Random(0)

    def check(self) -> None:
        check_kv_invariants(self.allocator, self.cache, self.scheduler.running, self.scheduler.waiting)

    def admit(self, base: int, extra: int, max_tokens: int) -> None:
        prompt = [7, 8, 9, 10, 11, 12, 13, 14, 15][: base + 1] + [self.rng.randrange(1, 5) for _ in range(extra)]
        params = SP(temperature=0.0, max_tokens=max_tokens, ignore_eos=True).with_defaults(_NO_DEFAULTS)
        request = Request(rid=self.next_rid, prompt_ids=prompt, params=params, arrival=self.next_rid)
        self.next_rid += 1
        try:
            self.scheduler.add(request)
        except ValueError:
            pass  # too long for the little pool: rejected, holds nothing

    def step(self) -> None:
        batch = self.scheduler.schedule()
        sampled = [self.rng.randrange(1, 5) for c in batch.chunks if c.samples]
        self.scheduler.update(batch, sampled)

    def abort(self, pick: int) -> None:
        everyone = list(self.scheduler.running) + list(self.scheduler.waiting)
        if everyone:
            self.scheduler.abort(everyone[pick % len(everyone)].rid)

    def evict(self, pages: int) -> None:
        self.cache.evict(pages)

    def preempt(self, pick: int) -> None:
        if self.scheduler.running:
            self.scheduler._preempt(self.scheduler.running[pick % len(self.scheduler.running)])


from fastqwen.config import GenerationDefaults  # noqa: E402

_NO_DEFAULTS = GenerationDefaults()

_operation = st.one_of(
    st.tuples(st.just("admit"), st.integers(0, 8), st.integers(0, 12), st.integers(1, 10)),
    st.tuples(st.just("step")),
    st.tuples(st.just("step")),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("evict"), st.integers(1, 10)),
    st.tuples(st.just("preempt"), st.integers(0, 50)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_pages=st.integers(4, 24),
    page_size=st.sampled_from([1, 2, 4]),
    budget=st.integers(1, 20),
    operations=st.lists(_operation, min_size=1, max_size=60),
)
def test_invariant_holds_under_random_interleavings(num_pages, page_size, budget, operations):
    driver = _Driver(num_pages, page_size, budget)
    for op in operations:
        getattr(driver, op[0])(*op[1:])
        driver.check()
    # Run everything to completion; then, once the cache lets go, every page is free.
    for _ in range(2000):
        if not driver.scheduler.has_work():
            break
        driver.step()
        driver.check()
    assert not driver.scheduler.has_work()
    driver.cache.reset()
    driver.check()
    assert driver.allocator.num_free() == num_pages
