"""Data parallelism (`--data-parallel-size N`): N engine replicas behind the one HTTP front end, as vLLM's and
SGLang's servers run them. Each replica is an engine-core process of its own (engine/core_process.py) on GPUs of its
own (engine/factory.py's replica_config: replica r on the tensor-parallel group r*TP..r*TP+TP-1), with its own
scheduler, KV pool and prefix cache; they share nothing but the front end.

DataParallelEngineClient is the EngineClient the server sees: `add` routes each request to one replica
(engine/replica_router.py: the least busy, unless one holding the request's prefix is not much busier) and remembers
where it went, so that `abort` reaches the same replica; outputs of every replica reach the one `on_output`, one
replica's step at a time; `stats` adds the replicas' up, and `per_engine` gives each replica's for the metrics'
engine label. The replicas must serve the same model (their EngineInfo is compared at startup); a request is checked
against the smallest KV pool among them, since it may be routed to any.

With several front ends (api_servers.py, `attach`) each front end's router also learns the prompts the others routed:
each front end sends a replica's core the page hashes of the prompts it routed there, the core relays them to the
other front ends (engine/core_process.py), and each records them in its estimate of that replica before it next
routes. (With one front end none of this runs.)

Failure, as with one core: when a replica dies, `on_death` is called once, every request in flight fails and the
server exits non-zero (a supervisor restarts it); stopping the server stops the other replicas, and each replica
ends with the server however the server ends (engine/lifeline.py).

Threads: `add` is called on the event loop only (the router is not locked); `abort` also on the replicas' reader
threads (stop strings); the request-to-replica map is written by `add` and emptied as requests finish (the readers)
or are aborted.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import fields, replace

from ..config import EngineConfig
from .client import DeathCallback, EngineClient, OutputCallback
from .core_process import CoreHandle, CoreStartError, ProcessEngineClient
from .messages import EngineInfo, EngineRequest, EngineStats, StepOutput
from .replica_router import ReplicaRouter

logger = logging.getLogger("fastqwen.engine")


class DataParallelEngineClient:
    def __init__(self, replicas: list[EngineClient], share_routes: bool = False):
        """share_routes: one of several front ends (ProcessEngineClients attached to the cores): tell each core the
        prompts routed to it, and learn those the other front ends routed (see the module's docstring)."""
        self.replicas = replicas
        self.info = common_info([r.info for r in replicas])
        self.router = ReplicaRouter([r.info.num_pages for r in replicas], self.info.page_size, self.info.prefix_caching)
        self._share_routes = share_routes and self.info.prefix_caching
        # Per replica: what the other front ends routed there, as its core relays it (appended by its reader thread,
        # taken into the router by `add` on the event loop, so that the router stays on one thread).
        self._relayed = [r.receive_routes(r.info.num_pages) for r in replicas] if self._share_routes else []
        self._home: dict[int, int] = {}  # request id -> its replica, until the request finishes
        self._output_lock = threading.Lock()  # the frontend's on_output is written for one caller at a time
        self._death_lock = threading.Lock()
        self.error: BaseException | None = None

    @classmethod
    def launch(cls, config: EngineConfig, log_level: int = logging.INFO) -> DataParallelEngineClient:
        """Start config.data_parallel_size engine-core processes, all loading at once, and wait for every one;
        if one cannot start, the others are stopped and its error is raised (CoreStartError)."""
        replicas: list[ProcessEngineClient] = []
        try:
            for index in range(config.data_parallel_size):
                replicas.append(ProcessEngineClient(config, log_level, replica=index, wait=False))
            for index, replica in enumerate(replicas):
                try:
                    replica.wait_until_loaded()
                except CoreStartError as e:
                    raise CoreStartError(f"data-parallel replica {index}: {e}") from e
            client = cls(replicas)
        except BaseException:
            for replica in replicas:
                replica.stop(timeout=0)
            raise
        logger.info(
            "data parallel: %d replicas on %s, each request to the least busy one unless one caching its prefix is "
            "not much busier",
            len(replicas),
            ", ".join(r.info.device for r in replicas),
        )
        return client

    @classmethod
    def attach(cls, config: EngineConfig, cores: list[CoreHandle], frontend: int) -> DataParallelEngineClient:
        """Front end `frontend`'s client of replicas another process started (api_servers.py): each front end routes
        on its own, by the replicas' counts that every step's message brings it and by its own prefix estimate."""
        replicas = [ProcessEngineClient(config, attach=core, frontend=frontend, wait=False) for core in cores]
        try:
            for index, replica in enumerate(replicas):
                try:
                    replica.wait_until_loaded()
                except CoreStartError as e:
                    raise CoreStartError(f"data-parallel replica {index}: {e}") from e
            return cls(replicas, share_routes=config.api_server_count > 1)
        except BaseException:
            for replica in replicas:
                replica.stop(timeout=0)
            raise

    # ---- EngineClient ---------------------------------------------------------------------------------------

    def start(self, on_output: OutputCallback, on_death: DeathCallback) -> None:
        for index, replica in enumerate(self.replicas):
            replica.start(self._forward_to(on_output), self._death_of(index, on_death))

    def add(self, requests: list[EngineRequest]) -> None:
        loads = [s.num_running + s.num_waiting for s in (r.stats() for r in self.replicas)]
        batches: list[list[EngineRequest]] = [[] for _ in self.replicas]
        routed: list[list[list[int]]] | None = None  # per replica, the page hashes routed there, to be shared
        if self._share_routes:
            self._take_relayed()
            routed = [[] for _ in self.replicas]
        for request in requests:
            hashes = self.router.hashes(request.prompt_ids)
            index = self.router.route_pages(hashes, loads)
            loads[index] += 1  # (the next request of this call sees it)
            self._home[request.rid] = index
            batches[index].append(request)
            if routed is not None and hashes:
                routed[index].append(hashes)
        for index, (replica, batch) in enumerate(zip(self.replicas, batches)):
            if routed is not None and routed[index]:
                replica.share_routes(routed[index])
            if batch:
                replica.add(batch)

    def abort(self, rid: int) -> None:
        index = self._home.pop(rid, None)  # (an aborted request gets no final delta: forgotten here)
        if index is not None:  # (else it has finished or was aborted: nothing to abort)
            self.replicas[index].abort(rid)

    def stats(self) -> EngineStats:
        return total_stats(self.per_engine())

    def per_engine(self) -> list[tuple[EngineInfo, EngineStats]]:
        return [(r.info, r.stats()) for r in self.replicas]

    @property
    def alive(self) -> bool:
        return self.error is None and all(r.alive for r in self.replicas)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every replica at once (each drains its last step and closes its engine)."""
        stoppers = [threading.Thread(target=r.stop, args=(timeout,), daemon=True) for r in self.replicas]
        for stopper in stoppers:
            stopper.start()
        for stopper in stoppers:
            stopper.join(timeout + 10)

    # ---- internals ------------------------------------------------------------------------------------------

    def _take_relayed(self) -> None:
        """Record in the router what the other front ends routed to each replica, as if this one had."""
        for index, relayed in enumerate(self._relayed):
            while relayed:
                self.router.remember(index, relayed.popleft())

    def _forward_to(self, on_output: OutputCallback) -> OutputCallback:
        def forward(output: StepOutput) -> None:
            with self._output_lock:
                on_output(output)
            for delta in output.deltas:
                if delta.finished:
                    self._home.pop(delta.rid, None)

        return forward

    def _death_of(self, index: int, on_death: DeathCallback) -> DeathCallback:
        def died(error: BaseException) -> None:
            with self._death_lock:
                if self.error is not None:  # another replica died first: reported once
                    return
                self.error = RuntimeError(f"data-parallel replica {index}: {error}")
            on_death(self.error)

        return died


def common_info(infos: list[EngineInfo]) -> EngineInfo:
    """The one EngineInfo the frontend validates requests against: the replicas' (which must agree on everything but
    their devices and pool sizes), with the smallest pool, and every device named."""
    first = infos[0]

    def comparable(info: EngineInfo) -> EngineInfo:
        return replace(info, device="", num_pages=0, kv_bytes=0)

    for index, info in enumerate(infos[1:], 1):
        if comparable(info) != comparable(first):
            raise CoreStartError(
                f"data-parallel replica {index} serves another model than replica 0: {info} != {first}"
            )
    devices = list(dict.fromkeys(info.device for info in infos))
    return replace(
        first,
        num_pages=min(info.num_pages for info in infos),
        kv_bytes=min(info.kv_bytes for info in infos),
        device=", ".join(devices),
    )


def total_stats(engines: list[tuple[EngineInfo, EngineStats]]) -> EngineStats:
    """The replicas' stats as one engine's: every count added up (a list of counts position by position), and KV use
    over all the pages."""
    pages = sum(info.num_pages for info, _ in engines)
    totals = {}
    for f in fields(EngineStats):
        values = [getattr(stats, f.name) for _, stats in engines]
        if f.name == "kv_usage":
            totals[f.name] = sum(v * info.num_pages for v, (info, _) in zip(values, engines)) / max(1, pages)
        elif isinstance(values[0], list):
            totals[f.name] = [sum(column) for column in zip(*values)]
        else:
            totals[f.name] = sum(values)
    return EngineStats(**totals)
