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

With tensor parallelism this process is rank 0 (engine/tensor_parallel.py): it starts the other ranks as its own
children and sends them each step's commands; the frontend still talks to rank 0 alone. If a rank dies, this process
ends (EngineFault), and so the server does too.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field, replace

import msgspec
import zmq

from ..config import EngineConfig
from . import lifeline
from .messages import EngineInfo, EngineRequest, EngineStats, RequestDelta, StepOutput

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


_TO_CORE = {b"add": list[EngineRequest], b"abort": list[int], b"stop": type(None)}
_TO_FRONTEND = {b"info": EngineInfo, b"step": CoreStep, b"stats": CoreStats, b"failed": str}


# ---- the core process ----------------------------------------------------------------------------------------


def _addresses(folder: str) -> tuple[str, str]:
    """The two sockets' addresses: to the core, to the frontend."""
    return f"ipc://{folder}/to_core", f"ipc://{folder}/to_frontend"


def core_main(config: EngineConfig, folder: str, server_pid: int, log_level: int, replica: int | None = None) -> None:
    """The core process's entry point: load the engine, report its info, then serve steps until told to stop.
    replica: which data-parallel replica this core is (engine/data_parallel.py), None without data parallelism."""
    name = "core" if replica is None else f"core {replica}"
    lifeline.end_with_parent(server_pid, f"engine {name}")  # first: a server already gone is not served
    lifeline.remove_when_orphaned(folder)
    to_core, to_frontend = _addresses(folder)
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s %(name)s [{name}]: %(message)s")
    # Ctrl-C reaches the whole process group: the core ends quietly (the frontend reports the shutdown), not with a
    # KeyboardInterrupt traceback from wherever it happened to be.
    signal.signal(signal.SIGINT, lambda signum, frame: sys.exit(130))
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.connect(to_core)
    outbox = context.socket(zmq.PUSH)
    outbox.connect(to_frontend)
    codec = _Codec()
    try:
        from .factory import make_engine

        engine = make_engine(config, replica)
    except BaseException as e:
        logger.exception("the engine could not start")
        outbox.send_multipart([b"failed", codec.encode(f"{type(e).__name__}: {e}")])
        outbox.close(linger=5000)
        raise SystemExit(1)
    outbox.send_multipart([b"info", codec.encode(engine.info)])
    gc.freeze()  # the model and the engine live as long as the process: later collections need not scan them again
    try:
        _serve(engine, inbox, outbox, codec)
        engine.close()
    finally:
        inbox.close(linger=0)
        outbox.close(linger=2000)
        context.term()


def _serve(engine, inbox, outbox, codec: _Codec) -> None:
    num_received = 0
    busy = False
    while True:
        # Busy: take whatever commands are there and step at once. Idle: wait for one.
        timeout = 0 if engine.has_unfinished() else _IDLE_POLL_MS
        rejected: list[RequestDelta] = []
        while inbox.poll(timeout):
            timeout = 0
            kind, body = inbox.recv_multipart()
            value = codec.decode(kind, body, _TO_CORE)
            if kind == b"stop":
                return
            if kind == b"add":
                for request in value:
                    num_received += 1
                    try:
                        engine.add(request)
                    except ValueError as e:  # InvalidRequestError: the frontend's checks and the core's disagree
                        rejected.append(RequestDelta(request.rid, [], None, finish_reason="error", error=str(e)))
            elif kind == b"abort":
                for rid in value:
                    engine.abort(rid)
        if rejected:
            step = CoreStep(StepOutput(rejected, time.monotonic()), CoreStats(engine.stats(), num_received))
            outbox.send_multipart([b"step", codec.encode(step)])
        if not engine.has_unfinished():
            engine.check_alive()  # a tensor-parallel rank that died while idle ends the core now, not at the next step
            if busy:  # just went idle: check that no page leaked (an InvariantError ends the core: never serve on
                busy = False  # a corrupt pool)
                engine.check_invariants()
            outbox.send_multipart([b"stats", codec.encode(CoreStats(engine.stats(), num_received))])
            continue
        busy = True
        output = engine.step()
        outbox.send_multipart([b"step", codec.encode(CoreStep(output, CoreStats(engine.stats(), num_received)))])


# ---- the frontend's side -------------------------------------------------------------------------------------


class CoreStartError(RuntimeError):
    """The engine core process could not load the model."""


class ProcessEngineClient:
    """EngineClient for an engine core in a child process (started by the constructor, which waits for it to load
    unless `wait` is False: then `wait_until_loaded` must be called before the client is used)."""

    def __init__(
        self, config: EngineConfig, log_level: int = logging.INFO, replica: int | None = None, wait: bool = True
    ):
        """replica: this core's index among data-parallel replicas (None: no data parallelism)."""
        self._dir = lifeline.ipc_folder("fastqwen")
        to_core, to_frontend = _addresses(self._dir)
        self._context = zmq.Context()
        self._outbox = self._context.socket(zmq.PUSH)
        self._outbox.setsockopt(zmq.SNDHWM, 0)  # no limit: a send can then only block when the core is gone
        self._outbox.bind(to_core)
        self._inbox = self._context.socket(zmq.PULL)
        self._inbox.bind(to_frontend)
        self._send_lock = threading.Lock()  # add/abort come from the event loop and from the reader (stop strings)
        self._codec = _Codec()
        spawn = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA or threads
        # Daemonic, so that it ends with this process; except with tensor parallelism, where it starts the other ranks
        # as its children, which a daemonic process may not (stop() ends it). Either way its lifeline ends it when this
        # process dies without a word, and its ranks' lifelines end them when it does.
        self.process = spawn.Process(
            target=core_main,
            args=(config, self._dir, os.getpid(), log_level, replica),
            name="fastqwen-core" if replica is None else f"fastqwen-core{replica}",
            daemon=config.tensor_parallel_size == 1,
        )
        self._stats = CoreStats(EngineStats(), 0)
        self._num_added = 0  # requests sent to the core (written by the event loop only)
        self._reader: threading.Thread | None = None
        self._stopping = False
        self._sockets_closed = False
        self.error: BaseException | None = None
        self.info: EngineInfo | None = None
        self.process.start()
        logger.info("engine core process started (pid %d); loading the model there", self.process.pid)
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
                raise CoreStartError(f"the engine core exited with code {self.process.exitcode} while loading")
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
            self._send(b"stop", None)
        except zmq.ZMQError:
            pass
        self.process.join(timeout)
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
                        raise RuntimeError(f"the engine core process exited with code {self.process.exitcode}")
                    continue
                kind, body = self._inbox.recv_multipart()
                value = codec.decode(kind, body, _TO_FRONTEND)
                if kind == b"step":
                    self._stats = value.stats
                    on_output(value.output)
                elif kind == b"stats":
                    self._stats = value
        except BaseException as e:
            if self._stopping:
                return
            logger.error("the engine core failed: %s", e)
            self.error = e
            on_death(e)

    def _shutdown_sockets(self) -> None:
        if self._sockets_closed:  # (a core that failed to load, then stopped)
            return
        self._sockets_closed = True
        for socket in (self._outbox, self._inbox):
            socket.close(linger=0)
        self._context.term()
        for name in ("to_core", "to_frontend"):
            try:
                os.unlink(os.path.join(self._dir, name))
            except OSError:
                pass
        try:
            os.rmdir(self._dir)
        except OSError:
            pass
