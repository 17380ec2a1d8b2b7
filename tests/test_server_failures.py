"""The server when the engine loop dies: requests in flight get a 503, /health says so, and nothing hangs."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import uvicorn

from fastqwen.engine import LLMEngine
from fastqwen.engine.client import InProcessEngineClient
from fastqwen.server.app import ServerConfig, create_app

from checkpoints import make_checkpoint
from server_process import free_port


class InProcessServer:
    """The app under uvicorn in a thread of the test process, so a test can hand it a doctored engine."""

    def __init__(self, load_engine):
        app = create_app(ServerConfig("tiny"), load_engine)
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
