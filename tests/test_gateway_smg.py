"""fastqwen replicas behind a real gateway: the Shepherd Model Gateway (SMG, `pip install smg`, a Rust router run
offline) on 127.0.0.1 in front of two servers on the CPU path (tiny random checkpoint).

What SMG asks of a worker (model_gateway/src/workflow/steps/local/ and worker/monitor.rs in lightseekorg/smg): /health;
/v1/models, whose `owned_by` it maps to an engine, else /version (vLLM's) or /server_info (SGLang's); then load, from
/v1/loads in SGLang's shape or, for a vLLM worker, from the `vllm:` gauges on /metrics. The tests check each answer,
then drive SMG: its cache_aware policy against its round_robin on a shared-prefix workload, and a replica killed
mid-run. The SMG tests skip themselves when the smg package is not installed; `-m gateway` selects this file.

The workload is SGLang bench_serving's generated-shared-prefix shape: GROUPS groups of PER_GROUP requests, each a
long system prompt of its group and a question of its own, sent in shuffled order. Each replica's KV cache holds
about half of the system prompts (NUM_PAGES), the regime where routing matters: round robin makes each replica serve
every group, so each replica's cache churns through all of them; cache-aware routing sends a group to one replica,
so each replica holds only its half. Under LRU eviction that about doubles the hit rate (2.0 to 2.1x in a simulation
of this shape; measured 1.65 to 2.49x over 14 runs, 8 of them at 1.8x or more, as partly evicted prompts still give
round robin partial hits). One run of 128 requests varies by about +-15%, so the assertion's floor is MIN_HIT_RATIO.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
from checkpoints import VOCAB, make_checkpoint, record_result
from server_process import LoggedProcess, ServerProcess, free_port, metric

pytestmark = pytest.mark.gateway

MODEL = "tiny"
PAGE_SIZE = 8
NUM_PAGES = 96  # per replica: 8 system prompts of 12 pages, a little more than half of GROUPS' 16
GROUPS, PER_GROUP = 16, 8
SYSTEM_TOKENS, QUESTION_TOKENS = 96, 16
CONCURRENCY = 4
MIN_HIT_RATIO = 1.4  # cache-aware over round robin; see the module docstring for why not the 1.8 of issue 45
ROUTED_HEADER = "x-smg-routed-worker-id"  # SMG's answer names the worker that served it


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("gateway")
    make_checkpoint(str(path), tied=False, seed=45, max_positions=1024)
    return str(path)


@pytest.fixture(scope="module")
def replicas(folder):
    """Two servers, started side by side; the request log names each request's x-request-id (SMG forwards it)."""
    args = ["--dtype", "float32", "--device", "cpu", "--num-pages", str(NUM_PAGES), "--page-size", str(PAGE_SIZE)]
    args += ["--served-model-name", MODEL, "--enable-request-log", "--log-level", "warning"]
    with ThreadPoolExecutor(2) as pool:
        servers = list(pool.map(lambda _: ServerProcess(folder, *args), range(2)))
    yield servers
    for server in servers:
        server.stop()


class Gateway(LoggedProcess):
    """`python -m smg launch` on 127.0.0.1 in front of the given workers; ready once SMG reports all of them ready
    with a load report read. Its load monitor polls every second here (10 s by default) so that the first report is
    not waited for, and its grace period for in-flight requests at shutdown is short (none are left by then)."""

    def __init__(self, workers: list[ServerProcess], policy: str, log_dir: str, timeout: float = 60.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "smg", "launch", "--worker-urls", *[w.url for w in workers], "--policy", policy]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warn"]
        cmd += ["--load-monitor-interval", "1", "--shutdown-grace-period-secs", "1"]
        cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]  # its own metrics listener

        def ready() -> bool:
            listed = self.workers()
            return len(listed) == len(workers) and all(w["status"] == "ready" and "engine_load" in w for w in listed)

        super().__init__(f"smg ({policy})", cmd, f"{log_dir}/smg-{policy}-{self.port}.log", ready, timeout)

    def workers(self) -> list[dict]:
        return httpx.get(self.url + "/workers", timeout=2.0).json()["workers"]


@pytest.fixture(scope="module")
def gateways(replicas, tmp_path_factory):
    pytest.importorskip("smg", reason="the Shepherd Model Gateway is not installed (pip install smg)")
    log_dir = str(tmp_path_factory.mktemp("smg"))
    started = {policy: Gateway(replicas, policy, log_dir) for policy in ("round_robin", "cache_aware")}
    yield started
    for gateway in started.values():
        gateway.stop()


