"""python -m fastqwen.serve --model PATH_OR_PRESET: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import logging
import sys

from . import env
from .config import ConfigError, EngineConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m fastqwen.serve",
        description="Serve a Qwen3 model over an OpenAI-compatible HTTP API (plus SGLang's /generate).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    EngineConfig.add_cli_arguments(p)
    server = p.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    server.add_argument("--port", type=int, default=8000, help="port to listen on")
    server.add_argument("--served-model-name", default=None, help="the model id clients send and /v1/models lists (default: --model)")
    server.add_argument("--max-queued-requests", type=int, default=None, help="waiting requests beyond this get 503 with Retry-After (default: no limit)")
    server.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on the API (or set FASTQWEN_API_KEY)")
    server.add_argument("--timeout-keep-alive", type=int, default=75, help="seconds an idle HTTP connection is kept open; longer than clients' own pool expiry (httpx: 5 s), so the client, not the server, closes it and never sends a request on a connection the server is closing")
    server.add_argument("--shutdown-timeout", type=float, default=30.0, help="on SIGTERM, seconds running requests may take to finish; then each gets a 503 (streams: an error event and [DONE])")
    server.add_argument("--incremental-streaming-output", action="store_true", help="/generate streams send only the new text and output ids in each event (SGLang's flag); by default each event carries the whole output so far, as SGLang's clients expect")
    server.add_argument("--enable-access-log", action="store_true", help="log one line per HTTP request (off by default: at hundreds of requests a second it costs throughput, and every /health poll is a line)")
    server.add_argument("--engine-core", default="process", choices=["process", "thread"], help="run the engine core in a process of its own (default), or in a thread of the server process")
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log verbosity")
    limits = p.add_argument_group("server limits (what one client can take)")
    limits.add_argument("--max-request-body-bytes", type=int, default=16 * 2**20, help="larger request bodies get 413 before they are read")
    limits.add_argument("--max-sequences-per-request", type=int, default=256, help="prompts x n of one HTTP request; more get 400")
    limits.add_argument("--max-connections", type=int, default=2048, help="open HTTP connections at most; one more is answered 503 and closed")
    limits.add_argument("--header-timeout", type=float, default=10.0, help="seconds a connection may take to send a request's headers (from connecting, or from its first byte) before it is closed")
    limits.add_argument("--body-timeout", type=float, default=60.0, help="seconds a request's body may take to arrive after its headers before the connection is closed")
    limits.add_argument("--max-log-lines-per-second", type=float, default=100.0, help="log lines beyond this rate are dropped (and counted), so no client can fill the disk; 0 = no limit")
    args = p.parse_args(argv)
    for flag in ("max_request_body_bytes", "max_sequences_per_request", "max_connections", "header_timeout", "body_timeout"):
        if getattr(args, flag) <= 0:
            p.error(f"--{flag.replace('_', '-')} must be positive")
    return args


def _raise_fd_limit(needed: int) -> None:
    """Let the process hold `needed` file descriptors if the hard limit allows (connections are descriptors)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < needed:
            resource.setrlimit(resource.RLIMIT_NOFILE, (needed if hard == resource.RLIM_INFINITY else min(needed, hard), hard))
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < needed:
            logging.getLogger("fastqwen.server").warning(
                "the file descriptor limit (%d) is below --max-connections plus headroom (%d)", soft, needed)
    except (ImportError, ValueError, OSError):
        pass


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    from .engine.client import InProcessEngineClient
    from .engine.core_process import ProcessEngineClient
    from .engine.tensor_parallel import make_engine
    from .server.app import ServerConfig, begin_shutdown, create_app
    from .server.connections import ConnectionLimits, protocol_with
    from .server.log_limit import limit_log_rate

    try:
        engine_config = EngineConfig.from_cli(args)
    except ConfigError as e:  # said in the command line's words
        print(f"python -m fastqwen.serve: error: {EngineConfig.flag(e.field)}: {e}", file=sys.stderr)
        return 2

    def load_engine() -> InProcessEngineClient | ProcessEngineClient:
        if args.engine_core == "thread":
            return InProcessEngineClient(make_engine(engine_config))
        return ProcessEngineClient(engine_config, logging.getLogger().level)

    exit_code = 0

    def on_engine_death(error: BaseException) -> None:
        # Every request in flight has had its 503; exit non-zero so a supervisor restarts the server.
        nonlocal exit_code
        logging.getLogger("fastqwen.server").critical("the engine is not running (%r): shutting down with exit status 1", error)
        exit_code = 1
        server.should_exit = True

    api_key = args.api_key or env.api_key()
    config = ServerConfig(
        args.served_model_name or args.model, api_key, args.max_queued_requests,
        max_request_body_bytes=args.max_request_body_bytes, max_sequences_per_request=args.max_sequences_per_request,
        on_engine_death=on_engine_death, incremental_streaming_output=args.incremental_streaming_output,
    )  # fmt: skip
    app = create_app(config, load_engine)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # From the first SIGTERM/SIGINT on, new requests get 503 and /health says so, while running ones drain
            # until --shutdown-timeout; then they get their 503 too.
            begin_shutdown(app, args.shutdown_timeout)
            super().handle_exit(sig, frame)

    limits = ConnectionLimits(args.header_timeout, args.body_timeout, args.max_connections)
    _raise_fd_limit(args.max_connections + 256)
    server = Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            http=protocol_with(limits),
            log_level=args.log_level,
            access_log=args.enable_access_log,
            # Past --shutdown-timeout the app ends its own requests; the grace lets those last events go out.
            timeout_graceful_shutdown=args.shutdown_timeout + 5,
            timeout_keep_alive=args.timeout_keep_alive,
        )
    )
    limit_log_rate(args.max_log_lines_per_second)  # after uvicorn.Config, which sets up uvicorn's log handlers
    server.run()
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
