"""Tensor parallelism: one process per rank, each running the same engine over its shard of the model.

Rank 0's engine is the one the frontend talks to: in the offline LLM's process, or in the engine core process behind
the server (engine/core_process.py). `TensorParallelEngine` wraps it and starts ranks 1..N-1 as child processes
(spawn); each child builds an `LLMEngine` of its own over its shard (sharding.py), and the ranks meet in the
collectives of every forward pass (ops/collectives.py).

Keeping the ranks in step, SGLang's way: rank 0 takes the frontend's commands (adds, aborts) and, with each step,
sends the commands taken since the last one to every other rank ("orders", one ZeroMQ PUSH socket per rank). Every
rank then applies the same commands and runs the same step: the scheduler's choices depend only on those commands and
the pool's size (the same on every rank: the smallest rank's), and the samplers get the same logits (gathered) and
the same seeds, so every rank picks the same batch and samples the same tokens. Each order carries a checksum of rank
0's previous step output, which the others compare with theirs: a rank that drifted fails loudly instead of serving
wrong tokens. Rank 0 thus schedules for everybody, without shipping its batches, and the model runner, CUDA graphs
and overlap schedule work unchanged on every rank.

Failures end the engine, never hang it: a rank that fails exits; rank 0 watches its children and raises EngineFault
at its next step or idle check (`check_alive`); a gloo collective fails at once when a peer is gone, and where a
GPU collective would wait forever for a dead peer, the watcher ends rank 0's process after a grace period. Ranks
1..N-1 exit as soon as rank 0's process is gone, however it ended (engine/lifeline.py), and remove the IPC folder
if rank 0 could not.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import os
import shutil
import threading
import time
import zlib
from dataclasses import dataclass, field, replace

import msgspec
import torch
import torch.distributed as dist
import zmq

from ..config import EngineConfig
from ..ops.collectives import ParallelGroup
from . import lifeline
from .llm_engine import EngineFault, LLMEngine
from .messages import EngineRequest, StepOutput

log = logging.getLogger(__name__)

_CONNECT_TIMEOUT = datetime.timedelta(seconds=300)  # every rank reaches the rendezvous (spawn and import torch)
_STARTUP_TIMEOUT_S = 3600.0  # then loads its shard
_GRACE_S = 10.0  # how long rank 0 may stay stuck in a step after another rank died before its process is ended
_WATCH_S = 0.2


@dataclass
class Command:
    kind: str  # "add" or "abort"
    request: EngineRequest | None = None
    rid: int = 0


@dataclass
class Order:
    """Rank 0 to the others: apply these commands, then step (or stop)."""

    commands: list[Command] = field(default_factory=list)
    checksum: int = -1  # of rank 0's previous step output (-1: no step yet)
    stop: bool = False


def step_checksum(output: StepOutput) -> int:
    """What every rank's step must agree on: which requests advanced, with which tokens, and how they finished."""
    summary = [(d.rid, d.new_token_ids, d.finish_reason, d.stop_reason) for d in output.deltas]
    return zlib.crc32(msgspec.msgpack.encode(summary))


def _rank_config(config: EngineConfig, rank: int) -> tuple[EngineConfig, torch.device]:
    device = torch.device(
        config.device if config.device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    if device.type == "cuda":
        # Rank r on GPU base + r: base is the device's index (a data-parallel replica's first GPU), else 0.
        # (CUDA_VISIBLE_DEVICES picks which GPUs are seen.)
        device = torch.device("cuda", (device.index or 0) + rank)
    return replace(config, device=str(device)), device


def _join(config: EngineConfig, rank: int, store) -> tuple[ParallelGroup, EngineConfig]:
    """This rank's process groups, and its engine config (its own GPU)."""
    config, device = _rank_config(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # the ranks share the host's cores: spinning intra-op threads of one would starve the others' collectives
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.tensor_parallel_size))
    parallel = ParallelGroup.connect(
        rank, config.tensor_parallel_size, store, device, custom_all_reduce=not config.disable_custom_all_reduce
    )
    return parallel, config


