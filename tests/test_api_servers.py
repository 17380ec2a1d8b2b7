"""--api-server-count N (api_servers.py, engine/core_process.py's FrontendLinks): N HTTP front-end processes on one
port before the engine core(s).

The core alone first, with two clients attached in this process as two front ends: each gets its own requests'
deltas and no other's, each sees the core's counts of both (what its load routing reads), an abort from one frees
that request, and the core ends once both have said stop. Then one real server with two front ends (CPU): concurrent
requests, streamed and not, give the offline engine's greedy outputs and both processes serve some (each response
names its front end); /metrics gives the same sums whichever process answers; a client that goes away frees its
request; and a kill -9 of one front end ends the server non-zero, leaving no process or folder. Last, two front ends
before two data-parallel replicas give the same outputs. Bad values of the flag are refused naming it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import signal
import time

import httpx
import pytest
import zmq
from checkpoints import make_checkpoint
from fastqwen import LLM, SamplingParams
from fastqwen.config import EngineConfig
from fastqwen.engine import lifeline
from fastqwen.engine.core_process import CoreHandle, FrontendLinks, ProcessEngineClient, start_core
from fastqwen.engine.messages import EngineInfo, EngineStats, StepOutput, request_ids
from fastqwen.frontend import Frontend
from server_process import ServerProcess, metric, metrics_when_idle
from test_orphans import descendants, ipc_folders, wait_until_gone

ENGINE = {"dtype": "float32", "device": "cpu", "num_pages": 512, "page_size": 4}
COMMON = ["--dtype", "float32", "--device", "cpu", "--num-pages", "512", "--page-size", "4"]
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("apiservers"))
    make_checkpoint(path, tied=True, seed=43, max_positions=1024)
    return path


@pytest.fixture(scope="module")
def prompts():
    return [[(13 * i + 7 * j) % 380 + 1 for j in range(2 + 3 * (i % 5))] for i in range(24)]


@pytest.fixture(scope="module")
def expected(folder, prompts):
    """The offline engine's greedy outputs: (token ids, text) per prompt."""
    llm = LLM(folder, **ENGINE)
    try:
        params = SamplingParams(max_tokens=GREEDY["max_tokens"], temperature=0.0, ignore_eos=True)
        return [(o.token_ids, o.text) for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.close()


@pytest.fixture(scope="module")
def api2(folder):
    """The module's two-front-end server (the last of its tests kills it)."""
    srv = ServerProcess(folder, *COMMON, "--api-server-count", "2", "--skip-warmup", "--shutdown-timeout", "2")
    yield srv
    srv.stop()


# ---- the core with two front ends, without HTTP ----------------------------------------------------------------


def until(condition, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_core_sends_each_front_end_its_own_requests_and_both_its_counts(folder):
    config = EngineConfig(model=folder, api_server_count=2, **ENGINE)
    core_folder = lifeline.ipc_folder("fastqwen")
    core = start_core(config, core_folder, logging.WARNING, None)
    clients = [
        ProcessEngineClient(config, attach=CoreHandle(core_folder, core.pid), frontend=i, wait=False) for i in range(2)
    ]
    try:
        for client in clients:
            client.wait_until_loaded()
        seen = [[], []]
        for client, outputs in zip(clients, seen):
            client.start(outputs.append, lambda error: None)
        frontends = [Frontend(clients[i].info, ids=request_ids(i, 2)) for i in range(2)]
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

        def add(i: int) -> int:
            tracker = frontends[i].new_request([5, 6, 7 + i], params)  # (every default resolved)
            clients[i].add([tracker.request])
            return tracker.rid

        mine = [[add(0), add(0)], [add(1)]]
        # Both front ends see all three requests in the core's counts, whoever sent them.
        until(lambda: all(c.stats().num_running == 3 for c in clients), "every front end sees the core's counts")
        clients[0].abort(mine[0][0])
        until(lambda: all(c.stats().num_running == 2 for c in clients), "the abort freed the request")

        def rids(outputs) -> set[int]:
            return {d.rid for output in list(outputs) for d in output.deltas}

        until(lambda: rids(seen[0]) == set(mine[0]) and rids(seen[1]) == set(mine[1]), "each its own deltas")
        assert sum(o.num_tokens for o in seen[1]) == 0, "the steps' token counts go to front end 0 only"
        clients[0].stop()
        time.sleep(0.2)
        assert core.is_alive(), "the core serves until every front end has said stop"
        steps = len(seen[1])
        until(lambda: len(seen[1]) > steps, "front end 1 is still served")
        clients[1].stop()
        core.join(10)
        assert core.exitcode == 0
    finally:
        for client in clients:
            client.stop(timeout=0)
        if core.is_alive():
            core.kill()
        lifeline.forget(core_folder)


def test_a_core_relays_the_prompts_one_front_end_routed_to_the_other_front_ends_once(folder):
    """Data parallelism with two front ends: what front end 0 routed to a core reaches front end 1, once, and not
    front end 0 (the core's side, FrontendLinks, in this process; the front ends' clients attached to it)."""
    config = EngineConfig(model=folder, api_server_count=2, **ENGINE)
    core_folder = lifeline.ipc_folder("fastqwen")
    core = CoreHandle(core_folder, os.getpid())  # (the "core" is this process: it never ends under the clients)
    clients = [ProcessEngineClient(config, attach=core, frontend=i, wait=False) for i in range(2)]
    context = zmq.Context()
    links = FrontendLinks(context, core_folder, 2)
    try:
        links.broadcast(b"info", EngineInfo("m", 384, 1024, 64, 4))
        relayed = []
        for client in clients:
            client.wait_until_loaded()
            relayed.append(client.receive_routes(64))
            client.start(lambda output: None, lambda error: None)
        clients[0].share_routes([[11, -22, 2**63 - 1], [44]])
        assert links.inbox.poll(5000)
        assert links.receive(0) is None, "a relay is not a command for the engine"
        links.send_stats(EngineStats(num_running=1))
        until(lambda: all(c.stats().num_running == 1 for c in clients), "both front ends got the stats")
        assert list(relayed[1]) == [[11, -22, 2**63 - 1], [44]] and not relayed[0]
        links.send_stats(EngineStats(num_running=2))  # nothing new routed: nothing relayed again
        links.send_step(StepOutput([], 0.0), EngineStats(num_running=3))
        until(lambda: all(c.stats().num_running == 3 for c in clients), "both front ends got the step")
        assert len(relayed[1]) == 2 and not relayed[0]
    finally:
        for client in clients:
            client.stop(timeout=0)
        links.close()
        context.term()
        shutil.rmtree(core_folder, ignore_errors=True)
        lifeline.forget(core_folder)


# ---- refusals ---------------------------------------------------------------------------------------------------


def test_bad_api_server_counts_are_refused_naming_the_flag(folder, capsys):
    from fastqwen.serve import main, parse_args

    assert main(["--model", folder, "--api-server-count", "0"]) == 2
    assert "error: --api-server-count: api_server_count must be a positive integer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--model", folder, "--api-server-count", "1.5"])
    assert "argument --api-server-count: invalid int value: '1.5'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--model", folder, "--api-server-count", "2", "--engine-core", "thread"])
    assert "--api-server-count above 1 runs the engine core in a process of its own" in capsys.readouterr().err
    from fastqwen import LLM
    from fastqwen.config import ConfigError

    with pytest.raises(ConfigError, match="front-end processes are the server's") as refused:
        LLM(folder, api_server_count=2, device="cpu")
    assert refused.value.field == "api_server_count"


