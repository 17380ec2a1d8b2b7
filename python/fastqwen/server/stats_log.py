"""The periodic stats line: every --stats-interval seconds while the server is busy, throughput and queue state in
one line, as vLLM and SGLang print it."""

from __future__ import annotations

import asyncio
import logging
import time

from .metrics import Metrics, Totals

logger = logging.getLogger("fastqwen.stats")


def stats_line(before: Totals, after: Totals, seconds: float, stats, preemptions_before: int) -> str:
    """One line from the totals at the start and end of an interval and the engine's stats at its end."""
    queried = after.prefix_queries - before.prefix_queries
    hit_rate = f"{100 * (after.prefix_hits - before.prefix_hits) / queried:.1f}%" if queried else "-"
    spec = ""
    if stats.spec_accepted_per_position:  # speculative decoding is on
        drafts = stats.spec_num_drafts
        length = f"{1 + stats.spec_num_accepted_tokens / drafts:.2f}" if drafts else "-"
        spec = f", speculative acceptance length {length} since start"
    return (
        f"prompt {(after.prompt_tokens - before.prompt_tokens) / seconds:,.1f} tok/s, generation "
        f"{(after.generation_tokens - before.generation_tokens) / seconds:,.1f} tok/s, running {stats.num_running}, "
        f"waiting {stats.num_waiting}, KV cache {100 * stats.kv_usage:.1f}% used, prefix cache hit rate {hit_rate}, "
        f"preemptions {stats.num_preemptions - preemptions_before}, finished {after.finished - before.finished}" + spec
    )


async def log_stats(metrics: Metrics, stats_of, interval: float) -> None:
    """Runs until cancelled. stats_of(): the engine's current EngineStats. Silent while idle: an interval is logged
    when requests are running or waiting at its end, or when some finished or made progress during it."""
    before, preemptions, last = metrics.totals_now(), stats_of().num_preemptions, time.monotonic()
    while True:
        await asyncio.sleep(interval)
        now, stats = time.monotonic(), stats_of()
        after = metrics.totals_now()
        if stats.num_running > 0 or stats.num_waiting > 0 or after != before:
            logger.info("%s", stats_line(before, after, now - last, stats, preemptions))
        before, preemptions, last = after, stats.num_preemptions, now