class TensorParallelEngine:
    """Rank 0: an LLMEngine (its attributes are this object's: kv, runner, scheduler, info, ...) whose add, abort
    and step also drive the other ranks."""

    def __init__(self, config: EngineConfig):
        size = config.tensor_parallel_size
        _, device = _rank_config(config, 0)
        if device.type == "cuda" and torch.cuda.device_count() < device.index + size:
            raise RuntimeError(
                f"tensor_parallel_size={size} needs {size} GPUs from {device}; {torch.cuda.device_count()} are visible"
            )
        # NVLink multicast (NVLS) stays off: on these machines it can take the host's GPUs out of service.
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        self._closing = False
        self._num_threads = torch.get_num_threads()  # rank 0 on the CPU shares the cores (_join): restored on close
        self._in_step = False
        self._acknowledged = threading.Event()
        self.failure: str | None = None  # why a rank is gone
        self._checksum = -1
        self._commands: list[Command] = []
        self._encoder = msgspec.msgpack.Encoder()
        self._dir = lifeline.ipc_folder("fastqwen-tp")
        lifeline.remove_when_orphaned(self._dir)  # (where rank 0 is the engine core and the server dies)
        self._context = zmq.Context()
        self._reports = self._context.socket(zmq.PULL)
        self._reports.bind(f"ipc://{self._dir}/reports")
        self._orders = []
        for rank in range(1, size):
            socket = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.SNDHWM, 0)
            socket.bind(f"ipc://{self._dir}/orders-{rank}")
            self._orders.append(socket)
        # The rendezvous store lives in this process; the other ranks connect to its port.
        store = dist.TCPStore("127.0.0.1", 0, size, True, _CONNECT_TIMEOUT, wait_for_workers=False)
        self._store = store
        spawn = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA or threads
        self.processes = [
            spawn.Process(
                target=rank_main,
                args=(config, rank, store.port, self._dir, os.getpid(), logging.getLogger().level),
                name=f"fastqwen-tp{rank}",
                daemon=True,
            )
            for rank in range(1, size)
        ]
        for process in self.processes:
            process.start()
        log.info(
            "tensor parallel: started ranks 1..%d (pids %s); loading the shards",
            size - 1,
            ", ".join(str(p.pid) for p in self.processes),
        )
        self._watcher = threading.Thread(target=self._watch, name="fastqwen-tp-watch", daemon=True)
        self._watcher.start()
        try:
            self.parallel, rank_config = _join(config, 0, store)
            self.engine = LLMEngine(rank_config, parallel=self.parallel)
            self._wait_ready(size - 1)
        except BaseException as e:
            reason = self._failed_report() or self.failure
            self.close(kill=True)
            if reason and not isinstance(e, (ValueError, OSError)):
                raise RuntimeError(f"tensor parallel: a rank could not start: {reason}") from e
            raise  # rank 0's own refusal of the model or its files (every rank meets the same): the cause, as it is

    # ---- the engine's interface -----------------------------------------------------------------------------

    def __getattr__(self, name: str):
        engine = self.__dict__.get("engine")
        if engine is None:
            raise AttributeError(name)
        return getattr(engine, name)

    def add(self, request: EngineRequest) -> None:
        self.engine.add(request)  # a request rank 0 refuses is never sent to the others
        self._commands.append(Command("add", request=request))

    def abort(self, rid: int) -> bool:
        self._commands.append(Command("abort", rid=rid))
        return self.engine.abort(rid)

    def step(self) -> StepOutput:
        self.check_alive()
        if self._closing:  # the other ranks are gone: a collective would wait for them forever (on GPUs)
            raise EngineFault("tensor parallel: the engine is closed")
        order = self._encoder.encode(Order(self._commands, self._checksum))
        self._commands = []
        for socket in self._orders:
            socket.send(order)
        self._in_step = True
        try:
            output = self.engine.step()
        except BaseException:
            self._acknowledged.set()
            self.close(kill=True)
            raise
        finally:
            self._in_step = False
        self._checksum = step_checksum(output)
        return output

    def check_alive(self) -> None:
        """Raise EngineFault when another rank is gone (the engine cannot step again)."""
        if self.failure is not None:
            self._acknowledged.set()
            self.close(kill=True)
            raise EngineFault(f"tensor parallel: {self.failure}")

    def close(self, kill: bool = False) -> None:
        """Stop the other ranks (at once with kill, else after they finish their step)."""
        if self._closing:
            return
        self._closing = True
        if not kill:
            stop = self._encoder.encode(Order(self._commands, self._checksum, stop=True))
            for socket in self._orders:
                socket.send(stop)
            for process in self.processes:
                process.join(30)
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join(5)
        engine = self.__dict__.get("engine")
        parallel = self.__dict__.get("parallel")
        if engine is not None:
            engine.close()  # rank 0's own: its KV-event publisher
            # The graphs go before the communicator: NCCL's teardown waits for every graph that captured one of its
            # collectives to be destroyed, and the group's destructor (whenever the garbage collector runs it) would
            # otherwise wait forever (a second TP LLM in one process hung there on two H200s).
            engine.runner.release_graphs()
        if parallel is not None:
            parallel.abort_device_group()  # the other ranks are gone: nobody to shut the communicator down with
        if parallel is not None and parallel.custom is not None and not kill:
            parallel.custom.close()  # the other ranks have exited: nobody reads this rank's buffer any more
        torch.set_num_threads(self._num_threads)
        for socket in [*self._orders, self._reports]:
            socket.close(linger=0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)
        lifeline.forget(self._dir)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ---- internals ------------------------------------------------------------------------------------------

    def _wait_ready(self, count: int) -> None:
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        ready = 0
        while ready < count:
            if time.monotonic() > deadline:
                raise RuntimeError("tensor parallel: the other ranks did not load in time")
            if self.failure is not None:
                raise RuntimeError(f"tensor parallel: {self.failure}")
            if self._reports.poll(100):
                kind, body = self._reports.recv_multipart()
                if kind == b"failed":
                    raise RuntimeError(body.decode())
                ready += 1

    def _failed_report(self) -> str | None:
        try:
            while self._reports.poll(200):
                kind, body = self._reports.recv_multipart()
                if kind == b"failed":
                    return body.decode()
        except zmq.ZMQError:
            pass
        return None

    def _watch(self) -> None:
        """Notice a rank that exited. Where rank 0 is stuck in a step that waits for it (a GPU collective never
        returns when a peer is gone), end this process after a grace period, so the failure is an exit, not a hang."""
        while not self._closing:
            for rank, process in enumerate(self.processes, start=1):
                if not process.is_alive() and not self._closing:
                    self.failure = f"rank {rank} exited with code {process.exitcode}"
                    log.error("tensor parallel: %s", self.failure)
                    deadline = time.monotonic() + _GRACE_S
                    while time.monotonic() < deadline and not self._acknowledged.is_set():
                        if not self._in_step and "engine" in self.__dict__:
                            return  # idle: the next step or check_alive raises
                        time.sleep(_WATCH_S)
                    if not self._acknowledged.is_set() and not self._closing:
                        log.critical("tensor parallel: rank 0 is stuck waiting for the dead rank; exiting")
                        logging.shutdown()
                        os._exit(1)
                    return
            time.sleep(_WATCH_S)


