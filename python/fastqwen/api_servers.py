"""Several HTTP front-end processes before the engine core(s): `python -m fastqwen.serve --api-server-count N`, as
vLLM's `--api-server-count`.

Why: one front-end process (HTTP, JSON, detokenizing, SSE, on one core) delivers a bounded number of streamed tokens
a second (bench/frontend_rate.py), so two GPU replicas behind one front end gave 1.14x one replica where two servers
behind a gateway gave 1.83x. N front ends, each a client of every engine core, lift that ceiling N-fold.

This process, the parent, serves no request. It:
- binds the port once per front end with SO_REUSEPORT, before anything loads (a port in use fails now, as with one
  front end: a plain bind is tried first, so a port another server holds, fastqwen or not, is refused rather than
  shared), and hands each front end its own socket. The kernel spreads new connections over the sockets evenly. (One
  socket shared by every front end is the other way; an idle front end's accept loop then takes every connection
  that is waiting, so a burst of connections tends to land on one process.)
- starts the engine core(s) (engine/core_process.py's start_core, one per data-parallel replica), each told of N
  front ends, and the N front ends (spawned). Front ends and cores each run in a process group of their own, so a
  signal for the whole group (a terminal's Ctrl-C, `timeout`) reaches this process only, which passes each SIGINT or
  SIGTERM on to the front ends: the first drains, a second stops now, as with one front end; the cores, which ignore
  both, stop once every front end has told them to;
- makes the metrics folder the front ends share (server/metrics.py: prometheus_client's multiprocess mode);
- waits. A front end that exits while the server is not stopping stops the server: the others get SIGTERM (they
  drain), the cores are ended, and the exit status is non-zero. A core that dies is seen by every front end (each
  fails its requests with 503 and exits non-zero), and so ends the server the same way. Every child ends with this
  process however it ends (engine/lifeline.py), and the folders are removed.

Each front end (`frontend_main`) is the ordinary server (serve.serve_http) whose engine client is attached to the
cores another process started (ProcessEngineClient's `attach`), whose request ids are its share (front end i of N
gives i, i + N, ...: the cores send each front end its own requests' deltas), and whose readiness waits for every
front end to have loaded (app.FrontEndRole).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import time

from . import env
from .config import EngineConfig
from .engine import lifeline

logger = logging.getLogger("fastqwen.api_servers")
CORE_STOP_S = 10.0  # how long the cores get to stop once every front end has asked them to
FRONT_ENDS_AFTER_CORE_DEATH_S = 10.0  # how long the front ends get to fail their requests after a core died
# Past --shutdown-timeout, how long front ends get to end before they are killed (a front end still loading, say,
# waits for its core, which a signal does not stop).
STOP_GRACE_S = 15.0


def bind_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` sockets bound to host:port with SO_REUSEPORT (serve._bind's, not yet listening)."""
    from .serve import _bind

    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sockets.append(_bind(host, port, reuse_port=True))
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def run_api_servers(args: argparse.Namespace, engine_config: EngineConfig, prog: str) -> int:
    """The parent: start the cores and args.api_server_count front ends, and supervise them until the server stops;
    returns the exit status."""
    count = engine_config.api_server_count
    try:
        sockets = bind_sockets(args.host, args.port, count)
    except OSError as e:
        print(f"{prog}: error: cannot listen on {args.host}:{args.port}: {e.strerror or e} (--host, --port)",
              file=sys.stderr, flush=True)  # fmt: skip
        return 1
    spawn = multiprocessing.get_context("spawn")
    # The metrics folder, before any front end imports prometheus_client (which reads the variable then).
    metrics_dir = lifeline.ipc_folder("fastqwen-metrics")
    env.share_metrics_through(metrics_dir)
    log_level = logging.getLogger().level
    folders: list[str] = []
    cores: list[multiprocessing.Process] = []
    frontends: list[multiprocessing.Process] = []
    try:
        from .engine.core_process import CoreHandle, start_core
        from .server.app import FrontEndRole

        replicas = engine_config.data_parallel_size
        handles = []
        for replica in range(replicas):
            folders.append(lifeline.ipc_folder("fastqwen"))
            index = replica if replicas > 1 else None
            cores.append(start_core(engine_config, folders[-1], log_level, index))
            handles.append(CoreHandle(folders[-1], cores[-1].pid, index))
        num_loaded, all_loaded = spawn.Value("i", 0), spawn.Event()
        for index in range(count):
            role = FrontEndRole(index, count, num_loaded, all_loaded)
            frontend = spawn.Process(
                target=frontend_main,
                args=(args, engine_config, sockets[index], handles, role, os.getpid(), log_level, prog),
                name=f"fastqwen-api{index}",
            )
            frontend.start()
            frontends.append(frontend)
            logger.info("api server %d started (pid %d)", index, frontend.pid)
        for sock in sockets:
            sock.close()  # (each front end has its own copy)
        return _supervise(frontends, cores, args.shutdown_timeout + STOP_GRACE_S)
    finally:
        for frontend in frontends:  # (only after an error here: _supervise returns once they have all ended)
            if frontend.is_alive():
                frontend.kill()
                frontend.join(5)
        _stop_cores(cores, gently=False)
        for folder in [*folders, metrics_dir]:
            shutil.rmtree(folder, ignore_errors=True)


