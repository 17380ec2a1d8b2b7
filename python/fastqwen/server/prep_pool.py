"""Where requests are prepared: the CPU work that grows with a request's size (parsing a big JSON body, rendering a
chat template, tokenizing, checking token ids, building a big response) runs here, off the event loop, in a small
pool of its own.

Not the default executor: asyncio.to_thread shares it with everything else, and eight 4.8 MB prompts tokenizing
there made an unrelated two-token request wait 18.6 s (issue 40). Here:
- work of a small request runs inline on the event loop (cheaper than a thread hop, and it never queues behind big
  work); the caller says what is small;
- the rest waits in a queue ordered by size, smallest first, so a medium request waits at most for the work already
  running, not for every big one queued before it;
- the queue holds at most MAX_QUEUED_BYTES of work: past it a request gets 503 with Retry-After at once (PrepPoolFull)
  instead of a wait that grows with every big body sent. (One item of any size is taken when the queue is empty.)
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from .async_engine import QueueFullError

T = TypeVar("T")

WORKERS = 2
# A request whose body is under this is prepared inline (tokenizing 4 KB takes about 4 ms, rendering a chat template
# of that size less).
SMALL_REQUEST_BYTES = 4096
# About 16 s of tokenizing at 1 MB/s a worker (Qwen3's tokenizer on one core): more waiting than that is refused.
MAX_QUEUED_BYTES = 32 * 2**20


class PrepPoolFull(QueueFullError):
    """Too much preparation work is queued: retry later (HTTP 503 with Retry-After)."""


class PrepPool:
    def __init__(self, workers: int = WORKERS, max_queued_bytes: int = MAX_QUEUED_BYTES):
        self._workers = workers
        self._max_queued_bytes = max_queued_bytes
        self._queue: list[tuple[int, int, Future, Callable]] = []  # a heap by (size, arrival)
        self._queued_bytes = 0
        self._arrivals = itertools.count()
        self._ready = threading.Condition()
        self._threads: list[threading.Thread] = []

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    async def run(self, fn: Callable[[], T], size: int, inline_below: int, may_refuse: bool = True) -> T:
        """fn() inline when size < inline_below, else in the pool. A caller that goes away (a cancelled handler)
        drops its work if it has not started. may_refuse=False: queued whatever is waiting (a response whose
        request has run already)."""
        if size < inline_below:
            return fn()
        return await asyncio.wrap_future(self.submit(fn, size, may_refuse))

    def submit(self, fn: Callable[[], T], size: int, may_refuse: bool = True) -> Future:
        future: Future = Future()
        with self._ready:
            if may_refuse and self._queue and self._queued_bytes + size > self._max_queued_bytes:
                raise PrepPoolFull(
                    f"the server is busy preparing other large requests ({self._queued_bytes} bytes queued): retry "
                    "shortly"
                )
            if len(self._threads) < self._workers:  # started on first use: an app that serves nothing starts none
                thread = threading.Thread(target=self._work, name=f"fastqwen-prep-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
            heapq.heappush(self._queue, (size, next(self._arrivals), future, fn))
            self._queued_bytes += size
            self._ready.notify()
        return future

    def _work(self) -> None:
        while True:
            with self._ready:
                while not self._queue:
                    self._ready.wait()
                size, _, future, fn = heapq.heappop(self._queue)
                self._queued_bytes -= size
            if not future.set_running_or_notify_cancel():
                continue  # its caller went away before it started
            result = None
            try:
                result = fn()
            except BaseException as e:  # the caller's to handle
                future.set_exception(e)
            else:
                future.set_result(result)
            fn = future = result = None  # a big result is not held here while waiting for the next item
