"""Load client for an OpenAI-compatible server: random token-id prompts of fixed length, fixed output length with
ignore_eos, a fixed number of requests in flight. Streams /v1/completions (or, --api generate, SGLang's /generate)
and reports request throughput, output tokens per second, and over requests the mean, median, p90, p99 and max of:

- TTFT: from sending the request to the chunk that carries its first token (a chunk may carry none);
- TPOT: (end-to-end - TTFT) / (output tokens - 1), per request, as vLLM's and SGLang's benchmarks compute it;
- chunk gap: from the first token's chunk to the last token's chunk over the tokens after the first (the figure this
  script called TPOT before: it leaves out the stream's tail after the last token);
- end-to-end latency: from sending the request to the end of its stream.

Tokens per chunk: /generate's meta_info.completion_tokens counts them; /v1/completions says nothing per chunk, so
each choice event without a finish reason counts as one token (fastqwen sends one event per token; with logprobs, the
event's logprobs.tokens), and a request whose count differs from the stream's usage.completion_tokens fails.

No inter-token latency percentiles: the server writes every update that piled up for a stream in one batch, so the
gaps between the chunks a client reads measure that write batching (many near-zero gaps, a few long ones), not the
time between tokens. TPOT over a whole request is not affected by how its tokens were grouped into writes.

    python bench/serving.py --url http://127.0.0.1:8000 --num-prompts 256 --concurrency 64 \
        --input-len 256 --output-len 128 [--shared-prefix-len 0] [--api completions|generate] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time

import httpx

# Bodies are JSON encoded before a request's clock starts (a 32k-token prompt takes 2.6 ms of json.dumps here):
# TTFT counts from the request's first byte, not from the client's encoding.
JSON_HEADERS = {"content-type": "application/json"}


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    values = sorted(values)

    def pick(q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))]

    return {
        "mean": statistics.fmean(values),
        "median": statistics.median(values),
        "p90": pick(0.9),
        "p99": pick(0.99),
        "max": values[-1],
    }


def request_metrics(start: float, chunks: list[tuple[float, int]], end: float) -> dict:
    """One request's latencies from when it was sent, when each chunk arrived with how many tokens it carried, and
    when its stream ended (seconds)."""
    with_tokens = [t for t, n in chunks if n > 0]
    tokens = sum(n for _, n in chunks)
    ttft = with_tokens[0] - start
    e2e = end - start
    return {
        "ttft": ttft,
        "tpot": (e2e - ttft) / (tokens - 1) if tokens > 1 else None,
        "chunk_gap": (with_tokens[-1] - with_tokens[0]) / (tokens - 1) if tokens > 1 else None,
        "e2e": e2e,
        "output_tokens": tokens,
    }


def tokens_in(choice: dict) -> int:
    """How many tokens a /v1/completions stream choice event carries: its logprobs' tokens where it has them, else one
    for an event without a finish reason (fastqwen sends one event per token, then one that only finishes)."""
    logprobs = choice.get("logprobs")
    return len(logprobs["tokens"]) if logprobs else int(choice.get("finish_reason") is None)


def chunk_tokens(now: float, event: dict, chunks: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """(time, tokens) for each choice of a stream event. With continuous usage stats (one choice), the tokens are what
    its usage added: a chunk may carry several tokens (speculative decoding emits runs). Without, tokens_in."""
    choices = event.get("choices") or ()
    usage = event.get("usage")
    if choices and usage and len(choices) == 1:
        return [(now, usage["completion_tokens"] - sum(n for _, n in chunks))]
    return [(now, tokens_in(choice)) for choice in choices]


async def one_request(http: httpx.AsyncClient, api: str, model: str, prompt: list[int], output_len: int) -> dict:
    try:
        if api == "generate":
            return await _stream_generate(http, prompt, output_len)
        return await _stream_completions(http, model, prompt, output_len)
    except httpx.TransportError as e:  # a dropped connection counts as a failed request, not a crashed benchmark
        return {"ok": False, "status": None, "error": repr(e)[:200]}


async def _events(response: httpx.Response):
    """The stream's JSON events, each with the time it was read."""
    async for line in response.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield time.perf_counter(), json.loads(line[6:])


async def _stream_completions(http: httpx.AsyncClient, model: str, prompt: list[int], output_len: int) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    chunks: list[tuple[float, int]] = []
    usage = None
    payload = json.dumps(body).encode()  # (encoded before the clock starts: the client's work, not the server's)
    start = time.perf_counter()
    async with http.stream("POST", "/v1/completions", content=payload, headers=JSON_HEADERS) as response:
        if response.status_code != 200:
            return {"ok": False, "status": response.status_code, "error": (await response.aread()).decode()[:200]}
        async for now, event in _events(response):
            if event.get("usage"):
                usage = event["usage"]
            chunks += chunk_tokens(now, event, chunks)
    end = time.perf_counter()
    if usage is None:
        return {"ok": False, "status": 200, "error": "no usage in the stream"}
    counted = sum(n for _, n in chunks)
    if counted == 0 or counted != usage["completion_tokens"]:
        return {
            "ok": False,
            "status": 200,
            "error": f"{counted} tokens in chunks, usage says {usage['completion_tokens']}",
        }
    return {
        "ok": True,
        **request_metrics(start, chunks, end),
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
    }


