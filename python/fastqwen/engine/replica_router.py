"""Which data-parallel replica takes a request (engine/data_parallel.py): the least busy one, unless a replica that
holds the request's prefix in its cache is not much busier than that (prefix affinity: the prefix is then not
computed again, and the replicas' caches do not all fill with the same prefixes).

Busy means waiting plus running requests, as each replica's client reports them (requests on their way to it count
as waiting, so a burst routed in one call is spread as it is routed).

The front end cannot see the replicas' radix caches, so it keeps an estimate of them: per replica, a least recently
used set of the page-aligned prefixes of the prompts it sent there, each kept as a hash chained over the prompt's
whole pages (page k's hash covers every token up to the end of page k, so equal hashes mean equal prefixes, and only
whole pages are shared in the radix tree too). A replica's set holds at most as many pages as its KV pool, the most
its cache can hold. The estimate can be wrong either way: the engine may have evicted a prefix sooner, and it caches
generated tokens that the front end does not record; a wrong guess costs a prefill, never a wrong answer. With
several front ends each has a router, and each also records the prompts the others routed, as the cores relay them
(`remember`; engine/data_parallel.py).

The rule, `route`: the candidates are the replicas whose set holds the longest prefix of the request (at least one
page); the least busy candidate takes the request unless it is *much busier* than the least busy replica, that is
busier by more than MUCH_BUSIER_BY_REQUESTS requests and by more than MUCH_BUSIER_BY_FRACTION of that replica's
load. Otherwise, and when no replica holds a page of the prompt, the least busy replica takes it. Ties go round
robin, so an idle server alternates. (The thresholds are a judgment, not a measurement: a queue of 16 requests more
costs a newcomer more than the prefill of most prefixes saves.)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

MUCH_BUSIER_BY_REQUESTS = 16
MUCH_BUSIER_BY_FRACTION = 0.5


def much_busier(load: int, least: int) -> bool:
    """Is a replica with `load` requests much busier than one with `least`?"""
    return load - least > max(MUCH_BUSIER_BY_REQUESTS, MUCH_BUSIER_BY_FRACTION * least)


def page_hashes(prompt_ids: Sequence[int], page_size: int) -> list[int]:
    """One hash per whole page of the prompt, each chained over every page before it."""
    hashes, chained = [], 0
    for end in range(page_size, len(prompt_ids) + 1, page_size):
        chained = hash((chained, tuple(prompt_ids[end - page_size : end])))
        hashes.append(chained)
    return hashes


class ReplicaRouter:
    """Called on one thread (the server's event loop), so it takes no lock."""

    def __init__(self, capacity_pages: Sequence[int], page_size: int, prefix_caching: bool = True):
        """capacity_pages: each replica's KV pool size in pages (the bound of its estimate)."""
        self.page_size = page_size
        self.prefix_caching = prefix_caching  # off: no replica caches anything, so only load counts
        self._capacity = list(capacity_pages)
        self._cached: list[OrderedDict[int, None]] = [OrderedDict() for _ in self._capacity]
        self._next = 0  # where the round robin among equally busy replicas starts

    @property
    def num_replicas(self) -> int:
        return len(self._capacity)

    def route(self, prompt_ids: Sequence[int], loads: Sequence[int]) -> int:
        """The replica for a request with this prompt, given each replica's load; recorded as caching its prefix."""
        return self.route_pages(self.hashes(prompt_ids), loads)

    def hashes(self, prompt_ids: Sequence[int]) -> list[int]:
        """The prompt's page hashes, as the estimate keeps them (none when no replica caches prefixes)."""
        return page_hashes(prompt_ids, self.page_size) if self.prefix_caching else []

    def route_pages(self, hashes: list[int], loads: Sequence[int]) -> int:
        """`route`, for a prompt given as its page hashes."""
        held = [self.cached_pages(r, hashes) for r in range(self.num_replicas)]
        longest, least = max(held), min(loads)
        choice = None
        if longest > 0:
            holder = self._least_busy([r for r in range(self.num_replicas) if held[r] == longest], loads)
            if not much_busier(loads[holder], least):
                choice = holder
        if choice is None:
            choice = self._least_busy(range(self.num_replicas), loads)
        self._next = (choice + 1) % self.num_replicas
        self.remember(choice, hashes)
        return choice

    def cached_pages(self, replica: int, hashes: list[int]) -> int:
        """How many leading pages of a prompt (given as its page hashes) the replica is thought to hold."""
        cached = self._cached[replica]
        count = 0
        for h in hashes:
            if h not in cached:
                break
            count += 1
        return count

    def _least_busy(self, candidates, loads: Sequence[int]) -> int:
        n = self.num_replicas
        return min(candidates, key=lambda r: (loads[r], (r - self._next) % n))

    def remember(self, replica: int, hashes: list[int]) -> None:
        """Record a prompt's page hashes as cached by the replica, the most recently used (and keep the bound)."""
        cached = self._cached[replica]
        for h in reversed(hashes):  # deepest first, so that it is evicted first: a leaf, as in the radix tree
            cached[h] = None
            cached.move_to_end(h)
        while len(cached) > self._capacity[replica]:
            cached.popitem(last=False)  # the least recently routed page
