"""--data-parallel-size N (engine/data_parallel.py, engine/replica_router.py): N engine-core replicas behind one
server. On the CPU: a --dp 2 server gives the --dp 1 server's greedy tokens; concurrent requests spread over both
replicas (the per-engine gauges show it); requests sharing a long prefix go to the replica that caches it (their
responses report the cached tokens); a kill -9 of one replica's core fails every stream, ends the server non-zero and
leaves no process or IPC folder. The router's rule and the refusals of bad input are checked without a server.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
from collections import deque

import httpx
import pytest
import torch
from checkpoints import make_checkpoint
from fastqwen import SamplingParams
from fastqwen.config import ConfigError, EngineConfig
from fastqwen.engine.data_parallel import DataParallelEngineClient
from fastqwen.engine.messages import EngineInfo, EngineRequest, EngineStats, RequestDelta, StepOutput
from fastqwen.engine.replica_router import MUCH_BUSIER_BY_REQUESTS, ReplicaRouter, page_hashes
from server_process import ServerProcess
from test_orphans import descendants, ipc_folders, wait_until_gone

COMMON = ["--dtype", "float32", "--device", "cpu", "--num-pages", "512", "--page-size", "4"]
PAGE = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dp"))
    make_checkpoint(path, tied=True, seed=41, max_positions=1024)
    return path


@pytest.fixture(scope="module")
def dp2(folder):
    """The module's --dp 2 server, with two front ends by default (the last test kills it)."""
    srv = ServerProcess(folder, *COMMON, "--dp", "2")
    yield srv
    srv.stop()


def per_engine(text: str, name: str) -> dict[str, float]:
    """The samples of one metric by their engine label."""
    found = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            engine = re.search(r'engine="(\d+)"', line)
            found[engine.group(1)] = float(line.rsplit(" ", 1)[1])
    return found


# ---- the router alone ---------------------------------------------------------------------------------------


def test_the_router_keeps_a_prefix_on_its_replica_until_that_replica_is_much_busier():
    router = ReplicaRouter([64, 64], PAGE)
    prefix = list(range(100, 124))  # 6 pages
    assert router.route(prefix + [1], [0, 0]) == 0
    assert router.route([7, 7, 7, 7, 7], [0, 0]) == 1, "no prefix held anywhere: round robin among the idle"
    # Replica 0 holds the prefix: it keeps taking it while not much busier than replica 1 ...
    assert router.route(prefix + [2], [MUCH_BUSIER_BY_REQUESTS, 0]) == 0
    assert router.route(prefix + [3], [40, 24]) == 0  # 16 more, and less than half of 24 more
    # ... and not once it is: more than 16 requests more, and more than half again as many.
    assert router.route(prefix + [4], [MUCH_BUSIER_BY_REQUESTS + 1, 0]) == 1
    assert router.route(prefix + [5], [100, 60]) == 1  # the prefix is now on both: the less busy holder
    # The longest prefix held wins over a shorter one held by a less busy replica.
    longer = ReplicaRouter([64, 64], PAGE)
    assert longer.route(prefix, [0, 0]) == 0  # 6 pages on replica 0
    assert longer.route(prefix[:8] + [99] * 4, [MUCH_BUSIER_BY_REQUESTS + 1, 0]) == 1  # 2 of them on replica 1
    assert longer.route(prefix + [6], [3, 2]) == 0


def test_the_routers_estimate_is_bounded_by_the_pool_and_forgets_deepest_pages_first():
    router = ReplicaRouter([4, 4], PAGE)
    first = list(range(24))  # 6 pages: more than the replica's 4-page pool
    router.route(first, [0, 0])
    hashes = page_hashes(first, PAGE)
    assert router.cached_pages(0, hashes) == 4, "the first 4 pages stay, the deepest go"
    assert page_hashes([1, 2, 3], PAGE) == [], "a partial page is never shared"
    assert page_hashes([9] + first[1:], PAGE)[1] != hashes[1], "each page's hash covers the pages before it"


class FakeReplica:
    """An EngineClient that records what reaches it; its load is what the test says."""

    def __init__(self, num_pages: int = 64):
        self.info = EngineInfo("m", 384, 1024, num_pages, PAGE, device="cpu")
        self.load, self.added, self.aborted = 0, [], []

    def start(self, on_output, on_death):
        self.on_output, self.on_death = on_output, on_death

    def add(self, requests):
        self.added += [r.rid for r in requests]

    def abort(self, rid):
        self.aborted.append(rid)

    def stats(self):
        return EngineStats(num_running=self.load, kv_usage=0.5 if self.load else 0.0)

    alive = True


def request(rid: int, prompt: list[int]) -> EngineRequest:
    return EngineRequest(rid, prompt, SamplingParams(max_tokens=4), 0.0)


