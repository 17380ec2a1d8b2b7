"""The engine core in a process of its own, behind the same EngineClient interface as the in-process thread.

Why: under load the server's event loop (HTTP, JSON, SSE, detokenizing) and the engine loop fought over one GIL. Here
the core process runs the scheduler, KV pool, prefix cache, model runner and sampler, stepping without pause while it
has work and never waiting for the frontend (idle, it waits on its socket); the server process keeps HTTP and text.

Two ZeroMQ PUSH/PULL sockets over IPC, one each way. Each message is two frames: a kind and a msgpack body decoded
into the dataclass of engine/messages.py that the kind names (msgspec, typed: nothing from a client is ever
unpickled). Frontend to core: "add" (a list of EngineRequests), "abort" (a list of ids), "stop". Core to frontend:
"info" (EngineInfo, once loaded), "step" (a StepOutput and the stats after it, one message per step for every
request), "stats" (while idle), "failed" (the core could not start: the error text).

If the core dies, the frontend's reader thread sees the process gone within a poll interval and reports it through
on_death: every request in flight gets an error and the server exits non-zero, so a supervisor restarts it. If the
server dies, however abnormally (a segfault, kill -9), the core ends too (engine/lifeline.py) and removes the IPC
folder the server can no longer remove.

With several front ends (`--api-server-count N`, serve.py and api_servers.py) the server's parent process starts the
core, and each front end (a process of its own) binds its own pair of sockets in the core's folder: the core's inbox
pulls from every front end's, and the core has one outbox per front end. Request ids are partitioned among the front
ends (messages.request_ids), so each step's deltas are split by id and each front end gets only its own; every front
end gets every step's message (its deltas, possibly none, and the core's stats: what its load routing and /metrics
read), the step's token count only front end 0 (so the summed histogram counts each step once). The core ends once
every front end has said "stop"; a front end that died cannot, and the parent ends the core then. With data
parallelism too, a front end sends its replica's core the page hashes of the prompts it routed there ("routed", a
RoutedPrompts), and the core relays them to every other front end in a "routed" message (the hash lists) before its
next message to that front end, once: each front end's router then estimates the replica's cache from every front
end's prompts (engine/data_parallel.py).

With tensor parallelism this process is rank 0 (engine/tensor_parallel.py): it starts the other ranks as its own
children and sends them each step's commands; the frontend still talks to rank 0 alone. If a rank dies, this process
ends (EngineFault), and so the server does too.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import select
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace

import msgspec
import zmq

from ..config import EngineConfig
from . import lifeline
from .messages import EngineInfo, EngineRequest, EngineStats, RequestDelta, RoutedPrompts, StepOutput, frontend_of

logger = logging.getLogger("fastqwen.engine")

_IDLE_POLL_MS = 50  # how long an idle core waits for a command before it checks invariants and reports stats
_READER_POLL_MS = 100  # how often the frontend's reader checks that the core is alive while nothing arrives
_STARTUP_TIMEOUT_S = 3600.0  # loading a large checkpoint from a slow disk takes minutes


@dataclass
class CoreStats:
    stats: EngineStats
    num_received: int  # requests the core has taken from "add" messages so far: the rest are on their way


@dataclass
class CoreStep:
    output: StepOutput
    stats: CoreStats


@dataclass
class _Codec:
    encoder: msgspec.msgpack.Encoder = field(default_factory=msgspec.msgpack.Encoder)
    decoders: dict = field(default_factory=dict)

    def encode(self, value) -> bytes:
        return self.encoder.encode(value)

    def decode(self, kind: bytes, body: bytes, types: dict):
        if kind not in self.decoders:
            self.decoders[kind] = msgspec.msgpack.Decoder(types[kind])
        return self.decoders[kind].decode(body)


# stop: which front end says it. routed: the page hashes of prompts a front end routed here, for the other front ends.
_TO_CORE = {b"add": list[EngineRequest], b"abort": list[int], b"stop": int, b"routed": RoutedPrompts}
_TO_FRONTEND = {b"info": EngineInfo, b"step": CoreStep, b"stats": CoreStats, b"failed": str, b"routed": list[list[int]]}


# ---- the core process ----------------------------------------------------------------------------------------


def _addresses(folder: str, frontend: int = 0) -> tuple[str, str]:
    """Front end `frontend`'s two sockets' addresses: to the core, to the frontend."""
    suffix = str(frontend) if frontend else ""
    return f"ipc://{folder}/to_core{suffix}", f"ipc://{folder}/to_frontend{suffix}"


class FrontendLinks:
    """The core's side of the sockets: one inbox pulling from every front end, one outbox per front end (a single one
    without --api-server-count). Counts each front end's added requests (its CoreStats.num_received) and its "stop"."""

    def __init__(self, context: zmq.Context, folder: str, num_frontends: int):
        self.num_frontends = num_frontends
        self.codec = _Codec()
        self.inbox = context.socket(zmq.PULL)
        self.outboxes = []
        for index in range(num_frontends):
            to_core, to_frontend = _addresses(folder, index)
            self.inbox.connect(to_core)
            outbox = context.socket(zmq.PUSH)
            outbox.connect(to_frontend)
            self.outboxes.append(outbox)
        self.num_received = [0] * num_frontends
        self._stopped: set[int] = set()  # front ends that said stop: they read nothing more
        # Per front end: the page hashes other front ends routed here since the last message to it ("routed").
        self._relay: list[list[list[int]]] = [[] for _ in range(num_frontends)]

    def receive(self, timeout_ms: float):
        """The next command as (kind, value), or None when none came within the timeout. "stop" is returned once
        every front end has said it; an "add" is counted for its front end."""
        while self.inbox.poll(timeout_ms):
            kind, body = self.inbox.recv_multipart()
            value = self.codec.decode(kind, body, _TO_CORE)
            if kind == b"stop":
                self._stopped.add(value)
                if len(self._stopped) < self.num_frontends:
                    continue
            elif kind == b"routed":  # for the front ends, not the engine: kept until the next message to each
                for index, pending in enumerate(self._relay):
                    if index != value.frontend and index not in self._stopped:
                        pending.extend(value.page_hashes)
                continue
            elif kind == b"add":
                for request in value:
                    self.num_received[frontend_of(request.rid, self.num_frontends)] += 1
            return kind, value
        return None

    def broadcast(self, kind: bytes, value) -> None:
        body = self.codec.encode(value)
        for outbox in self.outboxes:
            outbox.send_multipart([kind, body])

    def send_stats(self, stats: EngineStats) -> None:
        for index, outbox in enumerate(self.outboxes):
            if index not in self._stopped:
                self._send_relayed(index)
                outbox.send_multipart([b"stats", self.codec.encode(CoreStats(stats, self.num_received[index]))])

    def send_step(self, output: StepOutput, stats: EngineStats) -> None:
        """The step to every front end: each its own requests' deltas."""
        n = self.num_frontends
        if n == 1:
            step = CoreStep(output, CoreStats(stats, self.num_received[0]))
            self.outboxes[0].send_multipart([b"step", self.codec.encode(step)])
            return
        parts: list[list[RequestDelta]] = [[] for _ in range(n)]
        for delta in output.deltas:
            parts[frontend_of(delta.rid, n)].append(delta)
        for index, outbox in enumerate(self.outboxes):
            if index in self._stopped:
                continue
            self._send_relayed(index)
            part = StepOutput(parts[index], output.time, output.num_tokens if index == 0 else 0)
            step = CoreStep(part, CoreStats(stats, self.num_received[index]))
            outbox.send_multipart([b"step", self.codec.encode(step)])

    def _send_relayed(self, index: int) -> None:
        """Front end `index`'s pending "routed" hashes, if any, ahead of the message about to go to it."""
        if self._relay[index]:
            self.outboxes[index].send_multipart([b"routed", self.codec.encode(self._relay[index])])
            self._relay[index] = []

    def close(self) -> None:
        self.inbox.close(linger=0)
        for outbox in self.outboxes:
            outbox.close(linger=2000)


