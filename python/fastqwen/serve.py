"""python -m fastqwen.serve --model PATH_OR_PRESET: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .config import PRESETS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m fastqwen.serve",
        description="Serve a Qwen3 model over an OpenAI-compatible HTTP API (plus SGLang's /generate).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", required=True, help=f"checkpoint folder, config.json, or a preset ({', '.join(PRESETS)}) with --load-format dummy")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--served-model-name", default=None, help="the model id clients send and /v1/models lists (default: --model)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"], help="weight and KV dtype; auto = the checkpoint's")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"], help="dummy = random weights with the model's shapes")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (a power of two)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most requests running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="token budget of one step; longer prompts are prefilled in chunks")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--kv-cache-memory-fraction", type=float, default=0.85, help="on GPU: fraction of the memory left after the weights that the KV cache and activations may use")
    p.add_argument("--num-pages", type=int, default=None, help="KV pages to allocate, overriding --kv-cache-memory-fraction")
    p.add_argument("--max-queued-requests", type=int, default=None, help="waiting requests beyond this get 503 with Retry-After (default: no limit)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on the API (or set FASTQWEN_API_KEY)")
    p.add_argument("--timeout-keep-alive", type=int, default=75, help="seconds an idle HTTP connection is kept open; longer than clients' own pool expiry (httpx: 5 s), so the client, not the server, closes it and never sends a request on a connection the server is closing")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, help="on SIGTERM, seconds running requests may take to finish before they are aborted")
    p.add_argument("--disable-radix-cache", action="store_true", help="turn off the prefix cache (KV reuse across requests sharing a prefix)")
    p.add_argument("--disable-cuda-graph", action="store_true", help="run decode steps eagerly instead of replaying captured CUDA graphs")
    p.add_argument("--cuda-graph-max-bs", type=int, default=256, help="largest decode batch captured in a CUDA graph (capped by --max-num-seqs); larger batches run eagerly")
    p.add_argument("--disable-overlap-schedule", action="store_true", help="record each decode step before launching the next (by default the next one runs on the GPU while the host records the last)")
    p.add_argument("--seed", type=int, default=0, help="seed of the engine's sampler for unseeded requests")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log verbosity")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    from .engine import LLMEngine
    from .server.app import ServerConfig, create_app

    def load_engine() -> LLMEngine:
        return LLMEngine(
            args.model,
            dtype=args.dtype,
            device=args.device,
            page_size=args.page_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            num_pages=args.num_pages,
            max_model_len=args.max_model_len,
            load_format=args.load_format,
            gpu_memory_utilization=args.kv_cache_memory_fraction,
            seed=args.seed,
            enable_prefix_caching=not args.disable_radix_cache,
            disable_cuda_graph=args.disable_cuda_graph,
            cuda_graph_max_bs=args.cuda_graph_max_bs,
            disable_overlap_schedule=args.disable_overlap_schedule,
        )

    api_key = args.api_key or os.environ.get("FASTQWEN_API_KEY")
    config = ServerConfig(args.served_model_name or args.model, api_key, args.max_queued_requests)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
