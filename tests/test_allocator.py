"""CPU tests of the C++ page allocator (fastqwen._C.PageAllocator)."""

import random

import pytest
from fastqwen import _C

PageAllocator = _C.PageAllocator


def snapshot(a):
    n = a.num_total()
    return (a.num_free(), a.num_used(), tuple(a.refcount(p) for p in range(n)))


def test_construct():
    a = PageAllocator(8)
    assert a.num_total() == 8 and a.num_free() == 8 and a.num_used() == 0
    a.check()
    for bad in (0, -1):
        with pytest.raises(ValueError):
            PageAllocator(bad)
    assert "PageAllocator" in repr(a)


def test_alloc_all_or_nothing():
    a = PageAllocator(10)
    assert a.alloc(0) == []
    p = a.alloc(4)
    assert p == [0, 1, 2, 3]  # low ids first
    assert all(a.refcount(i) == 1 for i in p)
    assert a.num_free() == 6 and a.num_used() == 4
    before = snapshot(a)
    assert a.alloc(7) is None  # only 6 free: nothing changes
    assert snapshot(a) == before
    q = a.alloc(6)
    assert sorted(p + q) == list(range(10))
    assert a.alloc(1) is None
    assert a.alloc(0) == []
    a.check()


def test_free_and_reuse():
    a = PageAllocator(4)
    p = a.alloc(4)
    a.free([p[1], p[3]])
    assert a.num_free() == 2
    assert a.refcount(p[1]) == 0
    again = a.alloc(2)
    assert sorted(again) == sorted([p[1], p[3]])
    a.check()


def test_double_free_raises():
    a = PageAllocator(4)
    p = a.alloc(2)
    a.free([p[0]])
    before = snapshot(a)
    with pytest.raises(ValueError, match=f"double free of page {p[0]}"):
        a.free([p[1], p[0]])  # p[1] is valid, but the call must change nothing
    assert snapshot(a) == before
    with pytest.raises(ValueError, match="double free"):
        a.free([3])  # never allocated
    assert snapshot(a) == before
    a.check()


def test_free_duplicate_in_list_raises():
    a = PageAllocator(4)
    p = a.alloc(2)
    before = snapshot(a)
    with pytest.raises(ValueError, match="twice"):
        a.free([p[0], p[1], p[0]])
    assert snapshot(a) == before
    a.check()


def test_free_of_shared_page_raises():
    a = PageAllocator(4)
    p = a.alloc(2)
    a.incref([p[0]])
    before = snapshot(a)
    with pytest.raises(ValueError, match="decref"):
        a.free([p[1], p[0]])
    assert snapshot(a) == before
    assert a.decref([p[0]]) == []
    a.free([p[0], p[1]])
    assert a.num_free() == 4
    a.check()


def test_incref_decref():
    a = PageAllocator(6)
    p = a.alloc(3)
    a.incref([p[0], p[0], p[1]])  # duplicates count twice
    assert [a.refcount(i) for i in p] == [3, 2, 1]
    assert a.decref([p[2]]) == [p[2]]
    assert a.refcount(p[2]) == 0 and a.num_free() == 4
    assert a.decref([p[0], p[1]]) == []
    assert sorted(a.decref([p[0], p[1], p[0]])) == sorted([p[0], p[1]])
    assert a.num_free() == 6
    a.check()


def test_incref_free_page_raises():
    a = PageAllocator(4)
    p = a.alloc(1)
    before = snapshot(a)
    with pytest.raises(ValueError):
        a.incref([p[0], 2])
    assert snapshot(a) == before
    a.check()


def test_decref_double_free_raises():
    a = PageAllocator(4)
    p = a.alloc(2)
    a.incref([p[0]])  # refcount 2
    before = snapshot(a)
    with pytest.raises(ValueError, match="double free"):
        a.decref([p[0], p[0], p[0]])  # three decrefs of a refcount-2 page
    assert snapshot(a) == before
    with pytest.raises(ValueError, match="double free"):
        a.decref([p[1], 3])  # 3 is free
    assert snapshot(a) == before
    a.check()


def test_bad_arguments_do_not_change_state():
    a = PageAllocator(5)
    a.alloc(2)
    before = snapshot(a)
    with pytest.raises(ValueError):
        a.alloc(-1)
    for op in (a.free, a.incref, a.decref):
        for bad in ([5], [-1], [0, 100], [0, -7]):
            with pytest.raises(IndexError):
                op(bad)
            assert snapshot(a) == before
    for bad in (5, -1, 1 << 40):
        with pytest.raises(IndexError):
            a.refcount(bad)
    with pytest.raises(TypeError):
        a.free(["x"])
    assert snapshot(a) == before
    a.check()


def test_reset():
    a = PageAllocator(5)
    p = a.alloc(3)
    a.incref(p)
    a.reset()
    assert a.num_free() == 5 and a.num_used() == 0
    assert all(a.refcount(i) == 0 for i in range(5))
    assert a.alloc(5) == [0, 1, 2, 3, 4]
    a.check()