def core_main(config: EngineConfig, folder: str, server_pid: int, log_level: int, replica: int | None = None) -> None:
    """The core process's entry point: load the engine, report its info, then serve steps until told to stop.
    replica: which data-parallel replica this core is (engine/data_parallel.py), None without data parallelism."""
    name = "core" if replica is None else f"core {replica}"
    lifeline.end_with_parent(server_pid, f"engine {name}")  # first: a server already gone is not served
    lifeline.remove_when_orphaned(folder)
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s %(name)s [{name}]: %(message)s")
    # Ctrl-C reaches the whole process group: the core ends quietly (the frontend reports the shutdown), not with a
    # KeyboardInterrupt traceback from wherever it happened to be.
    signal.signal(signal.SIGINT, lambda signum, frame: sys.exit(130))
    if config.api_server_count > 1:
        # Several front ends: the parent (api_servers.py) has them drain and then stop this core, so a signal meant
        # for the whole group (a terminal's Ctrl-C, `timeout`, a supervisor) must not end it under them.
        os.setpgid(0, 0)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
    context = zmq.Context()
    links = FrontendLinks(context, folder, config.api_server_count)
    try:
        from .factory import make_engine

        engine = make_engine(config, replica)
    except BaseException as e:
        logger.exception("the engine could not start")
        links.broadcast(b"failed", f"{type(e).__name__}: {e}")
        for outbox in links.outboxes:
            outbox.close(linger=5000)
        raise SystemExit(1)
    links.broadcast(b"info", engine.info)
    gc.freeze()  # the model and the engine live as long as the process: later collections need not scan them again
    try:
        _serve(engine, links)
        engine.close()
    finally:
        links.close()
        context.term()