def _supervise(frontends: list[multiprocessing.Process], cores: list[multiprocessing.Process], stop_s: float) -> int:
    """Wait until every front end has ended; pass signals on; stop everything when a front end or a core dies.
    stop_s: how long front ends may take to end once told to."""
    stopping = False  # a signal came: the front ends drain, their exits are expected
    failed: int | None = None  # the exit status, once a child died
    deadline: float | None = None  # when to stop waiting for front ends to end on their own

    def pass_on(sig, frame) -> None:
        nonlocal stopping, deadline
        if not stopping:
            deadline = time.monotonic() + stop_s
        stopping = True
        for frontend in frontends:
            if frontend.exitcode is None:
                os.kill(frontend.pid, sig)

    previous = {sig: signal.signal(sig, pass_on) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        reported: set[int] = set()
        while any(f.exitcode is None for f in frontends):
            sentinels = [p.sentinel for p in (*frontends, *cores) if p.exitcode is None]
            multiprocessing.connection.wait(sentinels, timeout=1.0)
            for index, frontend in enumerate(frontends):
                if frontend.exitcode is None or index in reported:
                    continue
                reported.add(index)
                if not stopping and failed is None:
                    logger.error(
                        "api server %d (pid %d) exited with status %s: stopping the server",
                        index,
                        frontend.pid,
                        frontend.exitcode,
                    )
                    failed = frontend.exitcode or 1
                    deadline = time.monotonic() + stop_s
                    for other in frontends:
                        if other.exitcode is None:
                            os.kill(other.pid, signal.SIGTERM)
            for index, core in enumerate(cores):
                if core.exitcode is not None and failed is None and not stopping:
                    # Each front end sees it and fails its requests; they end the server by exiting.
                    logger.error("engine core %d (pid %d) exited with status %s", index, core.pid, core.exitcode)
                    failed = 1
                    deadline = time.monotonic() + FRONT_ENDS_AFTER_CORE_DEATH_S
            if deadline is not None and time.monotonic() > deadline:
                for index, frontend in enumerate(frontends):
                    if frontend.exitcode is None:
                        logger.error("api server %d (pid %d) did not end in time: killed", index, frontend.pid)
                        frontend.kill()
                deadline = None
        codes = [f.exitcode for f in frontends]
        _stop_cores(cores, gently=failed is None)
        if failed is not None:
            return failed if failed > 0 else 1
        return max(codes, key=abs) if any(codes) else 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop_cores(cores: list[multiprocessing.Process], gently: bool) -> None:
    """Gently: the front ends have each said stop, so the cores are ending. Else end them now (they ignore SIGTERM:
    core_process.core_main)."""
    for core in cores:
        if core.exitcode is None and not gently:
            core.kill()
    for core in cores:
        core.join(CORE_STOP_S if gently else 5)
        if core.exitcode is None:
            core.kill()
            core.join(5)


def frontend_main(args, engine_config, sock, handles, role, parent_pid: int, log_level: int, prog: str) -> None:
    """One front end: the ordinary HTTP server on its socket, its engine client attached to the cores."""
    lifeline.end_with_parent(parent_pid, f"api server {role.index}")
    os.setpgid(0, 0)  # signals come from the parent only (see the module's docstring)
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s %(name)s [api {role.index}]: %(message)s")
    from .serve import serve_http

    def load_engine():
        from .engine.core_process import ProcessEngineClient
        from .engine.data_parallel import DataParallelEngineClient

        if len(handles) > 1:
            return DataParallelEngineClient.attach(engine_config, handles, role.index)
        return ProcessEngineClient(engine_config, attach=handles[0], frontend=role.index)

    sys.exit(serve_http(args, sock, load_engine, prog, api_server=role))