# ---- ranks 1..N-1 --------------------------------------------------------------------------------------------


def rank_main(config: EngineConfig, rank: int, port: int, folder: str, leader_pid: int, log_level: int) -> None:
    """A rank other than 0: load its shard, then apply rank 0's orders and step, until told to stop."""
    lifeline.end_with_parent(leader_pid, f"tensor-parallel rank {rank}")  # rank 0's process is this one's parent
    lifeline.remove_when_orphaned(folder)
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s %(name)s [tp{rank}]: %(message)s")
    context = zmq.Context()
    orders = context.socket(zmq.PULL)
    orders.connect(f"ipc://{folder}/orders-{rank}")
    reports = context.socket(zmq.PUSH)
    reports.connect(f"ipc://{folder}/reports")
    try:
        store = dist.TCPStore("127.0.0.1", port, config.tensor_parallel_size, False, _CONNECT_TIMEOUT)
        parallel, rank_config = _join(config, rank, store)
        engine = LLMEngine(rank_config, parallel=parallel)
    except BaseException as e:
        log.exception("rank %d could not start", rank)
        reports.send_multipart([b"failed", f"rank {rank}: {type(e).__name__}: {e}".encode()])
        reports.close(linger=5000)
        os._exit(1)
    reports.send_multipart([b"ready", b""])
    try:
        _follow(engine, orders, rank)
    except BaseException:
        log.exception("rank %d failed; exiting", rank)
        # A failed rank ends the engine; the folder goes now in case rank 0 is what failed: when it is killed, the
        # collective fails here before the lifeline sees it gone. (Rank 0's sockets, if it lives, are bound already.)
        shutil.rmtree(folder, ignore_errors=True)
        logging.shutdown()
        os._exit(1)
    # Exiting frees this rank's buffers: rank 0 closes its mappings only after every other rank has exited.
    orders.close(linger=0)
    reports.close(linger=0)
    os._exit(0)


def _follow(engine: LLMEngine, orders, rank: int) -> None:
    decoder = msgspec.msgpack.Decoder(Order)
    checksum = -1
    while True:
        order = decoder.decode(orders.recv())
        if order.checksum != checksum:
            raise RuntimeError(
                f"rank {rank} drifted from rank 0: its last step's checksum is {checksum}, rank 0's {order.checksum}"
            )
        if order.stop:
            return
        for command in order.commands:
            if command.kind == "add":
                engine.add(command.request)
            else:
                engine.abort(command.rid)
        checksum = step_checksum(engine.step())