def _serve(engine, links: FrontendLinks) -> None:
    busy = False
    while True:
        # Busy: take whatever commands are there and step at once. Idle: wait for one.
        timeout = 0 if engine.has_unfinished() else _IDLE_POLL_MS
        rejected: list[RequestDelta] = []
        while (command := links.receive(timeout)) is not None:
            timeout = 0
            kind, value = command
            if kind == b"stop":
                return
            if kind == b"add":
                for request in value:
                    try:
                        engine.add(request)
                    except ValueError as e:  # InvalidRequestError: the frontend's checks and the core's disagree
                        rejected.append(RequestDelta(request.rid, [], None, finish_reason="error", error=str(e)))
            elif kind == b"abort":
                for rid in value:
                    engine.abort(rid)
        if rejected:
            links.send_step(StepOutput(rejected, time.monotonic()), engine.stats())
        if not engine.has_unfinished():
            engine.check_alive()  # a tensor-parallel rank that died while idle ends the core now, not at the next step
            if busy:  # just went idle: check that no page leaked (an InvariantError ends the core: never serve on
                busy = False  # a corrupt pool)
                engine.check_invariants()
            links.send_stats(engine.stats())
            continue
        busy = True
        output = engine.step()
        links.send_step(output, engine.stats())


# ---- the frontend's side -------------------------------------------------------------------------------------


class CoreStartError(RuntimeError):
    """The engine core process could not load the model."""


def start_core(config: EngineConfig, folder: str, log_level: int, replica: int | None) -> multiprocessing.Process:
    """Start an engine core process, a child of this one, that talks through sockets in `folder`."""
    spawn = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA or threads
    # Daemonic, so that it ends with this process; except with tensor parallelism, where it starts the other ranks
    # as its children, which a daemonic process may not (stop() ends it). Either way its lifeline ends it when this
    # process dies without a word, and its ranks' lifelines end them when it does.
    process = spawn.Process(
        target=core_main,  # (a global, looked up at each call: bench/frontend_rate.py puts a synthetic core there)
        args=(config, folder, os.getpid(), log_level, replica),
        name="fastqwen-core" if replica is None else f"fastqwen-core{replica}",
        daemon=config.tensor_parallel_size == 1,
    )
    process.start()
    logger.info("engine core process started (pid %d); loading the model there", process.pid)
    return process