# ---- a real server with two front ends --------------------------------------------------------------------------


def send_all(url: str, prompts: list[list[int]], stream_every: int = 2) -> list[tuple[str, list[int] | None, str]]:
    """Every prompt at once, each on a connection of its own, every stream_every-th streamed: per prompt, the front
    end that served it, the token ids (None when streamed) and the text."""

    async def one(prompt: list[int], stream: bool):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:  # (a new connection each)
            body = {"prompt": prompt, **GREEDY, "stream": stream}
            if not stream:
                r = await http.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                choice = r.json()["choices"][0]
                return r.headers["x-fastqwen-api-server"], choice["token_ids"], choice["text"]
            text = ""
            async with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        text += json.loads(line[6:])["choices"][0]["text"]
                return r.headers["x-fastqwen-api-server"], None, text

    async def scenario():
        return await asyncio.gather(*(one(p, i % stream_every == 0) for i, p in enumerate(prompts)))

    return asyncio.run(scenario())


def test_two_front_ends_give_the_outputs_of_the_engine_and_both_serve(api2, prompts, expected):
    results = send_all(api2.url, prompts)
    for (served_by, ids, text), (want_ids, want_text) in zip(results, expected):
        if ids is not None:
            assert ids == want_ids
        assert text == want_text
    assert {served_by for served_by, _, _ in results} == {"0", "1"}, "the kernel spreads connections over both"


def scrape(url: str) -> tuple[str, str]:
    """/metrics over a new connection: which front end answered, and the text."""
    with httpx.Client(base_url=url) as http:
        r = http.get("/metrics")
        return r.headers["x-fastqwen-api-server"], r.text