def test_large_allocator():
    n = 100_000
    a = PageAllocator(n)
    pages = a.alloc(n)
    assert len(set(pages)) == n
    assert a.alloc(1) is None
    a.free(pages)
    assert a.num_free() == n
    a.check()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_against_model(seed):
    rng = random.Random(seed)
    n = 64
    a = PageAllocator(n)
    model = [0] * n  # reference refcounts

    def expect_same():
        assert a.num_free() == model.count(0)
        assert a.num_used() == n - model.count(0)
        assert a.num_free() + a.num_used() == a.num_total() == n
        for p in range(n):
            assert a.refcount(p) == model[p]
        a.check()

    for _ in range(4000):
        op = rng.choice(["alloc", "alloc", "free", "incref", "decref", "bad"])
        referenced = [p for p in range(n) if model[p] > 0]
        free = [p for p in range(n) if model[p] == 0]
        if op == "alloc":
            k = rng.randint(0, 12)
            got = a.alloc(k)
            if k > len(free):
                assert got is None
            else:
                assert got is not None and len(got) == k and len(set(got)) == k
                for p in got:
                    assert model[p] == 0
                    model[p] = 1
        elif op == "free":
            sole = [p for p in referenced if model[p] == 1]
            pages = rng.sample(sole, rng.randint(0, len(sole)))
            if rng.random() < 0.3 and referenced:
                # maybe inject an illegal page: shared, free, or a duplicate
                pages = pages + [rng.choice(referenced + free + pages if pages else referenced + free)]
            legal = len(set(pages)) == len(pages) and all(model[p] == 1 for p in pages)
            if legal:
                a.free(pages)
                for p in pages:
                    model[p] = 0
            else:
                with pytest.raises(ValueError):
                    a.free(pages)
        elif op == "incref":
            pool = referenced + (free[:1] if rng.random() < 0.2 else [])
            pages = [rng.choice(pool) for _ in range(rng.randint(0, 5))] if pool else []
            if all(model[p] > 0 for p in pages):
                a.incref(pages)
                for p in pages:
                    model[p] += 1
            else:
                with pytest.raises(ValueError):
                    a.incref(pages)
        elif op == "decref":
            pool = referenced + (free[:1] if rng.random() < 0.2 else [])
            pages = [rng.choice(pool) for _ in range(rng.randint(0, 5))] if pool else []
            counts = {}
            for p in pages:
                counts[p] = counts.get(p, 0) + 1
            if all(model[p] >= c for p, c in counts.items()):
                freed = a.decref(pages)
                for p in pages:
                    model[p] -= 1
                assert sorted(freed) == sorted(p for p in counts if model[p] == 0)
            else:
                with pytest.raises(ValueError, match="double free"):
                    a.decref(pages)
        else:
            bad = rng.choice([n, n + 5, -1])
            with pytest.raises(IndexError):
                rng.choice([a.free, a.incref, a.decref])([bad])
            with pytest.raises(ValueError):
                a.alloc(-rng.randint(1, 3))
        expect_same()


@pytest.mark.parametrize("seed", [0, 1])
def test_refcount_mismatches_are_the_pages_whose_count_differs(seed):
    """refcount_mismatches(owners) against the per-page refcounts and a count of owners done here."""
    from collections import Counter

    rng = random.Random(seed)
    n = 300
    a = PageAllocator(n)
    for _ in range(400):  # some pages shared, some freed again
        op = rng.choice(["alloc", "incref", "decref"])
        used = [p for p in range(n) if a.refcount(p) > 0]
        if op == "alloc" or not used:
            a.alloc(rng.randrange(1, 4))
        elif op == "incref":
            a.incref([rng.choice(used)])
        else:
            a.decref([rng.choice(used)])
    owners = [p for p in range(n) for _ in range(a.refcount(p))]
    rng.shuffle(owners)
    assert a.refcount_mismatches(owners) == []
    for _ in range(20):
        broken = list(owners)
        for _ in range(rng.randrange(1, 4)):
            if broken and rng.random() < 0.5:
                broken.pop(rng.randrange(len(broken)))  # a reference nobody holds
            else:
                broken.append(rng.randrange(n))  # one more than the count
        held = Counter(broken)
        want = [p for p in range(n) if a.refcount(p) != held[p]]
        assert a.refcount_mismatches(broken) == want
    before = snapshot(a)
    for bad in (-1, n):
        with pytest.raises(IndexError):
            a.refcount_mismatches([0, bad])
    assert snapshot(a) == before


def test_kv_invariants_name_a_page_with_a_reference_nobody_holds():
    from types import SimpleNamespace

    from fastqwen.kvcache import InvariantError, RadixCache, check_kv_invariants

    a = PageAllocator(32)
    cache = RadixCache(a, 4)
    pages = a.alloc(3)
    request = SimpleNamespace(rid=1, pages=list(pages), cache_node=None)
    check_kv_invariants(a, cache, [request], [])
    a.incref([pages[1]])  # a reference held by no request and not by the cache
    with pytest.raises(InvariantError, match=f"page {pages[1]} has refcount 2 but 1 owners") as raised:
        check_kv_invariants(a, cache, [request], [])
    assert raised.value.pages == [pages[1]]