@dataclass(frozen=True)
class CoreHandle:
    """An engine core that another process started (api_servers.py, for several front ends): its sockets' folder,
    its pid, and its data-parallel replica index (None without data parallelism)."""

    folder: str
    pid: int
    replica: int | None = None


class _ForeignProcess:
    """The liveness of a process that is not this one's child (a front end's engine core): through a pidfd, which
    turns readable when the process ends, zombie or not (Linux 5.3); else by signal 0."""

    def __init__(self, pid: int):
        self.pid = pid
        self.exitcode = None  # (not ours to reap: its parent reports it)
        try:
            self._pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self._pidfd = None

    def is_alive(self) -> bool:
        if self._pidfd is not None:
            return not select.select([self._pidfd], [], [], 0)[0]
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def join(self, timeout: float | None = None) -> None:
        pass  # its parent waits for it

    def kill(self) -> None:
        pass  # its parent ends it

    def close(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


class ProcessEngineClient:
    """EngineClient for an engine core in a child process (started by the constructor, which waits for it to load
    unless `wait` is False: then `wait_until_loaded` must be called before the client is used). With `attach`, the
    client of a core another process started, as front end `frontend` of its config.api_server_count."""

    def __init__(
        self,
        config: EngineConfig,
        log_level: int = logging.INFO,
        replica: int | None = None,
        wait: bool = True,
        attach: CoreHandle | None = None,
        frontend: int = 0,
    ):
        """replica: this core's index among data-parallel replicas (None: no data parallelism)."""
        self._dir = lifeline.ipc_folder("fastqwen") if attach is None else attach.folder
        self._frontend = frontend
        self._endpoints = _addresses(self._dir, frontend)
        to_core, to_frontend = self._endpoints
        self._context = zmq.Context()
        self._outbox = self._context.socket(zmq.PUSH)
        self._outbox.setsockopt(zmq.SNDHWM, 0)  # no limit: a send can then only block when the core is gone
        self._outbox.bind(to_core)
        self._inbox = self._context.socket(zmq.PULL)
        self._inbox.bind(to_frontend)
        self._send_lock = threading.Lock()  # add/abort come from the event loop and from the reader (stop strings)
        self._codec = _Codec()
        self._owns_core = attach is None
        if attach is None:
            self.process = start_core(config, self._dir, log_level, replica)
        else:
            self.process = _ForeignProcess(attach.pid)
        self._stats = CoreStats(EngineStats(), 0)
        self._relayed: deque[list[int]] | None = None  # see receive_routes
        self._num_added = 0  # requests sent to the core (written by the event loop only)
        self._reader: threading.Thread | None = None
        self._stopping = False
        self._sockets_closed = False
        self.error: BaseException | None = None
        self.info: EngineInfo | None = None
        if wait:
            self.wait_until_loaded()

    def wait_until_loaded(self) -> None:
        """Wait for the core to report its EngineInfo; raises CoreStartError if it cannot load."""
        self.info = self._wait_for_info()

    def _wait_for_info(self) -> EngineInfo:
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._inbox.poll(_READER_POLL_MS):
                kind, body = self._inbox.recv_multipart()
                value = self._codec.decode(kind, body, _TO_FRONTEND)
                if kind == b"info":
                    return value
                if kind == b"failed":
                    self._shutdown_sockets()
                    raise CoreStartError(f"the engine core could not start: {value}")
            elif not self.process.is_alive():
                self._shutdown_sockets()
                raise CoreStartError(f"the engine core {self._exit_status()} while loading")
        self.process.kill()
        self._shutdown_sockets()
        raise CoreStartError("the engine core did not finish loading in time")

    # ---- EngineClient ---------------------------------------------------------------------------------------

    def start(self, on_output, on_death) -> None:
        self._reader = threading.Thread(
            target=self._read, args=(on_output, on_death), name="fastqwen-core-reader", daemon=True
        )
        self._reader.start()

    def add(self, requests: list[EngineRequest]) -> None:
        self._num_added += len(requests)
        self._send(b"add", requests)

    def abort(self, rid: int) -> None:
        self._send(b"abort", [rid])

    def share_routes(self, page_hashes: list[list[int]]) -> None:
        """Tell the core the page hashes of prompts this front end routed to it, for it to relay to the others."""
        self._send(b"routed", RoutedPrompts(self._frontend, page_hashes))

    def receive_routes(self, capacity: int) -> deque[list[int]]:
        """From now on, the page hashes the core relays (prompts other front ends routed to it) are appended to the
        deque returned, by the reader thread; the oldest are dropped past `capacity` lists (each holds a page at
        least: an estimate bounded by `capacity` pages forgets them anyway)."""
        self._relayed = deque(maxlen=capacity)
        return self._relayed

    def stats(self) -> EngineStats:
        latest = self._stats  # one reference, swapped whole by the reader
        in_flight = max(0, self._num_added - latest.num_received)
        return replace(latest.stats, num_waiting=latest.stats.num_waiting + in_flight)

    def per_engine(self) -> list[tuple[EngineInfo, EngineStats]]:
        return [(self.info, self.stats())]

    @property
    def alive(self) -> bool:
        return self.process.is_alive() and self.error is None

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        try:
            self._send(b"stop", self._frontend)
        except zmq.ZMQError:
            pass
        self.process.join(timeout)  # (a core this client did not start: its parent waits for it)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        if self._reader is not None:
            self._reader.join(2)
        self._shutdown_sockets()

    # ---- internals ------------------------------------------------------------------------------------------

    def _send(self, kind: bytes, value) -> None:
        body = self._codec.encode(value)
        with self._send_lock:
            try:
                # Never block the event loop: with no send limit this only fails when the core has gone, which the
                # reader reports (every request in flight gets the error).
                self._outbox.send_multipart([kind, body], flags=zmq.NOBLOCK)
            except zmq.Again:
                logger.warning("dropped a %s message: the engine core is not connected", kind.decode())

    def _read(self, on_output, on_death) -> None:
        codec = _Codec()  # decoders are not shared with the constructor's thread
        try:
            while not self._stopping:
                if not self._inbox.poll(_READER_POLL_MS):
                    if not self.process.is_alive() and not self._stopping:
                        raise RuntimeError(f"the engine core process {self._exit_status()}")
                    continue
                kind, body = self._inbox.recv_multipart()
                value = codec.decode(kind, body, _TO_FRONTEND)
                if kind == b"step":
                    self._stats = value.stats
                    on_output(value.output)
                elif kind == b"stats":
                    self._stats = value
                elif kind == b"routed" and self._relayed is not None:
                    self._relayed.extend(value)
        except BaseException as e:
            if self._stopping:
                return
            logger.error("the engine core failed: %s", e)
            self.error = e
            on_death(e)

    def _exit_status(self) -> str:
        if self._owns_core:
            return f"exited with code {self.process.exitcode}"
        return f"(pid {self.process.pid}) exited"

    def _shutdown_sockets(self) -> None:
        if self._sockets_closed:  # (a core that failed to load, then stopped)
            return
        self._sockets_closed = True
        # A core this client did not start is not waited for: the "stop" just sent must still go out.
        self._outbox.close(linger=0 if self._owns_core else 1000)
        self._inbox.close(linger=0)
        self._context.term()
        for address in self._endpoints:
            try:
                os.unlink(address.removeprefix("ipc://"))
            except OSError:
                pass
        if not self._owns_core:  # the folder is the core's owner's to remove
            self.process.close()
            return
        try:
            os.rmdir(self._dir)
        except OSError:
            pass
