"""The FastAPI application: lifespan (load the model off the event loop, start and stop the engine thread),
the request guard (authentication, body limit: guard.py), error mapping, shutdown, and the small endpoints
(/health, /v1/models, /metrics)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from ..engine.client import EngineClient
from ..engine.messages import request_ids
from ..frontend import Frontend
from ..sampling_params import SamplingParams
from . import http_conventions
from .async_engine import AsyncEngine, ShuttingDownError
from .guard import RequestGuard
from .http_errors import APIError, install_error_handlers
from .info_api import model_card
from .info_api import router as info_router
from .metrics import Metrics
from .native_api import router as native_router
from .openai_api import router as openai_router
from .openapi import install_openapi
from .responses_api import router as responses_router
from .retrieval_api import router as retrieval_router
from .state import ServerState
from .stats_log import log_stats

logger = logging.getLogger("fastqwen.server")
# The ready line is shown at any --log-level: it is what an operator waits for.
ready_logger = logging.getLogger("fastqwen.ready")
ready_logger.setLevel(logging.INFO)


@dataclass
class FrontEndRole:
    """This process's place among the several front ends of one engine (--api-server-count N, api_servers.py): its
    index, their count, and the readiness they share: no front end reports ready (/health, the API) until every one
    has loaded, so that a client that saw one ready is served by whichever its next connection reaches."""

    index: int
    count: int
    num_loaded: Any  # a multiprocessing.Value("i"): front ends loaded so far
    all_loaded: Any  # a multiprocessing.Event, set by the last front end to load

    def arrive(self) -> None:
        with self.num_loaded.get_lock():
            self.num_loaded.value += 1
            if self.num_loaded.value == self.count:
                self.all_loaded.set()


@dataclass
class ServerConfig:
    """The HTTP server's own settings (the engine's are EngineConfig)."""

    model_name: str
    api_key: str | None = None
    max_queued_requests: int | None = None
    max_request_body_bytes: int = 16 * 2**20
    max_sequences_per_request: int = 256  # prompts x n of one HTTP request
    # Called on the event loop when the model fails to load or the engine dies (its requests have been failed): the
    # server should exit non-zero, so a supervisor restarts it.
    incremental_streaming_output: bool = False  # /generate streams send only the new text and ids
    on_engine_death: Callable[[BaseException], None] | None = None
    # ---- operations (issue 17) ----
    model_aliases: tuple[str, ...] = ()  # more names `model` may take; responses carry model_name
    metrics_compat: str = "fastqwen"  # metric name prefix: "fastqwen" or "vllm" (vLLM's names, for its dashboards)
    request_log: bool = False  # one log line per finished request
    stats_interval: float = 5.0  # seconds between stats lines while busy; 0 = none
    allowed_origins: tuple[str, ...] = ()  # CORS; empty = no CORS headers, preflights refused
    url: str | None = None  # where the server listens, for the ready line
    warmup: bool = True  # one short request through the engine before the server reports ready
    api_server: FrontEndRole | None = None  # one of several front ends (None: the only one)


def create_app(config: ServerConfig, load_engine: Callable[[], EngineClient]) -> FastAPI:
    """load_engine runs in a worker thread at startup; until it returns, /health and every API answer 503."""
    role = config.api_server
    metrics = Metrics(config.model_name, config.metrics_compat, config.request_log, multiprocess=role is not None)
    state = ServerState(config.model_name, metrics, config.max_sequences_per_request)
    state.all_loaded = role is None
    state.model_names = (config.model_name, *[a for a in config.model_aliases if a != config.model_name])
    state.incremental_streaming_output = config.incremental_streaming_output

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop = asyncio.get_running_loop()
        loading = asyncio.create_task(_load(state, load_engine, config, metrics))
        try:
            yield
        finally:
            state.draining = True
            loading.cancel()
            if state.stats_task is not None:
                state.stats_task.cancel()
            if state.engine is not None:
                state.engine.stop()

    app = FastAPI(title="fastqwen", lifespan=lifespan)
    app.state.server = state
    app.add_middleware(RequestGuard, api_key=config.api_key, max_body_bytes=config.max_request_body_bytes)
    # (outside the guard) With several front ends each response says which one served it.
    served_by = None if role is None else str(role.index)
    http_conventions.install(app, list(config.allowed_origins), served_by)

    async def require_ready(request: HTTPRequest) -> None:
        if not state.ready:
            raise APIError(503, "the model is still loading", None, {"Retry-After": "5"})
        if not state.engine.alive:
            raise APIError(503, "the engine loop is not running", None)
        if state.draining:
            raise APIError(503, "the server is shutting down", None)

    guarded = [Depends(require_ready)]  # the API key is checked before this, by the guard
    app.include_router(openai_router, dependencies=guarded)
    app.include_router(retrieval_router, dependencies=guarded)
    app.include_router(responses_router, dependencies=guarded)
    app.include_router(native_router, dependencies=guarded)
    app.include_router(info_router, dependencies=guarded)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if state.load_error is not None:
            return JSONResponse({"status": "failed", "error": str(state.load_error)}, status_code=503)
        if not state.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        if not state.engine.alive:
            return JSONResponse({"status": "engine dead"}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(state, name) for name in state.model_names]}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    install_error_handlers(app)
    install_openapi(app, api_key=config.api_key is not None)
    return app


def begin_shutdown(app: FastAPI, timeout: float) -> None:
    """From now on new requests get 503; those still running after `timeout` seconds are ended with a 503 (an
    error event and [DONE] when streaming), before the HTTP server's own grace period cuts their connections.
    Safe to call from a signal handler (it only schedules work on the event loop)."""
    state: ServerState = app.state.server
    if state.draining:
        return
    state.draining = True
    loop = state.loop
    if loop is None or loop.is_closed():
        return

    def expire() -> None:
        if state.engine is not None:
            state.engine.fail_all(
                lambda: ShuttingDownError(
                    f"the server is shutting down and this request did not finish within {timeout:g} s"
                )
            )

    loop.call_soon_threadsafe(loop.call_later, timeout, expire)


def requests_in_flight(app: FastAPI) -> int:
    state: ServerState = app.state.server
    return state.engine.in_flight if state.engine is not None else 0


def stop_now(app: FastAPI, reason: str) -> None:
    """End every request in flight now, with a 503 (streams: an error event and [DONE]), without waiting for the
    drain. Safe to call from a signal handler."""
    state: ServerState = app.state.server
    state.draining = True
    loop = state.loop
    if loop is None or loop.is_closed() or state.engine is None:
        return
    engine = state.engine
    loop.call_soon_threadsafe(engine.fail_all, lambda: ShuttingDownError(reason))


# The warm-up request: a few prompt tokens and a few steps of decode, greedy.
WARMUP_PROMPT = [0] * 8
WARMUP_TOKENS = 16
WARMUP_TIMEOUT_S = 120.0


async def _warm_up(engine: AsyncEngine) -> None:
    """One short request through the whole path (admission, the engine core, its prefill and decode graphs, the
    detokenizer, the output stream), so that what the first request of a fresh process pays once is paid before the
    server reports ready: on an H100 with Qwen3-8B, the first stream without it waited 79 ms for its second token and
    47 ms for its first, against 7 and 23 ms with it (bench/results/2026-11-23-h100-first-requests). Not a
    client's request: it runs before the metrics are bound to the engine, so they count none of it. A failure is
    only logged here: an engine that died is reported (and ends the server) the way any engine death is.
    With data-parallel replicas, one request each: their first tokens differ, so no prefix draws two to one replica
    and the least busy one takes each."""
    started = time.monotonic()
    try:
        params = SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0.0, ignore_eos=True)
        trackers = [
            engine.new_request([index, *WARMUP_PROMPT[1:]], params) for index in range(len(engine.client.per_engine()))
        ]

        async def drain(tracker) -> None:
            async for _ in engine.updates(tracker):
                pass

        engine.enqueue(trackers)
        await asyncio.wait_for(asyncio.gather(*(drain(t) for t in trackers)), WARMUP_TIMEOUT_S)
        logger.info("warm-up request done in %.2f s", time.monotonic() - started)
    except Exception as e:  # (a timeout too: leaving updates() early aborts the request)
        logger.warning("the warm-up request failed (%s: %s); serving without it", type(e).__name__, e)


async def _load(state: ServerState, load_engine, config: ServerConfig, metrics: Metrics) -> None:
    try:
        started = time.monotonic()
        client = await asyncio.to_thread(load_engine)
    except asyncio.CancelledError:  # Ctrl-C or a shutdown while loading: not a load failure
        logger.info("loading stopped: the server is shutting down")
        raise
    except BaseException as e:
        state.load_error = e
        logger.exception("loading the model failed")
        if config.on_engine_death is not None:  # exit non-zero rather than answer 503 forever
            config.on_engine_death(e)
        raise
    role = config.api_server
    ids = None if role is None else request_ids(role.index, role.count)  # (the core tells front ends apart by id)
    async_engine = AsyncEngine(
        client, Frontend.for_engine(client.info, ids), config.max_queued_requests, metrics, config.on_engine_death
    )
    async_engine.start()
    if config.warmup:
        await _warm_up(async_engine)  # (before bind: the metrics count none of it)
    gc.freeze()  # what loading made lives as long as the server: later collections need not scan it again
    metrics.bind(async_engine)
    state.created = int(time.time())
    state.engine = async_engine
    if role is not None:  # ready once every front end is (the parent ends them all should one never get there)
        role.arrive()
        while not await asyncio.to_thread(role.all_loaded.wait, 0.5):
            pass
        state.all_loaded = True
        metrics.start_hand_over()  # (the others' scrapes read this process's counts from its files)
    if config.stats_interval > 0 and (role is None or role.index == 0):  # one line for the whole server
        state.stats_task = asyncio.create_task(log_stats(metrics, client.stats, config.stats_interval))
    if not async_engine.alive:  # the warm-up met a fault: no ready line (the engine's death is reported already)
        return
    if role is not None and role.index != 0:  # the ready line once, from front end 0
        return
    info = client.info
    ready_logger.info(
        "ready: serving %s%s%s, loaded in %.1f s (%s on %s, KV cache %d tokens, %.2f GiB)",
        " and ".join(repr(n) for n in state.model_names),
        f" at {config.url}" if config.url else "",
        "" if role is None else f" from {role.count} front-end processes",
        time.monotonic() - started,
        info.dtype,
        info.device,
        info.num_pages * info.page_size,
        info.kv_bytes / 2**30,
    )
