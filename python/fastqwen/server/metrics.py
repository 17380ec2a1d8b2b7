"""Prometheus metrics, named like vLLM's (prefix fastqwen:) so existing dashboards map over."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name, doc):
            return Gauge(f"fastqwen:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(f"fastqwen:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name, doc):
            return Histogram(f"fastqwen:{name}", doc, labels, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "Requests holding KV pages and computing.")
        self.waiting = gauge("num_requests_waiting", "Requests queued for admission.")
        self.kv_usage = gauge(
            "kv_cache_usage_perc",
            "Fraction of KV pages held by requests (0 to 1); pages only the prefix cache holds count as free.",
        )
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.aborted = counter("num_aborted_requests", "Requests aborted before they finished (disconnects).")
        self._success = Counter(
            "fastqwen:request_success", "Finished requests by finish reason.", labels + ["finished_reason"], registry=r
        )
        self._model_name = model_name
        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens of a request.")
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last token.")
        self.queue_time = histogram("request_queue_time_seconds", "Time from arrival to first admission.")

    def bind(self, async_engine) -> None:
        """Gauges read the engine's state when scraped, so they are current even while the engine is idle."""
        client = async_engine.client
        self.running.set_function(lambda: client.stats().num_running)
        self.waiting.set_function(lambda: client.stats().num_waiting)
        self.kv_usage.set_function(lambda: client.stats().kv_usage)

    def on_abort(self) -> None:
        self.aborted.inc()

    def on_finish(self, finish_reason: str) -> None:
        self._success.labels(self._model_name, finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
