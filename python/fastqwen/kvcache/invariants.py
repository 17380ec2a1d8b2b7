"""The KV ownership invariant: every page is free, or referenced exactly once by each request that maps it and
once by the prefix cache if it holds it. So free + used by requests + held only by the cache == total."""

from __future__ import annotations

from collections import Counter


class InvariantError(AssertionError):
    pass


def check_kv_invariants(allocator, cache, running, waiting) -> None:
    """Raise InvariantError describing the first violation found."""
    try:
        allocator.check()
    except RuntimeError as e:
        raise InvariantError(f"allocator: {e}") from e
    expected: Counter[int] = Counter()
    by_requests: set[int] = set()
    for request in running:
        if len(set(request.pages)) != len(request.pages):
            raise InvariantError(f"request {request.rid} maps a page twice")
        expected.update(request.pages)
        by_requests.update(request.pages)
    for request in waiting:
        if request.pages or request.cache_node is not None:
            raise InvariantError(f"waiting request {request.rid} holds pages or a cache lock")
    in_cache = cache.pages() if cache is not None else []
    if len(set(in_cache)) != len(in_cache):
        raise InvariantError("the prefix cache holds a page twice")
    expected.update(in_cache)
    total = allocator.num_total()
    for page in range(total):
        if allocator.refcount(page) != expected[page]:
            raise InvariantError(
                f"page {page} has refcount {allocator.refcount(page)} but {expected[page]} owners "
                f"({'in' if page in set(in_cache) else 'not in'} the cache)"
            )
    cache_only = len(set(in_cache) - by_requests)
    if allocator.num_free() + len(by_requests) + cache_only != total:
        raise InvariantError(
            f"free {allocator.num_free()} + used by requests {len(by_requests)} + cache only {cache_only} != {total}"
        )
