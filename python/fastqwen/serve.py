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
    server.add_argument("--shutdown-timeout", type=float, default=30.0, help="on SIGTERM, seconds running requests may take to finish before they are aborted")
    server.add_argument("--engine-core", default="process", choices=["process", "thread"], help="run the engine core in a process of its own (default), or in a thread of the server process")
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log verbosity")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    from .engine import LLMEngine
    from .engine.client import InProcessEngineClient
    from .engine.core_process import ProcessEngineClient
    from .server.app import ServerConfig, create_app

    try:
        engine_config = EngineConfig.from_cli(args)
    except ConfigError as e:  # said in the command line's words
        print(f"python -m fastqwen.serve: error: {EngineConfig.flag(e.field)}: {e}", file=sys.stderr)
        return 2

    def load_engine() -> InProcessEngineClient | ProcessEngineClient:
        if args.engine_core == "thread":
            return InProcessEngineClient(LLMEngine(engine_config))
        return ProcessEngineClient(engine_config, logging.getLogger().level)

    api_key = args.api_key or env.api_key()
    fatal = []

    def on_fatal() -> None:  # the model did not load, or the engine died: stop serving, exit non-zero
        fatal.append(True)
        server.should_exit = True

    config = ServerConfig(args.served_model_name or args.model, api_key, args.max_queued_requests, on_fatal)
    app = create_app(config, load_engine)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # From the first SIGTERM/SIGINT on, new requests get 503 and /health says so, while running ones drain.
            app.state.server.draining = True
            super().handle_exit(sig, frame)

    server = Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=args.shutdown_timeout,
            timeout_keep_alive=args.timeout_keep_alive,
        )
    )
    server.run()
    if fatal:
        logging.getLogger("fastqwen.server").error("exiting: the engine is not running")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