def shared_prefix_workload(seed: int, groups: int = GROUPS, per_group: int = PER_GROUP, order: int = 0):
    """(group, prompt) pairs in shuffled order; the tokenizer reads each word tN as token N. `seed` picks the words,
    `order` the order, so that two policies can be compared on the same arrival order with different prompts."""
    rng = random.Random(seed)

    def words(n: int) -> str:
        return " ".join(f"t{rng.randrange(VOCAB - 2)}" for _ in range(n))

    systems = [words(SYSTEM_TOKENS) for _ in range(groups)]
    requests = [(g, f"{systems[g]} {words(QUESTION_TOKENS)}") for g in range(groups) for _ in range(per_group)]
    random.Random(order).shuffle(requests)
    return requests


@dataclass
class Outcome:
    status: int | None  # None: the connection failed
    worker: str | None  # the replica SMG says served it
    text: str | None
    sent_after_kill: bool = False


async def send_all(url: str, prompts: list[str], max_tokens: int, on_done=None, ids: str = "r") -> list[Outcome]:
    """Greedy completions through `url`, CONCURRENCY at a time; on_done(outcome) after each (in completion order)."""
    outcomes: list[Outcome | None] = [None] * len(prompts)
    slots = asyncio.Semaphore(CONCURRENCY)

    async def one(client: httpx.AsyncClient, i: int, prompt: str, state: dict) -> None:
        async with slots:
            after = state.get("killed", False)
            body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            try:
                r = await client.post(url + "/v1/completions", json=body, headers={"x-request-id": f"{ids}{i}"})
                text = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
                outcomes[i] = Outcome(r.status_code, r.headers.get(ROUTED_HEADER), text, after)
            except httpx.HTTPError as e:
                outcomes[i] = Outcome(None, None, repr(e), after)
            if on_done is not None:
                on_done(outcomes[i], state)

    async with httpx.AsyncClient(timeout=120) as client:
        state: dict = {}
        await asyncio.gather(*(one(client, i, p, state) for i, p in enumerate(prompts)))
    return outcomes


def prefix_counts(servers: list[ServerProcess]) -> tuple[float, float]:
    """Prompt tokens looked up in the replicas' prefix caches and found there, summed over the replicas."""
    texts = [httpx.get(s.url + "/metrics").text for s in servers]
    queried = sum(metric(t, "fastqwen:prefix_cache_queries_total") for t in texts)
    return queried, sum(metric(t, "fastqwen:prefix_cache_hits_total") for t in texts)


# ---- what a gateway probes ----------------------------------------------------------------------------------------


