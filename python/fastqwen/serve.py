"""python -m fastqwen.serve --model PATH_OR_HUB_ID (or `fastqwen serve MODEL`): the OpenAI-compatible HTTP server.

A start that cannot succeed ends within seconds, with exit status 1 or 2 and a last line that names the cause and the
flag to change: the model source is checked before anything is loaded, and a load that fails in the engine ends the
process rather than leaving a server that answers 503 forever. The ready line appears once the model can serve."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys

from . import env, model_source
from .cli import add_model_positional, take_model
from .config import ConfigError, EngineConfig, context_length, load_model_config

shutdown_logger = logging.getLogger("fastqwen.shutdown")
shutdown_logger.setLevel(logging.INFO)  # what a stop is doing shows at any --log-level, like the ready line
# After a second signal, how long the ended requests' error events get to go out before connections are cut.
FORCED_STOP_GRACE_S = 2.0


class _DefaultsOnceFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help, unless the help already says its default in words or there is
    nothing to say (None, an off switch): argparse's ArgumentDefaultsHelpFormatter would print it a second time."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unsaid = any(action.default is nothing for nothing in (None, False, argparse.SUPPRESS)) or "default" in text
        if unsaid or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


def parse_args(argv: list[str] | None = None, prog: str = "python -m fastqwen.serve") -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Serve a Qwen3 model over an OpenAI-compatible HTTP API (plus SGLang's /generate).",
        formatter_class=_DefaultsOnceFormatter,
    )
    add_model_positional(p)
    EngineConfig.add_cli_arguments(p, model=None)
    server = p.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    server.add_argument("--port", type=int, default=8000, help="port to listen on")
    server.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model id responses carry and /v1/models lists (default: --model); more names are aliases that requests may use too",
    )
    server.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="waiting requests beyond this get 503 with Retry-After (default: no limit)",
    )
    server.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on the API (or set FASTQWEN_API_KEY)"
    )
    server.add_argument(
        "--timeout-keep-alive",
        type=int,
        default=75,
        help="seconds an idle HTTP connection is kept open; longer than clients' own pool expiry (httpx: 5 s), so the client, not the server, closes it and never sends a request on a connection the server is closing",
    )
    server.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM or Ctrl-C, seconds running requests may take to finish; then each gets a 503 (streams: an error event and [DONE]). A second signal ends them so at once (exit status 130 after a second Ctrl-C)",
    )
    server.add_argument(
        "--incremental-streaming-output",
        action="store_true",
        help="/generate streams send only the new text and output ids in each event (SGLang's flag); by default each event carries the whole output so far, as SGLang's clients expect",
    )
    server.add_argument(
        "--allowed-origins",
        nargs="+",
        default=None,
        metavar="ORIGIN",
        help="answer CORS preflights and add CORS headers for these browser origins ('*' for any); off by default",
    )
    server.add_argument(
        "--skip-warmup",
        action="store_true",
        help="report ready as soon as the model is loaded, without first running one short request through the engine (the warm-up takes the first request's one-time costs off the first client)",
    )
    server.add_argument(
        "--engine-core",
        default="process",
        choices=["process", "thread"],
        help="run the engine core in a process of its own (default), or in a thread of the server process",
    )
    ops = p.add_argument_group("logs and metrics")
    ops.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="verbosity of fastqwen's own logs (the ready line shows at every level)",
    )
    ops.add_argument(
        "--uvicorn-log-level",
        default="warning",
        choices=["debug", "info", "warning", "error"],
        help="verbosity of the HTTP server's (uvicorn's) own logs",
    )
    ops.add_argument(
        "--enable-access-log",
        action="store_true",
        help="log one line per HTTP request, except /health and /metrics polls (off by default: at hundreds of requests a second it costs throughput)",
    )
    ops.add_argument(
        "--enable-request-log",
        action="store_true",
        help="log one line per finished request: its x-request-id, finish reason, token counts, queue time, TTFT and total time",
    )
    ops.add_argument(
        "--stats-interval",
        type=float,
        default=5.0,
        help="seconds between stats lines (throughput, running, waiting, KV use, prefix-cache hit rate, preemptions) while busy; 0 = none",
    )
    ops.add_argument(
        "--disable-log-stats",
        dest="stats_interval",
        action="store_const",
        const=0.0,
        help="no stats lines (vLLM's flag; the same as --stats-interval 0)",
    )
    ops.add_argument(
        "--metrics-compat",
        default="fastqwen",
        choices=["fastqwen", "vllm"],
        help="/metrics names: fastqwen:... or vllm:... (vLLM's names and labels, so its Grafana dashboard, KEDA triggers and gateway queries work unchanged)",
    )
    limits = p.add_argument_group("server limits (what one client can take)")
    limits.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=16 * 2**20,
        help="larger request bodies get 413 before they are read",
    )
    limits.add_argument(
        "--max-sequences-per-request", type=int, default=256, help="prompts x n of one HTTP request; more get 400"
    )
    limits.add_argument(
        "--max-connections",
        type=int,
        default=2048,
        help="open HTTP connections at most; one more is answered 503 and closed",
    )
    limits.add_argument(
        "--max-connections-per-peer",
        type=int,
        default=None,
        help="open HTTP connections from one client IP address at most (loopback included); one more is answered 429 and closed, except one that asks for /health (default: --max-connections minus --reserved-connections, so that a gateway or a load generator, which send everything from one address, can use every general slot; the reserved ones still admit newcomers)",
    )
    limits.add_argument(
        "--reserved-connections",
        type=int,
        default=None,
        help="the last this many of --max-connections are kept for clients holding fewer than 2 connections and for /health, so clients that hold the rest cannot starve newcomers or the health probe (default: 1/16 of --max-connections)",
    )
    limits.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a connection may take to send a request's headers (from connecting, or from its first byte) before it is closed",
    )
    limits.add_argument(
        "--body-timeout",
        type=float,
        default=60.0,
        help="seconds a request's body may take to arrive after its headers, at most, before the connection is closed (with a 408)",
    )
    limits.add_argument(
        "--min-body-rate",
        type=float,
        default=1024.0,
        help="bytes per second a request body must average once --header-timeout seconds have passed since its headers; a slower one is answered 408 and closed",
    )
    limits.add_argument(
        "--max-header-bytes",
        type=int,
        default=16 * 1024,
        help="a request's head (request line and headers) larger than this is answered 431 and closed; at most 100 header lines are accepted",
    )
    limits.add_argument(
        "--max-log-lines-per-second",
        type=float,
        default=100.0,
        help="log lines beyond this rate are dropped (and counted), so no client can fill the disk; 0 = no limit",
    )
    args = take_model(p, p.parse_args(argv))
    if args.model is None:
        p.error("give the model to serve: MODEL or --model MODEL")
    for flag in (
        "max_request_body_bytes",
        "max_sequences_per_request",
        "max_connections",
        "max_connections_per_peer",
        "header_timeout",
        "body_timeout",
        "min_body_rate",
        "max_header_bytes",
    ):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:  # None: the default, resolved below
            p.error(f"--{flag.replace('_', '-')} must be positive")
    if args.reserved_connections is None:
        args.reserved_connections = args.max_connections // 16
    if not 0 <= args.reserved_connections < args.max_connections:
        p.error("--reserved-connections must be at least 0 and below --max-connections")
    if args.max_connections_per_peer is None:
        args.max_connections_per_peer = args.max_connections - args.reserved_connections
    if args.stats_interval < 0:
        p.error("--stats-interval must be >= 0")
    if args.engine_core == "thread" and args.data_parallel_size > 1:
        p.error("--data-parallel-size above 1 runs one engine-core process per replica: use --engine-core process")
    if args.engine_core == "thread" and (args.api_server_count or 1) > 1:  # (None: --data-parallel-size, 1 here)
        p.error("--api-server-count above 1 runs the engine core in a process of its own: use --engine-core process")
    return args


def _raise_fd_limit(needed: int) -> None:
    """Let the process hold `needed` file descriptors if the hard limit allows (connections are descriptors)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < needed:
            resource.setrlimit(
                resource.RLIMIT_NOFILE, (needed if hard == resource.RLIM_INFINITY else min(needed, hard), hard)
            )
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < needed:
            logging.getLogger("fastqwen.server").warning(
                "the file descriptor limit (%d) is below --max-connections plus headroom (%d)", soft, needed
            )
    except (ImportError, ValueError, OSError):
        pass


