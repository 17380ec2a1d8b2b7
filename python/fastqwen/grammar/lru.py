"""A least-recently-used map bounded by the bytes its values are estimated to hold, not by their count.

Grammar caches hold things whose sizes differ by thousands of times (a four-field schema's compile is tens of KB, a
600 KB regex's is tens of MB): a count bound is either useless for the small ones or unsafe for the big ones.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class ByteBudgetLRU(Generic[V]):
    """Thread-safe. `size_of(key, value)` estimates an entry's bytes when it is put (`resize` updates it later);
    least recently used entries are dropped until the total is within budget_bytes. An entry larger than the whole
    budget is not kept at all."""

    def __init__(self, budget_bytes: int, size_of: Callable[[Hashable, V], int]):
        self.budget_bytes = budget_bytes
        self._size_of = size_of
        self._entries: collections.OrderedDict[Hashable, tuple[V, int]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.total_bytes = 0

    def get(self, key: Hashable, default=None):
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return default
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: Hashable, value: V) -> None:
        size = self._size_of(key, value)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.total_bytes -= old[1]
            self._entries[key] = (value, size)
            self.total_bytes += size
            self._evict()

    def resize(self, key: Hashable) -> None:
        """Estimate the entry's size again (its value grew), and evict if that went over budget."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return
            size = self._size_of(key, entry[0])
            self._entries[key] = (entry[0], size)
            self.total_bytes += size - entry[1]
            self._evict()

    def _evict(self) -> None:
        while self.total_bytes > self.budget_bytes and self._entries:
            _, (_, size) = self._entries.popitem(last=False)
            self.total_bytes -= size

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._entries
