"""Prometheus metrics with vLLM's names, labels and meanings, under the prefix `fastqwen:` by default or `vllm:` with
--metrics-compat vllm, so that vLLM's Grafana dashboard, KEDA triggers and gateway queries read them unchanged.

The few gauges that gateways route by (GATEWAY_GAUGES: queue depth, running requests, KV use, the cache's
configuration) are served under `vllm:` in either naming: SMG's load monitor, the Gateway API Inference Extension's
endpoint picker and llm-d read those names and no others, and a replica behind them should need no flag for it.

Per-request figures are observed by the server as each request's updates arrive (serving.py); engine state
(running, waiting, KV use, preemptions) is read from the engine's latest stats at scrape time. Plain running totals
are kept next to the Prometheus objects for the periodic stats line (stats_log.py). No `_created` series.

With several front-end processes (--api-server-count N) each observes its own requests, and a scrape must give the
same answer whichever process it reaches: prometheus_client's multiprocess mode, each process writing its counters
and histograms to files in the folder PROMETHEUS_MULTIPROC_DIR names (the parent makes a fresh one and removes it:
api_servers.py), and each scrape adding every process's files up; the engine gauges are read from the engine's
stats as with one process (every front end gets them with every step). Tokens held back for bulk observation
(on_tokens) are handed over every HAND_OVER_S seconds, as another process's scrape cannot ask for them.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import threading
from collections import Counter as Tally
from dataclasses import dataclass, replace

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

from .. import env

# One series per metric, not two: Prometheus computes rates from the counter itself.
prometheus_client.disable_created_metrics()

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)
_REQUEST_TIME_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
PREFIXES = {"fastqwen": "fastqwen:", "vllm": "vllm:"}
# The engine-state series a gateway reads, always also under vLLM's prefix (see the module docstring).
GATEWAY_PREFIX = PREFIXES["vllm"]
GATEWAY_GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "cache_config_info")

request_log = logging.getLogger("fastqwen.requests")


def token_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's buckets for token counts."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_value:
                return buckets
            buckets.append(value)
        scale *= 10


@dataclass
class RequestTimes:
    """When one engine request reached each stage (time.monotonic())."""

    arrival: float
    scheduled: float | None  # first admitted
    first_token: float
    finished: float


_TOKEN_OBSERVATIONS_HELD = 4096
HAND_OVER_S = 1.0  # with several front ends: how stale another process's token counts may be in a scrape


def observe_all(histogram, values: list[float]) -> None:
    """histogram.observe(v) for every v, in bulk: one bisect per value, then one addition per bucket and one to the
    sum (prometheus_client's observe walks the buckets in Python and takes a lock per value). Through the
    histogram's own observe if this prometheus_client keeps its buckets differently."""
    if not values:
        return
    try:
        bounds, buckets, total = histogram._upper_bounds, histogram._buckets, histogram._sum
    except AttributeError:
        for value in values:
            histogram.observe(value)
        return
    histogram._raise_if_not_observable()
    for index, count in Tally(bisect.bisect_left(bounds, value) for value in values).items():
        buckets[index].inc(count)  # (the first bucket whose bound the value does not exceed, as observe finds it)
    total.inc(sum(values))


@dataclass
class Totals:
    """Running totals, for the stats line (Prometheus counters are not meant to be read back)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    finished: int = 0


class Metrics:
    def __init__(
        self, model_name: str, compat: str = "fastqwen", request_log_on: bool = False, multiprocess: bool = False
    ):
        """multiprocess: one of several front-end processes (see the module's docstring)."""
        if compat not in PREFIXES:
            raise ValueError(f"metrics naming must be one of {', '.join(PREFIXES)}, not {compat!r}")
        self._scraped = None  # what a scrape reads with several front ends: every process's files
        self._hand_over_task: asyncio.Task | None = None
        if multiprocess:
            if env.metrics_folder() is None:
                raise RuntimeError("several front ends share their metrics through PROMETHEUS_MULTIPROC_DIR: not set")
            self._scraped = CollectorRegistry()
            self._files = MultiProcessCollector(self._scraped)
        self.prefix = prefix = PREFIXES[compat]
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        self.request_log_on = request_log_on
        self.totals = Totals()
        self._lock = threading.Lock()  # totals are added to on the event loop and read by the stats line
        self._gaps: list[float] = []  # token gaps and tokens not yet handed to Prometheus (on_tokens)
        self._tokens_held = 0
        labels = ["model_name"]

        def counter(name, doc):
            return Counter(prefix + name, doc, labels, registry=r).labels(model_name)

        def histogram(name, doc, buckets=_LATENCY_BUCKETS):
            return Histogram(prefix + name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.aborted = counter("num_aborted_requests", "Requests aborted before they finished (disconnects).")
        self._success = Counter(
            prefix + "request_success", "Finished requests by finish reason.", labels + ["finished_reason"], registry=r
        )
        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens of a request.")
        # vLLM's older name for the same per-token gaps, which its Grafana dashboard still charts.
        self.tpot = histogram("time_per_output_token_seconds", "Time between consecutive tokens of a request.")
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Time from arrival to the last token.", _REQUEST_TIME_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds", "Time from arrival to first admission.", _REQUEST_TIME_BUCKETS
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "Time from first admission to the first token.", _REQUEST_TIME_BUCKETS
        )
        self.decode_time = histogram(
            "request_decode_time_seconds", "Time from the first token to the last.", _REQUEST_TIME_BUCKETS
        )
        self.inference_time = histogram(
            "request_inference_time_seconds", "Time from first admission to the last token.", _REQUEST_TIME_BUCKETS
        )
        self.request_tpot = histogram(
            "request_time_per_output_token_seconds",
            "Mean time per output token of each request (decode time / (output tokens - 1)).",
        )
        # Token-count histograms need the context length for their buckets: made in bind(), once the model is loaded.
        self.request_prompt_tokens = self.request_generation_tokens = self.request_max_tokens = None
        self.request_max_num_generation_tokens = self.iteration_tokens = None
        self._engine_state = None

    def bind(self, async_engine) -> None:
        """Once the model is loaded: the token-count histograms, and the engine's state read at each scrape (current
        even while the engine is idle)."""
        info = async_engine.client.info
        buckets = token_buckets(info.max_model_len)

        def tokens(name, doc, bucket_values=buckets):
            return Histogram(
                self.prefix + name, doc, ["model_name"], buckets=bucket_values, registry=self.registry
            ).labels(self.model_name)

        self.request_prompt_tokens = tokens("request_prompt_tokens", "Prompt tokens of each finished request.")
        self.request_generation_tokens = tokens(
            "request_generation_tokens", "Generated tokens of each finished request."
        )
        self.request_max_tokens = tokens("request_params_max_tokens", "max_tokens of each finished request.")
        self.request_max_num_generation_tokens = tokens(
            "request_max_num_generation_tokens", "Most tokens a finished request could have generated (its max_tokens)."
        )
        self.iteration_tokens = tokens(
            "iteration_tokens_total",
            "Tokens computed in each engine step (prefill and decode).",
            token_buckets(max(info.max_model_len, 8192)),
        )
        self._engine_state = _EngineState(self.prefix, self.model_name, async_engine.client)
        self.registry.register(self._engine_state)
        if self._scraped is not None:
            self._scraped.register(self._engine_state)

    def start_hand_over(self) -> None:
        """With several front ends, on the event loop: hand held tokens over every HAND_OVER_S seconds."""

        async def every_interval() -> None:
            while True:
                await asyncio.sleep(HAND_OVER_S)
                self._hand_over_tokens()

        self._hand_over_task = asyncio.get_running_loop().create_task(every_interval())

    # ---- observations -----------------------------------------------------------------------------------------

    def on_first_token(self, request, ttft: float) -> None:
        """request: the frontend's RequestTracker."""
        self.ttft.observe(ttft)
        self.prompt_tokens.inc(request.num_prompt_tokens)
        with self._lock:
            self.totals.prompt_tokens += request.num_prompt_tokens
        if request.first_scheduled_time is not None:
            self.queue_time.observe(request.first_scheduled_time - request.arrival_time)

    def on_prefix_lookup(self, queried: int, hit: int) -> None:
        self.prefix_queries.inc(queried)
        self.prefix_hits.inc(hit)
        with self._lock:
            self.totals.prefix_queries += queried
            self.totals.prefix_hits += hit

    def on_tokens(self, count: int, gap: float | None) -> None:
        """count new tokens of a request, `gap` seconds after its previous ones (None for its first).

        Called on the event loop for every update of every stream: the gaps and the count are kept here and handed
        to Prometheus in bulk (at each scrape, and every _TOKEN_OBSERVATIONS_HELD gaps), which costs a tenth of
        observing each gap in two histograms as it comes."""
        if gap is not None:
            self._gaps.append(gap)
            if len(self._gaps) >= _TOKEN_OBSERVATIONS_HELD:
                self._hand_over_tokens()
        self._tokens_held += count
        with self._lock:
            self.totals.generation_tokens += count

    def _hand_over_tokens(self) -> None:
        gaps, self._gaps = self._gaps, []
        count, self._tokens_held = self._tokens_held, 0
        if count:
            self.generation_tokens.inc(count)
        observe_all(self.itl, gaps)
        observe_all(self.tpot, gaps)

    def on_step(self, num_tokens: int) -> None:
        if self.iteration_tokens is not None and num_tokens:
            self.iteration_tokens.observe(num_tokens)

    def on_request_finished(self, request, output, times: RequestTimes, request_id: str | None = None) -> None:
        """request: the RequestTracker; output: its RequestOutput; request_id: the HTTP request's x-request-id."""
        self.e2e.observe(times.finished - times.arrival)
        self._success.labels(self.model_name, output.finish_reason).inc()
        start = times.scheduled if times.scheduled is not None else times.arrival
        self.prefill_time.observe(max(0.0, times.first_token - start))
        self.decode_time.observe(times.finished - times.first_token)
        self.inference_time.observe(times.finished - start)
        if output.num_completion_tokens > 1:
            self.request_tpot.observe((times.finished - times.first_token) / (output.num_completion_tokens - 1))
        if self.request_prompt_tokens is not None:
            self.request_prompt_tokens.observe(output.num_prompt_tokens)
            self.request_generation_tokens.observe(output.num_completion_tokens)
            max_tokens = request.request.params.max_tokens or 0
            self.request_max_tokens.observe(max_tokens)
            self.request_max_num_generation_tokens.observe(max_tokens)
        with self._lock:
            self.totals.finished += 1
        if self.request_log_on:
            request_log.info(
                "request %s%s: %s, prompt %d tokens (%d cached), output %d tokens, queue %.1f ms, TTFT %.1f ms, "
                "total %.3f s",
                request.rid,
                f" (x-request-id {request_id})" if request_id else "",
                output.finish_reason,
                output.num_prompt_tokens,
                output.num_cached_tokens,
                output.num_completion_tokens,
                1000 * ((times.scheduled or times.arrival) - times.arrival),
                1000 * (times.first_token - times.arrival),
                times.finished - times.arrival,
            )

    def on_abort(self) -> None:
        self.aborted.inc()

    def render(self) -> bytes:
        self._hand_over_tokens()
        return generate_latest(self.registry if self._scraped is None else self._scraped)

    def totals_now(self) -> Totals:
        """The running totals (of every front end's requests, with several)."""
        if self._scraped is None:
            with self._lock:
                return replace(self.totals)
        sums: Tally = Tally()
        for family in self._files.collect():
            for sample in family.samples:
                sums[sample.name] += sample.value
        p = self.prefix
        return Totals(
            prompt_tokens=int(sums[p + "prompt_tokens_total"]),
            generation_tokens=int(sums[p + "generation_tokens_total"]),
            prefix_queries=int(sums[p + "prefix_cache_queries_total"]),
            prefix_hits=int(sums[p + "prefix_cache_hits_total"]),
            finished=int(sums[p + "request_success_total"]),
        )


class _EngineState:
    """A collector that reads the engine's latest stats at scrape time: one series per engine, labelled `engine` as
    vLLM labels them ("0", and "1".. for data-parallel replicas)."""

    def __init__(self, prefix: str, model_name: str, client):
        self.prefix, self.model_name, self.client = prefix, model_name, client

    def collect(self):
        for family in self._families():
            yield family
            if self.prefix != GATEWAY_PREFIX and family.name.removeprefix(self.prefix) in GATEWAY_GAUGES:
                yield _renamed(family, GATEWAY_PREFIX + family.name.removeprefix(self.prefix))

    def _families(self):
        engines, p, labels = self.client.per_engine(), self.prefix, ["model_name", "engine"]

        def per_engine(family, value):
            for index, (info, stats) in enumerate(engines):
                family.add_metric([self.model_name, str(index)], value(info, stats))
            return family

        def gauge(metric, doc, value):
            return per_engine(GaugeMetricFamily(p + metric, doc, labels=labels), value)

        yield gauge("num_requests_running", "Requests holding KV pages and computing.", lambda i, s: s.num_running)
        yield gauge("num_requests_waiting", "Requests queued for admission.", lambda i, s: s.num_waiting)
        usage_doc = "Fraction of KV pages held by requests (0 to 1); pages only the prefix cache holds count as free."
        yield gauge("kv_cache_usage_perc", usage_doc, lambda i, s: s.kv_usage)
        yield gauge("gpu_cache_usage_perc", usage_doc + " (vLLM's older name)", lambda i, s: s.kv_usage)
        preemptions_doc = "Requests preempted (their pages released, to be recomputed)."
        yield per_engine(
            CounterMetricFamily(p + "num_preemptions", preemptions_doc, labels=labels), lambda i, s: s.num_preemptions
        )
        if engines[0][1].spec_accepted_per_position:  # speculative decoding is on: vLLM's spec_decode counters
            for metric, doc, field in (
                ("spec_decode_num_drafts", "Verify steps of one request with a draft.", "spec_num_drafts"),
                ("spec_decode_num_draft_tokens", "Draft tokens proposed.", "spec_num_draft_tokens"),
                ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", "spec_num_accepted_tokens"),
            ):
                family = CounterMetricFamily(p + metric, doc, labels=labels)
                yield per_engine(family, lambda i, s, field=field: getattr(s, field))
            per_position = CounterMetricFamily(
                p + "spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens accepted at each draft position.",
                labels=[*labels, "position"],
            )
            for index, (_, stats) in enumerate(engines):
                for position, value in enumerate(stats.spec_accepted_per_position):
                    per_position.add_metric([self.model_name, str(index), str(position)], value)
            yield per_position
        config_labels = ["block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching", "engine"]
        config = GaugeMetricFamily(
            p + "cache_config_info", "The KV cache's configuration, in its labels.", labels=config_labels
        )
        for index, (info, _) in enumerate(engines):
            config.add_metric(
                [str(info.page_size), str(info.num_pages), info.dtype, str(info.prefix_caching), str(index)], 1
            )
        yield config


def _renamed(family: Metric, name: str) -> Metric:
    """The same series under another name (a gauge's samples are named as the family is)."""
    alias = Metric(name, family.documentation, family.type)
    alias.samples = [sample._replace(name=name) for sample in family.samples]
    return alias
