"""The server when the engine loop dies: requests in flight get a 503, /health says so, and nothing hangs."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import uvicorn

from fastqwen.engine import LLMEngine
from fastqwen.server.app import ServerConfig, create_app

from checkpoints import make_checkpoint
from server_process import free_port


@pytest.fixture
def dying_server(tmp_path):
    folder = str(tmp_path)
    make_checkpoint(folder, tied=True)
    engine = LLMEngine(folder, dtype="float32", device="cpu", num_pages=64)

    def broken_step():
        raise RuntimeError("simulated CUDA failure")

    engine.step = broken_step
    app = create_app(ServerConfig("tiny"), lambda: engine)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    yield url
    server.should_exit = True
    thread.join(30)


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