async def _stream_generate(http: httpx.AsyncClient, prompt: list[int], output_len: int) -> dict:
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True},
        "stream": True,
    }
    chunks: list[tuple[float, int]] = []
    meta = None
    payload = json.dumps(body).encode()
    start = time.perf_counter()
    async with http.stream("POST", "/generate", content=payload, headers=JSON_HEADERS) as response:
        if response.status_code != 200:
            return {"ok": False, "status": response.status_code, "error": (await response.aread()).decode()[:200]}
        async for now, event in _events(response):
            so_far = event["meta_info"]["completion_tokens"]  # cumulative
            chunks.append((now, so_far - (meta["completion_tokens"] if meta else 0)))
            meta = event["meta_info"]
    end = time.perf_counter()
    if meta is None or meta["completion_tokens"] == 0:
        return {"ok": False, "status": 200, "error": "no tokens"}
    return {
        "ok": True,
        **request_metrics(start, chunks, end),
        "prompt_tokens": meta["prompt_tokens"],
        "cached_tokens": meta["cached_tokens"],
    }


def summary(results: list[dict]) -> dict:
    """The per-request figures over the requests that completed: ms for TTFT, TPOT and chunk gap, s end-to-end."""
    ok = [r for r in results if r["ok"]]

    def over(key: str, scale: float) -> dict[str, float]:
        return {k: v * scale for k, v in percentiles([r[key] for r in ok if r[key] is not None]).items()}

    return {
        "ttft_ms": over("ttft", 1e3),
        "tpot_ms": over("tpot", 1e3),
        "chunk_gap_ms": over("chunk_gap", 1e3),
        "e2e_s": over("e2e", 1.0),
    }


async def run(args) -> dict:
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.concurrency + 8)
    async with httpx.AsyncClient(base_url=args.url, timeout=args.timeout, limits=limits) as http:
        model = args.model or (await http.get("/v1/models")).json()["data"][0]["id"]
        prefix = [rng.randrange(args.vocab) for _ in range(args.shared_prefix_len)]
        prompts = [
            prefix + [rng.randrange(args.vocab) for _ in range(args.input_len - len(prefix))]
            for _ in range(args.num_prompts)
        ]
        await one_request(http, args.api, model, prompts[0][: min(16, args.input_len)], 4)  # warm-up
        semaphore = asyncio.Semaphore(args.concurrency)

        async def limited(prompt):
            async with semaphore:
                return await one_request(http, args.api, model, prompt, args.output_len)

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        elapsed = time.perf_counter() - start
    ok = [r for r in results if r["ok"]]
    output_tokens = sum(r["output_tokens"] for r in ok)
    return {
        "model": model,
        "api": args.api,
        "num_prompts": args.num_prompts,
        "concurrency": args.concurrency,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "shared_prefix_len": args.shared_prefix_len,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.get("error", "") for r in results if not r["ok"]})[:3],
        "duration_s": elapsed,
        "request_throughput": len(ok) / elapsed,
        "output_throughput": output_tokens / elapsed,
        "total_output_tokens": output_tokens,
        "cached_prompt_tokens": sum(r["cached_tokens"] for r in ok),
        **summary(results),
        # Each completed request's own figures (seconds), in the order sent.
        "requests": [{k: r[k] for k in ("ttft", "tpot", "chunk_gap", "e2e", "output_tokens")} for r in ok],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument(
        "--api", choices=("completions", "generate"), default="completions", help="/v1/completions or /generate"
    )
    p.add_argument("--model", default=None, help="model id (default: the first from /v1/models)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--shared-prefix-len", type=int, default=0, help="the first N prompt tokens are the same in every prompt"
    )
    p.add_argument("--vocab", type=int, default=150000, help="prompt token ids are drawn from [0, vocab)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    result = asyncio.run(run(args))
    print(
        f"{result['completed']}/{args.num_prompts} ok in {result['duration_s']:.1f} s | "
        f"{result['request_throughput']:.2f} req/s | {result['output_throughput']:.0f} output tok/s\n"
        + "\n".join(
            f"{name} ms mean {result[key].get('mean', 0):.2f} median {result[key].get('median', 0):.2f} "
            f"p99 {result[key].get('p99', 0):.2f}"
            for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("chunk gap", "chunk_gap_ms"))
        )
    )
    if result["failed"]:
        print("errors:", result["errors"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