def _bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """The listening socket, bound as uvicorn would bind it (handed to uvicorn, which listens on it); with
    reuse_port, one of several sockets on the same port (api_servers.py)."""
    # IPPROTO_TCP named: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on connections of a socket whose proto
    # says TCP, and with it on, a stream's first event waited for the client's delayed ACK of the response headers on
    # a kept-alive connection (about 40 ms on this project's CPU machine).
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _one_line(error: BaseException) -> str:
    """An error as one line, in the command line's words where it names a knob."""
    if isinstance(error, ConfigError):
        text = f"{EngineConfig.flag(error.field)}: {error}"
    elif type(error).__name__ == "CoreStartError":  # its message already says what failed and why
        text = str(error)
    else:
        text = f"{type(error).__name__}: {error}"
    return " ".join(text.split())


def main(argv: list[str] | None = None, prog: str = "python -m fastqwen.serve") -> int:
    args = parse_args(argv, prog)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def fail(status: int, message: str) -> int:
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)  # the last line: what to fix
        return status

    try:
        # Checked here, in a second, before the engine starts: the path or hub id, config.json, the weights, the
        # tokenizer and the chat template. A hub id not in the cache is downloaded now (HF_HUB_OFFLINE=1: never).
        engine_config = model_source.resolve(EngineConfig.from_cli(args))
        # --rope-scaling applied to the model's config, and --max-model-len against the context that gives.
        context_length(
            load_model_config(engine_config.model, engine_config.rope_scaling)[0], engine_config.max_model_len
        )
        if engine_config.load_format != "dummy" and os.path.isdir(engine_config.model):
            from .weights import check_weight_files

            check_weight_files(engine_config.model)  # a corrupt file named in one line, before the engine starts
    except ConfigError as e:
        return fail(2, _one_line(e))

    # The port before the model: a port in use is found now, not after the model has loaded (uvicorn itself binds
    # only once the app's startup has run).
    try:
        listener = _bind(args.host, args.port)
    except OSError as e:
        return fail(1, f"cannot listen on {args.host}:{args.port}: {e.strerror or e} (--host, --port)")
    if engine_config.api_server_count > 1:
        from .api_servers import run_api_servers

        listener.close()  # (it proved the port free; the front ends' sockets take it now)
        return run_api_servers(args, engine_config, prog)

    def load_engine():
        from .engine.client import InProcessEngineClient
        from .engine.core_process import ProcessEngineClient
        from .engine.data_parallel import DataParallelEngineClient
        from .engine.factory import make_engine

        if args.engine_core == "thread":
            return InProcessEngineClient(make_engine(engine_config))
        if engine_config.data_parallel_size > 1:
            return DataParallelEngineClient.launch(engine_config, logging.getLogger().level)
        return ProcessEngineClient(engine_config, logging.getLogger().level)

    return serve_http(args, listener, load_engine, prog)


