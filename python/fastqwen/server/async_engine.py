"""An asyncio face for the engine: the event loop's side of EngineClient, with the frontend's text processing.

The engine runs behind an EngineClient: by default a process of its own (engine/core_process.py), or a thread of
this process (`--engine-core thread`, engine/client.py). After every step the client hands over the step's StepOutput
on a thread of its own (the core's socket reader, or the engine thread); there its deltas become text updates
(RequestTracker: detokenizing, stop strings) and go to each request's asyncio queue in one call onto the event loop.
A stop string finishes a request here and aborts it in the engine. A request whose consumer goes away (a client that disconnects, a cancelled
handler) is aborted in the generator's finally block, so its pages are released at the engine's next iteration.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from ..engine.client import EngineClient
from ..engine.messages import StepOutput
from ..errors import InvalidRequestError
from ..frontend import Frontend, RequestTracker, RequestUpdate
from ..sampling_params import SamplingParams

logger = logging.getLogger("fastqwen.server")


class ServingError(Exception):
    """A request that cannot be served for a reason on the server's side; `status` is its HTTP status."""

    status = 500


class QueueFullError(ServingError):
    """The waiting queue is at its limit: the client should retry later (HTTP 503)."""

    status = 503


class EngineDeadError(ServingError):
    """The engine loop stopped on an error; nothing more can be served (HTTP 503)."""

    status = 503


class ShuttingDownError(ServingError):
    """The server is shutting down and this request did not finish within the shutdown timeout (HTTP 503)."""

    status = 503


class RequestFailedError(ServingError):
    """The engine could not run this request (its other requests go on)."""


@dataclass
class TimedUpdate:
    update: RequestUpdate
    time: float  # time.monotonic() when the step that produced it ended


class Mailbox:
    """A queue for one consumer on the event loop that takes everything waiting at once: what asyncio.Queue would do
    with a get() and get_nowait() per item, for a list swap. An update of every stream passes through one at every
    step, so its cost per item counts (bench/frontend_rate.py)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self):
        self._items: list = []
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take_all(self) -> list:
        """The next item and every item already waiting behind it, in order."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items


class AsyncEngine:
    def __init__(
        self,
        client: EngineClient,
        frontend: Frontend,
        max_queued_requests: int | None = None,
        metrics=None,
        on_death: Callable[[BaseException], None] | None = None,
    ):
        """on_death: called on the event loop once the engine loop has died and every request was failed."""
        self.on_death = on_death
        self.client = client
        self.frontend = frontend
        self.max_queued_requests = max_queued_requests
        self.metrics = metrics
        self._queues: dict[int, Mailbox] = {}
        self._trackers: dict[
            int, RequestTracker
        ] = {}  # requests not finished yet; trackers are applied on the client's thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None

    # ---- lifecycle (event loop side) ----------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.client.start(self._on_output, self._on_death)

    def stop(self, timeout: float = 10.0) -> None:
        self.client.stop(timeout)

    @property
    def alive(self) -> bool:
        return self.client.alive and self.error is None

    @property
    def in_flight(self) -> int:
        """Sequences enqueued whose consumers have not finished reading them."""
        return len(self._queues)

    # ---- requests -----------------------------------------------------------------------------------------

    def new_request(self, prompt: str | list[int], params: SamplingParams | None = None) -> RequestTracker:
        """Validate and build a request without queueing it. Raises InvalidRequestError."""
        return self.frontend.new_request(prompt, params)

    def enqueue(self, requests: list[RequestTracker]) -> None:
        """Admit requests made by new_request, or none of them: raises QueueFullError or EngineDeadError.

        Synchronous, so the capacity check and the admission happen with no other handler in between.
        """
        if not self.alive:
            raise EngineDeadError("the engine loop is not running")
        if self.max_queued_requests is not None:
            if len(requests) > self.max_queued_requests:  # would wait forever for room: a client error, not a 503
                raise InvalidRequestError(
                    f"this request makes {len(requests)} sequences (prompts x n) but the server queues at most "
                    f"{self.max_queued_requests}",
                    "n",
                )
            if self.client.stats().num_waiting + len(requests) > self.max_queued_requests:
                raise QueueFullError(f"the waiting queue is full ({self.max_queued_requests} requests)")
        for tracker in requests:
            self._queues[tracker.rid] = Mailbox()
            self._trackers[tracker.rid] = tracker
        self.client.add([t.request for t in requests])

    async def updates(self, request: RequestTracker) -> AsyncIterator[list[TimedUpdate]]:
        """The updates of an enqueued request until it finishes, in batches: every update already waiting comes
        together, so a stream that fell behind catches up in one write. Leaving early aborts the request."""
        out = self._queues[request.rid]
        finished = False
        try:
            while not finished:
                batch = await out.take_all()
                for item in batch:
                    if isinstance(item, BaseException):
                        raise item
                    finished = finished or item.update.finished
                    output = item.update.output
                    if output is not None and output.finish_reason == "error":
                        raise RequestFailedError(output.error or "the engine could not run this request")
                yield batch
        finally:
            if not finished:
                self.abort(request)
            self._queues.pop(request.rid, None)

    def abort(self, request: RequestTracker) -> None:
        """Stop a request that has not finished; its pages are released at the engine's next iteration."""
        if self._trackers.pop(request.rid, None) is not None:
            self.client.abort(request.rid)
            if self.metrics is not None:
                self.metrics.on_abort()

    # ---- called on the client's thread (the core's socket reader, or the engine thread) ---------------------

    def _on_output(self, output: StepOutput) -> None:
        if self.metrics is not None:
            self.metrics.on_step(output.num_tokens)
        updates = []
        for delta in output.deltas:
            tracker = self._trackers.get(delta.rid)
            if tracker is None:  # aborted here meanwhile
                continue
            update = tracker.apply(delta)
            if update is None:
                continue
            if update.finished:
                self._trackers.pop(delta.rid, None)
                if not delta.finished:  # a stop string: the engine still runs it
                    self.client.abort(delta.rid)
            updates.append(update)
        if updates and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._dispatch, updates, output.time)

    def _on_death(self, error: BaseException) -> None:
        self.error = error
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._fail_all, error)

    # ---- back on the event loop ---------------------------------------------------------------------------

    def _dispatch(self, updates: list[RequestUpdate], now: float) -> None:
        for update in updates:
            target = self._queues.get(update.request_id)
            if target is not None:
                target.put_nowait(TimedUpdate(update, now))

    def _fail_all(self, error: BaseException) -> None:
        self.fail_all(lambda: EngineDeadError(f"the engine loop died: {error!r}"))
        if self.on_death is not None:
            self.on_death(error)

    def fail_all(self, make_error: Callable[[], ServingError]) -> None:
        """End every request in flight with an error of its own (their consumers abort them in the engine)."""
        for target in self._queues.values():
            target.put_nowait(make_error())