def test_what_gateways_probe_is_answered(replicas):
    url = replicas[0].url
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/version").status_code == 200  # SMG takes a worker with /version for vLLM
    loads = httpx.get(url + "/v1/loads", params={"include": "core,disagg,queues,memory"}).json()
    assert loads["dp_rank_count"] == 1 and len(loads["loads"]) == 1
    rank = loads["loads"][0]
    assert rank["max_total_num_tokens"] == NUM_PAGES * PAGE_SIZE
    assert rank["num_running_reqs"] == rank["num_waiting_reqs"] == rank["num_used_tokens"] == 0
    assert rank["token_usage"] == 0.0
    assert httpx.get(url + "/get_loads").json()["loads"][0]["max_total_num_tokens"] == NUM_PAGES * PAGE_SIZE

    # The gauges gateways read, under vLLM's names, beside fastqwen's own (the default naming).
    text = httpx.get(url + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert metric(text, "vllm:" + name) == metric(text, "fastqwen:" + name) == 0, name
    info = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
    assert f'block_size="{PAGE_SIZE}"' in info and f'num_gpu_blocks="{NUM_PAGES}"' in info
    assert "vllm:prompt_tokens_total" not in text, "only the gateway gauges take vLLM's names by default"

    # A probe of a path this server does not have: at once, a JSON 404 that names it.
    started = time.monotonic()
    missing = httpx.get(url + "/loads", timeout=5.0)
    assert missing.status_code == 404 and time.monotonic() - started < 5.0
    error = missing.json()["error"]
    assert error["type"] == "NotFoundError" and "GET /loads" in error["message"], error
    bad = httpx.get(url + "/v1/loads", params={"include": "core,everything"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "include", bad.text


def test_smg_registers_the_replicas_as_vllm_workers_with_their_loads(replicas, gateways):
    for gateway in gateways.values():
        listed = {w["url"]: w for w in gateway.workers()}
        assert set(listed) == {r.url for r in replicas}
        for worker in listed.values():
            assert worker["runtime_type"] == "vllm" and worker["is_healthy"], worker
            # SMG parsed /v1/loads into its own load record: the capacity it holds is ours.
            assert worker["engine_load"]["loads"][0]["max_total_num_tokens"] == NUM_PAGES * PAGE_SIZE, worker


# ---- routing ------------------------------------------------------------------------------------------------------


def test_cache_aware_routing_beats_round_robin_on_shared_prefixes(replicas, gateways):
    hit_rate, affinity = {}, {}
    for policy, seed in (("round_robin", 1), ("cache_aware", 2)):  # other system prompts: no help from the last run
        requests = shared_prefix_workload(seed)
        queried, hits = prefix_counts(replicas)
        outcomes = asyncio.run(send_all(gateways[policy].url, [p for _, p in requests], max_tokens=1))
        assert all(o.status == 200 for o in outcomes), [o for o in outcomes if o.status != 200][:3]
        queried_after, hits_after = prefix_counts(replicas)
        hit_rate[policy] = (hits_after - hits) / (queried_after - queried)
        # Affinity: the share of requests served by the replica that served most of their group.
        by_group = defaultdict(Counter)
        for (group, _), outcome in zip(requests, outcomes):
            by_group[group][outcome.worker] += 1
        affinity[policy] = sum(c.most_common(1)[0][1] for c in by_group.values()) / len(requests)
    ratio = hit_rate["cache_aware"] / hit_rate["round_robin"]
    figures = {"hit_rate": hit_rate, "affinity": affinity, "ratio": ratio}
    print(f"prefix hit rate behind SMG: {json.dumps(figures)}")
    record_result("gateway_smg.json", "shared_prefix", figures)
    assert affinity["cache_aware"] >= 0.9, figures  # a group stays on one replica
    assert affinity["round_robin"] <= 0.75, figures  # and is spread over both without affinity
    assert ratio >= MIN_HIT_RATIO, figures


def test_a_replica_killed_mid_run_is_routed_around(folder, replicas, gateways):
    """Kill one replica (SIGKILL) after a quarter of the requests, one of them served by it: requests sent after that all succeed on the other
    replica, and every answer equals the same prompt's greedy output computed alone. A request may fail only if it was
    on the killed replica when it died (SMG retries those elsewhere, so usually none does)."""
    from fastqwen import LLM, SamplingParams

    survivor, victim = replicas
    requests = shared_prefix_workload(3, groups=8)
    prompts = [p for _, p in requests]
    kill_after = len(prompts) // 4

    def kill_when_due(outcome: Outcome, state: dict) -> None:
        # Due once a quarter is done and the victim has served one of them (under load the gateway may have sent the
        # first quarter elsewhere; killing an idle replica would test nothing).
        state["done"] = state.get("done", 0) + 1
        state["victim_served"] = state.get("victim_served", False) or outcome.worker == victim.url
        if state["done"] >= kill_after and state["victim_served"] and not state.get("killed"):
            victim.proc.kill()
            victim.proc.wait()
            state["killed"] = True

    outcomes = asyncio.run(send_all(gateways["cache_aware"].url, prompts, 4, on_done=kill_when_due, ids="kill-"))
    assert victim.proc.poll() is not None, "the victim was killed"

    # The reference: each prompt alone, through a fresh engine without a prefix cache.
    alone = LLM(folder, dtype="float32", device="cpu", num_pages=64, page_size=PAGE_SIZE, enable_prefix_caching=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    expected = [alone.generate([p], greedy, use_tqdm=False)[0].text for p in prompts]

    assert any(o.worker == victim.url and not o.sent_after_kill for o in outcomes), "the victim served requests first"
    survivor_log = survivor.log()
    failed = []
    for i, (outcome, want) in enumerate(zip(outcomes, expected)):
        if outcome.sent_after_kill:
            assert outcome.status == 200 and outcome.worker == survivor.url, (i, outcome)
        if outcome.status == 200:
            assert outcome.text == want, (i, outcome, want)
        else:
            failed.append(i)
            assert f"(x-request-id kill-{i})" not in survivor_log, (i, outcome, "lost on the surviving replica")
    assert len(failed) <= CONCURRENCY, [outcomes[i] for i in failed]
