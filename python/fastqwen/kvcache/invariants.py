"""The KV ownership invariant: every page is free, or referenced exactly once by each request that maps it and
once by the prefix cache if it holds it. So free + used by requests + held only by the cache == total."""

from __future__ import annotations

import re
from collections import Counter


class InvariantError(AssertionError):
    """pages: the pages found in violation (those named in the message), for the log of whoever takes the pool out
    of service."""

    def __init__(self, message: str, pages: list[int] | None = None):
        super().__init__(message)
        self.pages = pages or []


def check_kv_invariants(allocator, cache, running, waiting) -> None:
    """Raise InvariantError describing the first violation found."""
    try:
        allocator.check()
    except RuntimeError as e:
        raise InvariantError(f"allocator: {e}", [int(t) for t in re.findall(r"page (\d+)", str(e))]) from e
    owners: list[int] = []  # every page once per reference its owners hold
    by_requests: set[int] = set()
    for request in running:
        if len(set(request.pages)) != len(request.pages):
            twice = sorted(p for p, n in Counter(request.pages).items() if n > 1)
            raise InvariantError(f"request {request.rid} maps pages {twice} twice", twice)
        owners += request.pages
        by_requests.update(request.pages)
    for request in waiting:
        if request.pages or request.cache_node is not None:
            raise InvariantError(
                f"waiting request {request.rid} holds pages {request.pages} or a cache lock", request.pages
            )
    in_cache = cache.pages() if cache is not None else []
    if len(set(in_cache)) != len(in_cache):
        twice = sorted(p for p, n in Counter(in_cache).items() if n > 1)
        raise InvariantError(f"the prefix cache holds pages {twice} twice", twice)
    owners += in_cache
    total = allocator.num_total()
    cached = set(in_cache)
    wrong = allocator.refcount_mismatches(owners)
    if wrong:
        expected = Counter(owners)
        shown = ", ".join(
            f"page {page} has refcount {allocator.refcount(page)} but {expected[page]} owners "
            f"({'in' if page in cached else 'not in'} the cache)"
            for page in wrong[:16]
        )
        more = f" and {len(wrong) - 16} more" if len(wrong) > 16 else ""
        raise InvariantError(f"{len(wrong)} pages with the wrong reference count: {shown}{more}", wrong)
    cache_only = len(set(in_cache) - by_requests)
    if allocator.num_free() + len(by_requests) + cache_only != total:
        raise InvariantError(
            f"free {allocator.num_free()} + used by requests {len(by_requests)} + cache only {cache_only} != {total}"
        )
