"""Failing loudly instead of serving on: a GPU without the CUDA kernels refuses to start unless the reference path is
asked for, and a KV ownership violation found while idle takes the server out of service (CPU tests: the "has
kernels" probe is forced off, the allocator corrupted by hand)."""

from __future__ import annotations

import logging
import time

import pytest
from checkpoints import make_checkpoint
from fastapi.testclient import TestClient
from fastqwen import LLM
from fastqwen.engine import llm_engine
from fastqwen.engine.client import InProcessEngineClient
from fastqwen.engine.llm_engine import LLMEngine
from fastqwen.ops import _native
from fastqwen.server.app import ServerConfig, create_app


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("service"))
    make_checkpoint(path, tied=True)
    return path


@pytest.fixture
def no_kernels(monkeypatch):
    """A native module built without the CUDA kernels, and no request for the reference path in the environment."""
    monkeypatch.setattr(_native, "_has_cuda", False)
    monkeypatch.delenv("FASTQWEN_ALLOW_REFERENCE_ON_GPU", raising=False)
    monkeypatch.delenv("FASTQWEN_DISABLE_CUDA_KERNELS", raising=False)


class CheckPassed(Exception):
    """Raised by the first step after the kernel check, so an allowed start stops there (no GPU here)."""


def wait_for(client: TestClient, status: int, seconds: float = 30.0):
    deadline = time.monotonic() + seconds
    while True:
        health = client.get("/health")
        if health.status_code == status or time.monotonic() > deadline:
            return health
        time.sleep(0.05)


def test_engine_and_llm_refuse_a_gpu_without_kernels(folder, no_kernels):
    for build in (LLMEngine, LLM):
        with pytest.raises(RuntimeError, match="built without the CUDA kernels") as refused:
            build(folder, device="cuda")
        message = str(refused.value)
        assert "pip install --no-build-isolation --no-deps ." in message  # how to build them
        assert "FASTQWEN_ALLOW_REFERENCE_ON_GPU=1" in message and "--allow-reference-on-gpu" in message
    LLMEngine(folder, device="cpu", dtype="float32", num_pages=16)  # the CPU is the reference path's home


@pytest.mark.parametrize("how", ["knob", "env", "disable_env"])
def test_reference_on_gpu_when_asked(folder, no_kernels, monkeypatch, how):
    monkeypatch.setattr(llm_engine, "load_model_config", lambda *_: (_ for _ in ()).throw(CheckPassed()))
    knobs = {}
    if how == "knob":
        knobs["allow_reference_on_gpu"] = True
    elif how == "env":
        monkeypatch.setenv("FASTQWEN_ALLOW_REFERENCE_ON_GPU", "1")
    else:
        monkeypatch.setenv("FASTQWEN_DISABLE_CUDA_KERNELS", "1")  # turning the kernels off is asking for the reference
    with pytest.raises(CheckPassed):
        LLMEngine(folder, device="cuda", **knobs)


@pytest.mark.parametrize("value", ["0", "false", "off"])
def test_switches_set_off_do_not_ask_for_the_reference(folder, no_kernels, monkeypatch, value):
    """FASTQWEN_ALLOW_REFERENCE_ON_GPU / FASTQWEN_DISABLE_CUDA_KERNELS read by env.py's one rule: "false" is off."""
    monkeypatch.setenv("FASTQWEN_ALLOW_REFERENCE_ON_GPU", value)
    monkeypatch.setenv("FASTQWEN_DISABLE_CUDA_KERNELS", value)
    with pytest.raises(RuntimeError, match="built without the CUDA kernels"):
        LLMEngine(folder, device="cuda")


def test_server_on_a_gpu_without_kernels_never_serves(folder, no_kernels):
    app = create_app(ServerConfig("tiny"), lambda: InProcessEngineClient(LLMEngine(folder, device="cuda")))
    with TestClient(app) as client:
        health = wait_for(client, 503)
        body = health.json()
        deadline = time.monotonic() + 30
        while body["status"] == "loading" and time.monotonic() < deadline:
            time.sleep(0.05)
            body = client.get("/health").json()
        assert body["status"] == "failed" and "pip install" in body["error"], body
        response = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert response.status_code == 503


def test_invariant_violation_takes_the_server_out_of_service(folder, caplog):
    engine = LLMEngine(folder, dtype="float32", device="cpu", num_pages=64)
    app = create_app(ServerConfig("tiny"), lambda: InProcessEngineClient(engine))
    with caplog.at_level(logging.ERROR), TestClient(app) as client:
        assert wait_for(client, 200).status_code == 200
        leaked = engine.kv.allocator.alloc(2)  # pages referenced by nobody: the corruption the idle check must find
        body = {"prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True}
        first = client.post("/v1/completions", json=body)
        assert first.status_code == 200  # the check runs once the engine is idle again
        health = wait_for(client, 503)
        assert health.status_code == 503 and health.json()["status"] == "engine dead"
        assert client.post("/v1/completions", json=body).status_code == 503
    logged = [r.getMessage() for r in caplog.records if "invariant violated" in r.getMessage()]
    assert logged, "the violation was not logged"
    assert all(f"page {p} has refcount 1 but 0 owners" in logged[0] for p in leaked), logged[0]