def test_the_client_routes_aborts_to_the_requests_replica_and_forgets_what_ended():
    replicas = [FakeReplica(64), FakeReplica(32)]
    client = DataParallelEngineClient(replicas)
    assert client.info.num_pages == 32, "requests are checked against the smallest pool"
    outputs, deaths = [], []
    client.start(outputs.append, deaths.append)
    shared = list(range(100, 116))
    client.add([request(1, shared + [1]), request(2, [7, 8]), request(3, shared + [3])])  # one call: spread as routed
    assert (replicas[0].added, replicas[1].added) == ([1, 3], [2])
    replicas[0].load = 1
    assert client.stats().num_running == 1 and client.stats().kv_usage == pytest.approx(0.5 * 64 / 96)
    assert [s.num_running for _, s in client.per_engine()] == [1, 0]
    client.abort(2)
    replicas[0].on_output(StepOutput([RequestDelta(1, [5], None, finish_reason="stop")], 0.0))
    client.abort(1)  # finished: not sent anywhere
    client.abort(3)
    assert (replicas[0].aborted, replicas[1].aborted) == ([3], [2])
    assert len(outputs) == 1 and not client._home, "every request ended or aborted is forgotten"
    replicas[1].on_death(RuntimeError("gone"))
    replicas[0].on_death(RuntimeError("also gone"))
    assert [str(e) for e in deaths] == ["data-parallel replica 1: gone"] and not client.alive


class SharingReplica(FakeReplica):
    """A replica of one of several front ends: what its core relays, and what this front end shares with it."""

    def __init__(self, num_pages: int = 64):
        super().__init__(num_pages)
        self.shared = []

    def receive_routes(self, capacity):
        self.relayed = deque(maxlen=capacity)
        return self.relayed

    def share_routes(self, page_hashes):
        self.shared += page_hashes


def test_a_front_end_routes_by_what_the_other_front_ends_routed_and_shares_what_it_routes():
    replicas = [SharingReplica(), SharingReplica()]
    client = DataParallelEngineClient(replicas, share_routes=True)
    client.start(lambda output: None, lambda error: None)
    prefix = list(range(100, 124))  # 6 pages
    # Another front end routed a prompt with this prefix to replica 1 (its core relayed the hashes here): with both
    # replicas idle, a prompt sharing the prefix goes there, not to replica 0 where the round robin would send it.
    replicas[1].relayed.append(page_hashes(prefix + [1, 2], PAGE))
    client.add([request(0, prefix + [3])])
    assert (replicas[0].added, replicas[1].added) == ([], [0]) and not replicas[1].relayed
    assert replicas[1].shared == [page_hashes(prefix + [3], PAGE)] and replicas[0].shared == []
    client.add([request(2, [7, 7, 7, 7, 7]), request(4, [1, 2])])  # (a prompt under a page has nothing to share)
    assert replicas[0].added == [2] and replicas[0].shared == [page_hashes([7] * 5, PAGE)]
    assert replicas[1].shared == [page_hashes(prefix + [3], PAGE)]


# ---- refusals -----------------------------------------------------------------------------------------------


def test_bad_data_parallel_sizes_are_refused_naming_the_flag(folder, capsys):
    from fastqwen import LLM
    from fastqwen.engine.factory import replica_config
    from fastqwen.serve import main, parse_args

    assert main(["--model", folder, "--dp", "0"]) == 2
    assert "error: --data-parallel-size: data_parallel_size must be a positive integer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--model", folder, "--dp", "2", "--engine-core", "thread"])
    assert "--data-parallel-size above 1 runs one engine-core process per replica" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="data parallelism is the server's") as refused:
        LLM(folder, data_parallel_size=2, device="cpu")
    assert refused.value.field == "data_parallel_size"
    # More replicas than GPUs (none on a CPU machine): each replica's core refuses before it loads anything.
    too_many = torch.cuda.device_count() + 1
    config = EngineConfig(model=folder, device="cuda", data_parallel_size=too_many)
    with pytest.raises(ConfigError, match=rf"--data-parallel-size {too_many} x --tensor-parallel-size 1 needs"):
        replica_config(config, 0)


# ---- a real server ------------------------------------------------------------------------------------------


def completions(url: str, prompts: list[list[int]], **params) -> list[dict]:
    """The responses to these prompts, sent at once."""

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:

            async def one(prompt):
                r = await http.post("/v1/completions", json={"prompt": prompt, **params})
                assert r.status_code == 200, r.text
                return r.json()

            return await asyncio.gather(*(one(p) for p in prompts))

    return asyncio.run(scenario())


def test_two_replicas_give_the_tokens_of_one(folder, dp2):
    prompts = [[(11 * i + 5 * j) % 380 + 1 for j in range(3 + 4 * i)] for i in range(6)]
    params = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
    one = ServerProcess(folder, *COMMON, "--dp", "1", "--skip-warmup")
    try:
        expected = [r["choices"][0]["token_ids"] for r in completions(one.url, prompts, **params)]
        response = httpx.get(one.url + "/metrics")
        text = response.text
        assert per_engine(text, "fastqwen:num_requests_running") == {"0": 0}, "one engine, labelled as vLLM does"
        assert "x-fastqwen-api-server" not in response.headers, "--dp 1: one front end by default"
    finally:
        one.stop()
    got = [r["choices"][0]["token_ids"] for r in completions(dp2.url, prompts, **params)]
    assert got == expected