def summed(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_metrics_add_up_over_the_front_ends_whichever_answers(api2, prompts):
    before = {}
    for _ in range(40):  # a baseline from each front end (they agree, or the check below fails anyway)
        served_by, text = scrape(api2.url)
        before[served_by] = summed(text, "fastqwen:request_success_total")
        if len(before) == 2:
            break
    assert len(before) == 2 and before["0"] == before["1"], before
    results = send_all(api2.url, prompts[:16], stream_every=3)  # (16 connections all to one front end: 2^-15)
    assert {s for s, _, _ in results} == {"0", "1"}
    finished = before["0"] + 16
    seen = set()
    deadline = time.monotonic() + 10
    while len(seen) < 2:  # every answer adds up both front ends' requests (token counts within HAND_OVER_S)
        served_by, text = scrape(api2.url)
        ok = summed(text, "fastqwen:request_success_total") == finished and summed(
            text, "fastqwen:request_generation_tokens_count"
        ) == summed(text, "fastqwen:request_success_total")
        if ok and summed(text, "fastqwen:generation_tokens_total") == finished * GREEDY["max_tokens"]:
            seen.add(served_by)
        assert time.monotonic() < deadline, (served_by, text)
    assert metric(text, "fastqwen:num_requests_running") == 0  # the engine's gauges, one series as with one process


def test_a_client_that_goes_away_frees_its_request(api2):
    text = scrape(api2.url)[1]
    aborted_before = summed(text, "fastqwen:num_aborted_requests_total")
    computed_before = summed(text, "fastqwen:iteration_tokens_total_sum")
    served, sent = set(), 0
    # At least 6, and on until both front ends took one: the kernel spreads new connections by a hash of their ports,
    # so 6 alone all reach one front end about 3% of the time.
    while (sent < 6 or len(served) < 2) and sent < 40:
        body = {"prompt": [9, 8, 7 + sent], "max_tokens": 900, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=api2.url, timeout=30) as http:  # (a new connection each)
            with http.stream("POST", "/v1/completions", json=body) as response:
                served.add(response.headers["x-fastqwen-api-server"])
                lines = response.iter_lines()
                while not next(lines).startswith("data: "):
                    pass
        sent += 1
    text = metrics_when_idle(api2.url, timeout=10)
    assert metric(text, "fastqwen:num_requests_running") == 0 and metric(text, "fastqwen:kv_cache_usage_perc") == 0
    assert summed(text, "fastqwen:num_aborted_requests_total") == aborted_before + sent
    # Each was aborted in the core after a few tokens: not run to its 900 (which the tiny model would soon do).
    assert summed(text, "fastqwen:iteration_tokens_total_sum") - computed_before < sent * 900 / 4
    assert served == {"0", "1"}


def test_killing_one_front_end_ends_the_server_and_leaves_nothing(api2):
    """(Last with the module's server: it ends it.)"""
    frontends = [int(pid) for pid in re.findall(r"api server \d started \(pid (\d+)\)", api2.log())]
    tree = descendants(api2.proc.pid)
    assert len(frontends) == 2 and set(frontends) <= set(tree), (frontends, tree)
    folders = ipc_folders([api2.proc.pid, *tree])
    with open(f"/proc/{frontends[0]}/environ", "rb") as f:
        environment = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    folders.add(environment[b"PROMETHEUS_MULTIPROC_DIR"].decode())
    assert len(folders) == 2 and all(os.path.isdir(f) for f in folders), folders
    os.kill(frontends[1], signal.SIGKILL)
    assert api2.proc.wait(30) != 0, "the server must exit non-zero so a supervisor restarts it"
    assert "api server 1 (pid" in api2.log() and "stopping the server" in api2.log()
    wait_until_gone(tree, folders)


# ---- with data-parallel replicas --------------------------------------------------------------------------------


def test_two_front_ends_before_two_replicas_give_the_outputs_of_the_engine(folder, prompts, expected):
    server = ServerProcess(folder, *COMMON, "--api-server-count", "2", "--dp", "2", "--skip-warmup")
    try:
        results = send_all(server.url, prompts)
        for (served_by, ids, text), (want_ids, want_text) in zip(results, expected):
            if ids is not None:
                assert ids == want_ids
            assert text == want_text
        assert {served_by for served_by, _, _ in results} == {"0", "1"}
        loads = httpx.get(server.url + "/v1/loads").json()
        assert loads["dp_rank_count"] == 2
        text = metrics_when_idle(server.url, timeout=10)
        assert summed(text, "fastqwen:request_success_total") == len(prompts)
    finally:
        server.stop()
    assert server.proc.returncode == 0, server.log()