def serve_http(args: argparse.Namespace, listener: socket.socket, load_engine, prog: str, api_server=None) -> int:
    """Serve HTTP on `listener` until stopped; load_engine() (in a worker thread) gives the EngineClient. api_server:
    with several front ends, this process's api_servers.FrontEndRole (index, count, readiness gate)."""

    def fail(status: int, message: str) -> int:
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)  # the last line: what to fix
        return status

    import uvicorn

    from .server.app import ServerConfig, begin_shutdown, create_app, requests_in_flight, stop_now
    from .server.connections import ConnectionLimits, protocol_with
    from .server.http_conventions import configure_access_log
    from .server.log_limit import limit_log_rate

    exit_code = 0
    failure: BaseException | None = None

    def on_engine_death(error: BaseException) -> None:
        # Every request in flight has had its 503; exit non-zero so a supervisor restarts the server.
        nonlocal exit_code, failure
        logging.getLogger("fastqwen.server").critical(
            "the engine is not running (%r): shutting down with exit status 1", error
        )
        exit_code, failure = 1, error
        server.should_exit = True

    api_key = args.api_key or env.api_key()
    names = args.served_model_name or [args.model]
    host = f"[{args.host}]" if ":" in args.host else args.host
    config = ServerConfig(
        names[0],
        api_key,
        args.max_queued_requests,
        max_request_body_bytes=args.max_request_body_bytes,
        max_sequences_per_request=args.max_sequences_per_request,
        on_engine_death=on_engine_death,
        incremental_streaming_output=args.incremental_streaming_output,
        model_aliases=tuple(names[1:]),
        metrics_compat=args.metrics_compat,
        request_log=args.enable_request_log,
        stats_interval=args.stats_interval,
        allowed_origins=tuple(args.allowed_origins or ()),
        url=f"http://{host}:{args.port}",
        warmup=not args.skip_warmup,
        api_server=api_server,
    )
    app = create_app(config, load_engine)

    class Server(uvicorn.Server):
        """uvicorn's server with fastqwen's two-step stop: the first SIGINT/SIGTERM drains, a second stops now."""

        forced_by: int | None = None  # the signal that cut the drain short

        @contextlib.contextmanager
        def capture_signals(self):
            # As uvicorn's, without re-raising the signal once the server has stopped (on Ctrl-C that was a
            # KeyboardInterrupt and its traceback): main() returns the documented exit status instead.
            originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in originals.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig, frame) -> None:
            name = signal.Signals(sig).name
            if not self.should_exit:
                # From now on new requests get 503 and /health says so, while running ones drain until
                # --shutdown-timeout; then they get their 503 too.
                shutdown_logger.warning(
                    "%s: shutting down, draining %d requests, up to %g s; Ctrl-C again to stop now",
                    name,
                    requests_in_flight(app),
                    args.shutdown_timeout,
                )
                begin_shutdown(app, args.shutdown_timeout)
                self.should_exit = True
                return
            if self.forced_by is not None:
                return
            self.forced_by = sig
            shutdown_logger.warning(
                "%s again: stopping now, ending %d requests with an error", name, requests_in_flight(app)
            )
            # The streams get their error event through the normal path and the connections close by themselves;
            # uvicorn's own force (it cancels the handlers mid-write) only for a client that keeps its connection.
            stop_now(app, f"the server was stopped ({name}) before this request finished")
            loop = app.state.server.loop
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(loop.call_later, FORCED_STOP_GRACE_S, setattr, self, "force_exit", True)

        def _log_started_message(self, listeners) -> None:
            pass  # "Uvicorn running on ..." would come before the model is loaded; the app logs the ready line

    limits = ConnectionLimits(
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        min_body_rate=args.min_body_rate,
        max_connections=args.max_connections,
        max_connections_per_peer=args.max_connections_per_peer,
        reserved_connections=args.reserved_connections,
        max_header_bytes=args.max_header_bytes,
    )
    _raise_fd_limit(args.max_connections + 256)
    server = Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            http=protocol_with(limits),
            log_level=args.uvicorn_log_level,
            access_log=args.enable_access_log,
            # Past --shutdown-timeout the app ends its own requests; the grace lets those last events go out.
            timeout_graceful_shutdown=args.shutdown_timeout + 5,
            timeout_keep_alive=args.timeout_keep_alive,
        )
    )
    configure_access_log(args.enable_access_log)
    limit_log_rate(args.max_log_lines_per_second)  # after uvicorn.Config, which sets up uvicorn's log handlers
    try:
        server.run(sockets=[listener])
    except KeyboardInterrupt:  # Ctrl-C before the server took over the signals: nothing was serving yet
        return 130
    except SystemExit as e:  # uvicorn exits this way when it cannot bind (it logged why)
        return fail(
            e.code if isinstance(e.code, int) and e.code else 1,
            f"the HTTP server could not start on {host}:{args.port} (see above; --host, --port)",
        )
    if failure is not None:
        loading = app.state.server.load_error is not None
        return fail(
            exit_code, ("the model failed to load: " if loading else "the engine stopped: ") + _one_line(failure)
        )
    if server.forced_by is not None:  # 130 after a second Ctrl-C, as a shell reports an interrupted command
        shutdown_logger.warning("stopped before the drain finished")
        return 128 + server.forced_by
    if server.should_exit:
        shutdown_logger.info("shut down cleanly")
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