def test_two_replicas_have_two_front_ends_by_default(dp2):
    """--dp 2 without --api-server-count: a front end per replica, as vLLM's serve (each names itself in a header;
    the kernel spreads new connections over them, so a few connections reach both)."""
    served = set()
    for _ in range(40):
        with httpx.Client(base_url=dp2.url, timeout=30) as http:  # (a new connection each)
            served.add(http.get("/v1/models").headers.get("x-fastqwen-api-server"))
        if served == {"0", "1"}:
            break
    assert served == {"0", "1"}


def test_concurrent_requests_spread_over_both_replicas(dp2):
    """Four streams, held open: the per-engine gauges show two on each replica. (Each starts once the one before it
    streams: two front ends route on their own, each knowing the other's requests only from the cores' counts, so
    requests arriving at the same instant could put three on one replica.)"""
    streaming = threading.Barrier(5)
    release = threading.Event()
    started = [threading.Event() for _ in range(4)]

    def stream(i: int) -> None:
        body = {"prompt": [30 + i, 5, 6], "max_tokens": 900, "ignore_eos": True, "stream": True}
        if i > 0:
            started[i - 1].wait(30)
        with httpx.stream("POST", dp2.url + "/v1/completions", json=body, timeout=30) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            started[i].set()
            streaming.wait(30)
            release.wait(30)  # leaving closes the connection: the request is aborted

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    try:
        streaming.wait(30)
        text = httpx.get(dp2.url + "/metrics").text
        loads = httpx.get(dp2.url + "/v1/loads").json()  # what SMG's load monitor reads: one entry per replica
        states = httpx.get(dp2.url + "/server_info").json()["internal_states"]  # SGLang's: one per DP rank
    finally:
        release.set()
        for thread in threads:
            thread.join(30)
    running = per_engine(text, "fastqwen:num_requests_running")
    waiting = per_engine(text, "fastqwen:num_requests_waiting")
    assert {e: running[e] + waiting[e] for e in running} == {"0": 2, "1": 2}, text
    assert loads["dp_rank_count"] == 2 and [r["num_total_reqs"] for r in loads["loads"]] == [2, 2], loads
    assert [s["num_running"] + s["num_waiting"] for s in states] == [2, 2], states


def test_requests_sharing_a_long_prefix_go_to_the_replica_that_caches_it(dp2):
    """Two groups of requests, each sharing a 12-page prefix, one request at a time: after each group's first, every
    request finds the whole prefix in its replica's cache (with two idle replicas and no affinity, it would go to the
    other one every second time)."""
    for group in range(2):
        prefix = [(37 * group + 3 * j) % 300 + 50 for j in range(12 * PAGE)]
        cached = []
        for i in range(4):
            (response,) = completions(dp2.url, [prefix + [200 + i]], max_tokens=2, temperature=0)
            cached.append(response["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert cached[0] == 0 and all(c >= len(prefix) for c in cached[1:]), (group, cached)


def test_killing_one_replicas_core_fails_every_stream_and_ends_the_server(dp2):
    """(Last: it ends the module's server.)"""
    cores = [int(pid) for pid in re.findall(r"engine core process started \(pid (\d+)\)", dp2.log())]
    assert len(cores) == 2, dp2.log()
    tree = descendants(dp2.proc.pid)
    folders = ipc_folders([dp2.proc.pid, *tree])
    assert set(cores) <= set(tree) and len(folders) == 2, (cores, tree, folders)
    body = {"prompt": [5, 6, 7], "max_tokens": 900, "ignore_eos": True, "stream": True}

    async def scenario():
        async with httpx.AsyncClient(base_url=dp2.url, timeout=30) as http:
            started = [asyncio.Event() for _ in range(2)]

            async def stream(i: int) -> list[str]:
                events = []
                async with http.stream("POST", "/v1/completions", json={**body, "prompt": [5 + i, 6]}) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line)
                            started[i].set()
                return events

            tasks = [asyncio.create_task(stream(i)) for i in range(2)]  # one on each replica
            await asyncio.gather(*(s.wait() for s in started))
            killed_at = time.monotonic()
            os.kill(cores[1], signal.SIGKILL)
            results = await asyncio.gather(*tasks)
            return results, time.monotonic() - killed_at

    results, took = asyncio.run(scenario())
    assert took < 10, f"clients waited {took:.1f} s for the error"
    for events in results:
        assert events[-1] == "data: [DONE]"
        assert '"error"' in events[-2] and '"code":503' in events[-2], events[-2]
    assert dp2.proc.wait(30) == 1, "the server must exit non-zero so a supervisor restarts it"
    assert "the engine stopped: RuntimeError: data-parallel replica 1:" in dp2.log()
    wait_until_gone(tree, folders)
