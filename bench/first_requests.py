"""The first requests a freshly started server answers: each streams a completion after the one before it ends, and
the script prints its time to first token, its median gap between tokens and its longest gap (with the token it came
before). A stall that only a fresh server has shows as a longest gap far above the median in the first request.

    python bench/first_requests.py --url http://127.0.0.1:8000 [--requests 5] [--prompt-len 128] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys

import httpx
from latency import stream_stamps


def stream_one(client: httpx.Client, url: str, prompt: list[int], new_tokens: int) -> dict:
    start, stamps = stream_stamps(client, url, prompt, new_tokens)
    gaps = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]
    longest = max(range(len(gaps)), key=gaps.__getitem__) if gaps else None
    return {
        "ttft_ms": round((stamps[0] - start) * 1e3, 2),
        "chunks": len(stamps),
        "median_gap_ms": round(statistics.median(gaps), 3) if gaps else None,
        "mean_gap_ms": round(statistics.fmean(gaps), 3) if gaps else None,
        "longest_gap_ms": round(gaps[longest], 2) if gaps else None,
        "longest_gap_before_chunk": longest + 1 if gaps else None,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--vocab", type=int, default=150000, help="prompt token ids are drawn below this")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rng = random.Random(0)
    rows = []
    with httpx.Client(timeout=600) as client:
        for i in range(args.requests):
            prompt = [rng.randrange(args.vocab) for _ in range(args.prompt_len)]
            rows.append({"request": i, **stream_one(client, args.url, prompt, args.new_tokens)})
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"url": args.url, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
