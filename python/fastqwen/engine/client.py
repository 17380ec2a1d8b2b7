"""The engine as its frontend sees it: EngineRequests and aborts go in, StepOutputs come out through a callback,
and stats can be read at any time. EngineClient is that interface, with three implementations: InProcessEngineClient
(here) runs the engine loop in a thread of this process (`--engine-core thread`); ProcessEngineClient
(engine/core_process.py, the server's default) runs it in a process of its own, across two ZeroMQ sockets; and
DataParallelEngineClient (engine/data_parallel.py, `--data-parallel-size N`) routes over N ProcessEngineClients.

`on_output` gets each step's StepOutput on a thread of the client's (here the engine thread); it must be quick: hand
the output over, do not process it there. If the loop dies, `on_death` is called once with the error and `alive`
turns False. Importing this module loads no engine (the server imports it for EngineClient): the engine is passed in.

Here the engine is touched only by its thread. Commands (add, abort) reach it through a thread-safe queue and are
taken between steps.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from ..errors import InvalidRequestError
from .messages import EngineInfo, EngineRequest, EngineStats, RequestDelta, StepOutput

if TYPE_CHECKING:  # the server imports this module for EngineClient: it must not load the engine core and torch
    from .llm_engine import LLMEngine

logger = logging.getLogger("fastqwen.engine")

OutputCallback = Callable[[StepOutput], None]
DeathCallback = Callable[[BaseException], None]


class EngineClient(Protocol):
    info: EngineInfo

    def start(self, on_output: OutputCallback, on_death: DeathCallback) -> None: ...

    def add(self, requests: list[EngineRequest]) -> None: ...

    def abort(self, rid: int) -> None: ...

    def stats(self) -> EngineStats: ...

    def per_engine(self) -> list[tuple[EngineInfo, EngineStats]]:
        """Each engine's info and latest stats: one entry, or one per data-parallel replica in replica order
        (engine/data_parallel.py), for metrics labelled by engine."""
        ...

    @property
    def alive(self) -> bool: ...

    def stop(self, timeout: float = 10.0) -> None: ...


class InProcessEngineClient:
    def __init__(self, engine: LLMEngine):
        self._engine = engine
        self.info = engine.info
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stats = engine.stats()  # written by the engine thread only; read anywhere (one reference swap)
        # Added minus taken = requests on their way to the engine; each counter is written by one thread only.
        self._num_added = 0
        self._num_taken = 0
        self._on_output: OutputCallback | None = None
        self._on_death: DeathCallback | None = None
        self.error: BaseException | None = None

    # ---- the frontend's side ------------------------------------------------------------------------------

    def start(self, on_output: OutputCallback, on_death: DeathCallback) -> None:
        self._on_output, self._on_death = on_output, on_death
        self._thread = threading.Thread(target=self._run, name="fastqwen-engine", daemon=True)
        self._thread.start()

    def add(self, requests: list[EngineRequest]) -> None:
        for request in requests:
            self._num_added += 1
            self._commands.put(("add", request))
        self._wake.set()

    def abort(self, rid: int) -> None:
        self._commands.put(("abort", rid))
        self._wake.set()

    def stats(self) -> EngineStats:
        stats = self._stats
        return replace(stats, num_waiting=stats.num_waiting + max(0, self._num_added - self._num_taken))

    def per_engine(self) -> list[tuple[EngineInfo, EngineStats]]:
        return [(self.info, self.stats())]

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._engine.close()

    # ---- the engine thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self._engine
        busy = False
        try:
            while not self._stopping:
                rejected = self._take_commands()
                if rejected:
                    self._on_output(StepOutput(rejected, time.monotonic()))
                if not engine.has_unfinished():
                    engine.check_alive()
                    # Idle. Check that no page leaked once nothing arrived for a whole wait: the check walks every
                    # page (milliseconds, holding the GIL), so running it the moment the last request finishes would
                    # delay that request's final output and the next request's first step.
                    woken = self._wake.wait(0.05)
                    self._wake.clear()
                    if busy and not woken and not self._commands.qsize():
                        busy = False
                        self._check_invariants()
                        self._stats = engine.stats()
                    continue
                busy = True
                output = engine.step()
                self._stats = engine.stats()
                if output.deltas:
                    self._on_output(output)
        except BaseException as e:  # the loop must never die silently: the frontend fails every request with it
            logger.exception("the engine loop died")
            self.error = e
            if self._on_death is not None:
                self._on_death(e)

    def _check_invariants(self) -> None:
        """A violation takes the engine out of service: the error ends the loop (so /health answers 503 and every
        request fails) instead of serving on a pool where a page may be shared by two requests or lost."""
        from ..kvcache.invariants import InvariantError  # (here: the engine, hence kvcache, is loaded by now)

        try:
            self._engine.check_invariants()
        except InvariantError as e:
            logger.error(
                "KV page ownership invariant violated while idle, pages %s: %s; taking the engine out of service",
                e.pages,
                e,
            )
            raise

    def _take_commands(self) -> list[RequestDelta]:
        """Apply every queued command; a request the engine refuses comes back as an error delta."""
        rejected = []
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return rejected
            if kind == "add":
                self._num_taken += 1
                try:
                    self._engine.add(arg)
                except InvalidRequestError as e:
                    rejected.append(RequestDelta(arg.rid, [], None, finish_reason="error", error=str(e)))
            elif kind == "abort":
                self._engine.abort(arg)
