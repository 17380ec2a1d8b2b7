"""Load client for an OpenAI-compatible server: random token-id prompts of fixed length, fixed output length with
ignore_eos, a fixed number of requests in flight. Streams /v1/completions and reports request throughput, output
tokens per second, and percentiles over requests of time to first token (first chunk that carries choices), time per
output token (TPOT: from the first token to the last, divided by the tokens after the first) and end-to-end latency.

No inter-token latency percentiles: the server writes every update that piled up for a stream in one batch, so the
gaps between the chunks a client reads measure that write batching (many near-zero gaps, a few long ones), not the
time between tokens. TPOT over a whole request is not affected by how its tokens were grouped into writes.

    python bench/serving.py --url http://127.0.0.1:8000 --num-prompts 256 --concurrency 64 \
        --input-len 256 --output-len 128 [--shared-prefix-len 0] [--json out.json]
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


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    values = sorted(values)

    def pick(q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))]

    return {"mean": statistics.fmean(values), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": values[-1]}


async def one_request(http: httpx.AsyncClient, model: str, prompt: list[int], output_len: int) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        return await _stream(http, body)
    except httpx.TransportError as e:  # a dropped connection counts as a failed request, not a crashed benchmark
        return {"ok": False, "status": None, "error": repr(e)[:200]}


async def _stream(http: httpx.AsyncClient, body: dict) -> dict:
    start = time.perf_counter()
    token_times: list[float] = []
    usage = None
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return {"ok": False, "status": response.status_code, "error": (await response.aread()).decode()[:200]}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            if event.get("choices") and event["choices"][0].get("finish_reason") is None:
                token_times.append(time.perf_counter())
    end = time.perf_counter()
    if not token_times or usage is None:
        return {"ok": False, "status": 200, "error": "no tokens or no usage"}
    tokens = usage["completion_tokens"]
    return {
        "ok": True,
        "ttft": token_times[0] - start,
        "tpot": (token_times[-1] - token_times[0]) / (tokens - 1) if tokens > 1 else None,
        "e2e": end - start,
        "output_tokens": usage["completion_tokens"],
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
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
        await one_request(http, model, prompts[0][: min(16, args.input_len)], 4)  # warm-up
        semaphore = asyncio.Semaphore(args.concurrency)

        async def limited(prompt):
            async with semaphore:
                return await one_request(http, model, prompt, args.output_len)

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        elapsed = time.perf_counter() - start
    ok = [r for r in results if r["ok"]]
    output_tokens = sum(r["output_tokens"] for r in ok)
    return {
        "model": model,
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
        "ttft_ms": {k: v * 1e3 for k, v in percentiles([r["ttft"] for r in ok]).items()},
        "tpot_ms": {k: v * 1e3 for k, v in percentiles([r["tpot"] for r in ok if r["tpot"] is not None]).items()},
        "e2e_s": percentiles([r["e2e"] for r in ok]),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
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
        f"TTFT ms p50 {result['ttft_ms'].get('p50', 0):.1f} p90 {result['ttft_ms'].get('p90', 0):.1f} p99 {result['ttft_ms'].get('p99', 0):.1f} | "
        f"TPOT ms mean {result['tpot_ms'].get('mean', 0):.2f} p50 {result['tpot_ms'].get('p50', 0):.2f} p99 {result['tpot_ms'].get('p99', 0):.2f}"
    )
    if result["failed"]:
        print("errors:", result["errors"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
