"""The engine loop in its own thread, and an asyncio face for it.

The engine is touched only by its thread. The event loop hands it commands (add, abort) through a thread-safe
queue; after every step the thread hands the event loop all of that step's updates in one call, and each update goes
to its request's asyncio queue. A request whose consumer goes away (a client that disconnects, a cancelled handler)
is aborted in the generator's finally block, so its pages are released at the engine's next iteration.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator

from ..engine import LLMEngine, RequestUpdate
from ..scheduler import Request

logger = logging.getLogger("fastqwen.server")


class QueueFullError(Exception):
    """The waiting queue is at its limit: the client should retry later (HTTP 503)."""


class EngineDeadError(Exception):
    """The engine loop stopped on an error; nothing more can be served (HTTP 503)."""


@dataclass
class TimedUpdate:
    update: RequestUpdate
    time: float  # time.monotonic() when the step that produced it ended


async def take_waiting(queue: asyncio.Queue) -> list:
    """The next item of the queue and every item already waiting behind it."""
    items = [await queue.get()]
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_queued_requests: int | None = None, metrics=None):
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.metrics = metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._queues: dict[int, asyncio.Queue] = {}
        # Submitted minus taken = requests on their way to the engine; each counter is written by one thread only.
        self._submitted = 0
        self._taken = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None
        self.kv_usage = 0.0  # written by the engine thread (the prefix cache is only safe to walk there)

    # ---- lifecycle (event loop side) ----------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="fastqwen-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ---- counts (read from the event loop; each read is one atomic len()) ----------------------------------

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + self._submitted - self._taken

    # ---- requests -----------------------------------------------------------------------------------------

    def enqueue(self, requests: list[Request]) -> None:
        """Admit requests made by engine.new_request, or none of them: raises QueueFullError or EngineDeadError.

        Synchronous, so the capacity check and the admission happen with no other handler in between.
        """
        if self.error is not None or not self.alive:
            raise EngineDeadError("the engine loop is not running")
        if self.max_queued_requests is not None and self.num_waiting + len(requests) > self.max_queued_requests:
            raise QueueFullError(f"the waiting queue is full ({self.max_queued_requests} requests)")
        for request in requests:
            self._queues[request.rid] = asyncio.Queue()
            self._submitted += 1
            self._commands.put(("add", request))
        self._wake.set()

    async def updates(self, request: Request) -> AsyncIterator[list[TimedUpdate]]:
        """The updates of an enqueued request until it finishes, in batches: every update already waiting comes
        together, so a stream that fell behind catches up in one write. Leaving early aborts the request."""
        out = self._queues[request.rid]
        finished = False
        try:
            while not finished:
                batch = await take_waiting(out)
                for item in batch:
                    if isinstance(item, BaseException):
                        raise item
                    finished = finished or item.update.finished
                yield batch
        finally:
            if not finished:
                self.abort(request)
            self._queues.pop(request.rid, None)

    def abort(self, request: Request) -> None:
        """Stop a request that has not finished; its pages are released at the engine's next iteration."""
        if not request.finished:
            self._commands.put(("abort", request.rid))
            self._wake.set()

    # ---- the engine thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        busy = False
        try:
            while not self._stopping:
                self._drain_commands()
                if not engine.has_unfinished():
                    # Idle. Check that no page leaked once nothing arrived for a whole wait: the check walks every
                    # page (milliseconds, holding the GIL), so running it the moment the last request finishes would
                    # delay that request's final update and the next request's first step.
                    woken = self._wake.wait(0.05)
                    self._wake.clear()
                    if busy and not woken and not self._commands.qsize():
                        busy = False
                        self._check_invariants()
                        self.kv_usage = engine.kv_usage()
                    continue
                busy = True
                updates = engine.step()
                self.kv_usage = engine.kv_usage()
                if updates:
                    now = time.monotonic()
                    self._loop.call_soon_threadsafe(self._dispatch, updates, now)
        except BaseException as e:  # the loop must never die silently: /health reports it, requests get the error
            logger.exception("the engine loop died")
            self.error = e
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._fail_all, e)

    def _check_invariants(self) -> None:
        try:
            self.engine.check_invariants()
        except AssertionError:
            logger.critical("KV page ownership invariant FAILED while idle: pages leaked or double-owned", exc_info=True)

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._taken += 1
                self.engine.add(arg)
            elif kind == "abort" and self.engine.abort(arg):
                if self.metrics is not None:
                    self.metrics.on_abort()

    def _dispatch(self, updates: list[RequestUpdate], now: float) -> None:
        for update in updates:
            target = self._queues.get(update.request_id)
            if target is not None:
                target.put_nowait(TimedUpdate(update, now))

    def _fail_all(self, error: BaseException) -> None:
        for target in self._queues.values():
            target.put_nowait(EngineDeadError(f"the engine loop died: {error!r}"))
