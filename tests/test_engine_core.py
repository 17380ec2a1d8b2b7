"""The engine core in its own process (python -m fastqwen.serve's default): the same tokens as the offline LLM,
every request fails promptly and the server exits non-zero when the core dies, and nothing leaks across the
boundary when many streams disconnect."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import pytest
from checkpoints import make_checkpoint
from fastqwen import LLM, SamplingParams
from server_process import ServerProcess, metric, metrics_when_idle

COMMON = ["--dtype", "float32", "--device", "cpu", "--num-pages", "2048", "--page-size", "4"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("core"))
    make_checkpoint(path, tied=True, seed=33, max_positions=1024)
    return path


def core_pid(server: ServerProcess) -> int:
    found = re.search(r"engine core process started \(pid (\d+)\)", server.log())
    assert found, server.log()
    return int(found.group(1))


def test_core_process_gives_the_offline_tokens_for_a_mixed_batch(folder):
    """Greedy and seeded rows at once, over /generate with token ids, against LLM.generate on the same checkpoint."""
    prompts = [[(13 * i + 7 * j) % 380 + 1 for j in range(5 + 3 * i)] for i in range(6)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        if i % 2 == 0
        else SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=12, ignore_eos=True)
        for i in range(6)
    ]
    expected = LLM(folder, dtype="float32", device="cpu", num_pages=2048, page_size=4).generate(
        prompts, params, use_tqdm=False
    )
    srv = ServerProcess(folder, *COMMON)
    try:
        assert core_pid(srv) != srv.proc.pid

        async def scenario():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:

                async def one(prompt, p):
                    sampling = {"temperature": p.temperature, "max_new_tokens": 12, "ignore_eos": True}
                    if p.seed is not None:
                        sampling.update(top_p=p.top_p, sampling_seed=p.seed)
                    r = await http.post("/generate", json={"input_ids": prompt, "sampling_params": sampling})
                    assert r.status_code == 200, r.text
                    return r.json()["output_ids"]

                return await asyncio.gather(*(one(pr, p) for pr, p in zip(prompts, params)))

        got = asyncio.run(scenario())
    finally:
        srv.stop()
    assert got == [o.token_ids for o in expected]


def test_killing_the_core_fails_every_stream_and_the_server_exits_nonzero(folder):
    srv = ServerProcess(folder, *COMMON)
    try:
        body = {"prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True, "stream": True}

        async def scenario():
            async with httpx.AsyncClient(base_url=srv.url, timeout=30) as http:
                started = asyncio.Event()

                async def stream():
                    events = []
                    async with http.stream("POST", "/v1/completions", json=body) as response:
                        assert response.status_code == 200
                        async for line in response.aiter_lines():
                            if line.startswith("data: "):
                                events.append(line)
                                if len(events) == 3:
                                    started.set()
                    return events

                tasks = [asyncio.create_task(stream()) for _ in range(4)]
                await started.wait()
                killed_at = time.monotonic()
                os.kill(core_pid(srv), signal.SIGKILL)
                results = await asyncio.gather(*tasks)
                return results, time.monotonic() - killed_at

        results, took = asyncio.run(scenario())
        assert took < 10, f"clients waited {took:.1f} s for the error"
        for events in results:
            assert events[-1] == "data: [DONE]"
            assert '"error"' in events[-2] and '"code":503' in events[-2], events[-2]
        assert srv.proc.wait(30) != 0, "the server must exit non-zero so a supervisor restarts it"
    finally:
        srv.stop()


def test_a_model_that_cannot_load_exits_nonzero(tmp_path):
    folder = str(tmp_path)
    make_checkpoint(folder, tied=True)
    os.remove(os.path.join(folder, "model.safetensors"))
    with pytest.raises(RuntimeError, match="exited with"):
        ServerProcess(folder, *COMMON, timeout=120)


def test_disconnected_streams_release_every_page_in_the_core(folder):
    srv = ServerProcess(folder, *COMMON)
    try:

        async def scenario():
            async with httpx.AsyncClient(
                base_url=srv.url, timeout=30, limits=httpx.Limits(max_connections=100)
            ) as http:

                async def stream_then_leave(i):
                    body = {"prompt": [i % 300 + 1, 4, 5], "max_tokens": 500, "ignore_eos": True, "stream": True}
                    async with http.stream("POST", "/v1/completions", json=body) as response:
                        seen = 0
                        async for line in response.aiter_lines():
                            seen += line.startswith("data: ")
                            if seen >= 2 + i % 5:
                                return  # leaving the block closes the connection mid-stream

                await asyncio.gather(*(stream_then_leave(i) for i in range(60)))

        asyncio.run(scenario())
        text = metrics_when_idle(srv.url)
        assert metric(text, "fastqwen:num_requests_running") == 0
        assert metric(text, "fastqwen:kv_cache_usage_perc") == 0, "every KV page must be free again"
        time.sleep(0.5)  # the core checks the page invariant once idle; a violation would end it
        assert httpx.get(srv.url + "/health").status_code == 200
        ok = httpx.post(srv.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 3}, timeout=30)
        assert ok.status_code == 200
    finally:
        srv.stop()
