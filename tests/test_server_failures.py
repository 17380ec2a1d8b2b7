"""The server when the engine loop dies: requests in flight get a 503, /health says so, and nothing hangs. And the
warm-up request a server runs before it reports ready."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import uvicorn
from checkpoints import make_checkpoint
from fastqwen.engine.client import InProcessEngineClient
from fastqwen.engine.llm_engine import LLMEngine
from fastqwen.server.app import WARMUP_PROMPT, WARMUP_TOKENS, ServerConfig, create_app
from server_process import free_port


class InProcessServer:
    """The app under uvicorn in a thread of the test process, so a test can hand it a doctored engine. No warm-up
    request unless asked: the doctored engines here fail on the tests' own requests."""

    def __init__(self, load_engine, warmup: bool = False):
        app = create_app(ServerConfig("tiny", warmup=warmup), load_engine)
        self.url = f"http://127.0.0.1:{free_port()}"
        port = int(self.url.rsplit(":", 1)[1])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # listening (the model may still be loading)
            try:
                httpx.get(self.url + "/health")
                return
            except httpx.HTTPError:
                time.sleep(0.05)

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and httpx.get(self.url + "/health").status_code != 200:
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture
def tiny_engine(tmp_path):
    folder = str(tmp_path)
    make_checkpoint(folder, tied=True)
    return LLMEngine(folder, dtype="float32", device="cpu", num_pages=64)


@pytest.fixture
def dying_server(tiny_engine):
    def broken_step():
        raise RuntimeError("simulated CUDA failure")

    tiny_engine.step = broken_step
    server = InProcessServer(lambda: InProcessEngineClient(tiny_engine))
    server.wait_healthy()
    yield server.url
    server.stop()


def test_health_and_api_answer_503_while_loading(tiny_engine):
    loaded = threading.Event()

    def slow_load():
        loaded.wait(30)
        return InProcessEngineClient(tiny_engine)

    server = InProcessServer(slow_load)
    try:
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "loading"
        early = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert early.status_code == 503 and "Retry-After" in early.headers
        loaded.set()
        server.wait_healthy()
        body = {"prompt": [1, 2], "max_tokens": 2, "ignore_eos": True}
        ok = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    finally:
        loaded.set()
        server.stop()


def test_engine_death_is_reported_not_hung(dying_server):
    url = dying_server
    response = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4}, timeout=30)
    assert response.status_code == 503
    assert "engine" in response.json()["error"]["message"]
    health = httpx.get(url + "/health")
    assert health.status_code == 503 and health.json()["status"] == "engine dead"
    again = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4}, timeout=30)
    assert again.status_code == 503


def test_engine_death_mid_stream_ends_the_stream_with_an_error_event(dying_server):
    body = {"prompt": [1, 2, 3], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", dying_server + "/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert '"error"' in events[-2] and '"code":503' in events[-2]


def test_warm_up_runs_before_ready_and_stays_out_of_the_metrics(tiny_engine):
    """The server reports ready only after one short request has run through the whole engine path; that request is
    not a client's: /metrics counts none of its tokens. A client's request then runs as usual."""
    added = []
    add = tiny_engine.add
    tiny_engine.add = lambda request: (added.append(request), add(request))[1]
    loaded = threading.Event()

    def load():
        loaded.wait(30)
        return InProcessEngineClient(tiny_engine)

    server = InProcessServer(load, warmup=True)
    try:
        assert httpx.get(server.url + "/health").status_code == 503
        loaded.set()
        server.wait_healthy()
        assert httpx.get(server.url + "/health").status_code == 200
        assert len(added) == 1
        assert list(added[0].prompt_ids) == WARMUP_PROMPT and added[0].params.max_tokens == WARMUP_TOKENS
        assert not tiny_engine.has_unfinished()  # it ran to its end before the server said ready
        metrics = httpx.get(server.url + "/metrics").text
        counted = [
            line
            for line in metrics.splitlines()
            if line.startswith(("fastqwen:generation_tokens_total{", "fastqwen:iteration_tokens_total_count{"))
        ]
        assert len(counted) == 2 and all(float(line.rsplit(" ", 1)[1]) == 0.0 for line in counted), counted
        body = {"prompt": [1, 2], "max_tokens": 3, "ignore_eos": True}
        ok = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        assert len(added) == 2
    finally:
        loaded.set()
        server.stop()


def test_a_failed_warm_up_leaves_the_server_up_reporting_the_dead_engine(tiny_engine):
    def broken_step():
        raise RuntimeError("simulated CUDA failure")

    tiny_engine.step = broken_step
    server = InProcessServer(lambda: InProcessEngineClient(tiny_engine), warmup=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and httpx.get(server.url + "/health").json()["status"] == "loading":
            time.sleep(0.05)
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "engine dead"
        response = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4}, timeout=30)
        assert response.status_code == 503 and "engine" in response.json()["error"]["message"]
    finally:
        server.stop()
