"""An error inside an engine step fails the requests of that step, not the engine (issue 23).

The failed requests get finish_reason "error" and release their pages; the KV page invariant holds right after;
requests that were not in the step, and every later request, produce exactly what an engine that never failed
produces. A fault the engine cannot recover from (a CUDA error, repeated failures, one with no request to pin it
on) raises EngineFault. Over HTTP: a failed request gets a 500 in OpenAI's shape (a stream: an error event and
[DONE]) and the server goes on serving.
"""

from __future__ import annotations

import json

import httpx
import pytest
from checkpoints import make_checkpoint
from fastqwen import LLM, SamplingParams
from fastqwen.engine.client import InProcessEngineClient
from fastqwen.engine.llm_engine import MAX_FAILED_STEPS, EngineFault, LLMEngine
from test_server_failures import InProcessServer

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# Three prompts sharing a prefix (the prefix cache holds pages of the failed ones), and a fourth that waits.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 9, 10, 11, 12, 40, 41], [70, 71, 72], [5, 6, 7, 8, 9, 10, 90]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("step_failure"))
    make_checkpoint(path, tied=True, max_positions=128)
    return path


def make_llm(folder: str) -> LLM:
    return LLM(folder, dtype="float32", device="cpu", num_pages=64, page_size=4, max_num_seqs=3)


@pytest.fixture(scope="module")
def expected(folder):
    return [o.token_ids for o in make_llm(folder).generate(PROMPTS, GREEDY, use_tqdm=False)]


def fail_once(obj, name: str, error: Exception):
    original = getattr(obj, name)

    def broken(*args, **kwargs):
        setattr(obj, name, original)
        raise error

    setattr(obj, name, broken)


def run_all(llm: LLM, updates: dict) -> None:
    while llm.has_unfinished():
        for update in llm.step():
            if update.finished:
                updates[update.request_id] = update.output


@pytest.mark.parametrize("where", ["launch", "collect"])
def test_a_failed_step_fails_its_requests_only(folder, expected, where):
    llm = make_llm(folder)
    engine = llm.engine
    rids = [llm.add_request(p, GREEDY) for p in PROMPTS]
    outputs: dict = {}
    for _ in range(4):  # prefills done, a few decodes: pages held, prefixes in the cache
        for update in llm.step():
            assert not update.finished
    in_step = {r.rid for r in engine.scheduler.running}
    assert len(in_step) == 3 and rids[3] not in in_step, "the fourth request waits (max_num_seqs=3)"
    fail_once(engine.runner, where, ValueError("simulated failure"))
    failed = llm.step()
    assert {u.request_id for u in failed} == in_step
    for update in failed:
        assert update.finished and update.output.finish_reason == "error" and "simulated failure" in update.output.error
    engine.check_invariants()  # right after the failure: no page leaked or double-owned
    assert not engine.scheduler.running
    run_all(llm, outputs)
    assert outputs[rids[3]].token_ids == expected[3], "a request outside the failed step is untouched"
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # the engine and its prefix cache still serve correctly
    assert [o.token_ids for o in again] == expected
    engine.check_invariants()
    allocator = engine.kv.allocator
    assert allocator.num_used() == len(engine.cache.pages()), "only the prefix cache holds pages once all is done"


def test_repeated_failures_are_a_fault(folder):
    llm = make_llm(folder)
    always = ValueError("always fails")

    def broken(*args, **kwargs):
        raise always

    llm.engine.runner.launch = broken
    for _ in range(MAX_FAILED_STEPS - 1):
        llm.add_request([1, 2, 3], GREEDY)
        assert [u.output.finish_reason for u in llm.step()] == ["error"]
        llm.engine.check_invariants()
    llm.add_request([1, 2, 3], GREEDY)
    with pytest.raises(EngineFault, match="in a row"):
        llm.step()


def test_a_success_resets_the_count(folder):
    llm = make_llm(folder)
    for _ in range(MAX_FAILED_STEPS + 1):
        llm.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2))
        fail_once(llm.engine.runner, "launch", ValueError("once"))
        assert [u.output.finish_reason for u in llm.step()] == ["error"]
        llm.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2))
        done: dict = {}
        run_all(llm, done)  # steps that work
        assert [o.finish_reason for o in done.values()] == ["length"]


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError(
            "fastqwen: CUDA error in decode: cudaErrorIllegalAddress: an illegal memory access was encountered"
        ),
        MemoryError(),
    ],
)
def test_unrecoverable_errors_are_a_fault_at_once(folder, error):
    llm = make_llm(folder)
    llm.add_request([1, 2, 3], GREEDY)
    fail_once(llm.engine.runner, "launch", error)
    with pytest.raises(EngineFault, match="unrecoverable"):
        llm.step()


def test_a_failure_with_no_request_to_blame_is_a_fault(folder):
    llm = make_llm(folder)
    llm.add_request([1, 2, 3], GREEDY)
    fail_once(llm.engine.scheduler, "schedule", ValueError("scheduler bug"))
    with pytest.raises(EngineFault, match="no request"):
        llm.step()


@pytest.fixture
def flaky_server(folder):
    engine = LLMEngine(folder, dtype="float32", device="cpu", num_pages=64, page_size=4)
    server = InProcessServer(lambda: InProcessEngineClient(engine))
    server.wait_healthy()
    yield server.url, engine
    server.stop()


def test_a_failed_step_is_a_500_and_the_server_goes_on(flaky_server):
    url, engine = flaky_server
    body = {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=url, timeout=30, limits=httpx.Limits(max_connections=1)) as client:
        good = client.post("/v1/completions", json=body)
        assert good.status_code == 200
        fail_once(engine.runner, "launch", ValueError("simulated failure"))
        failed = client.post("/v1/completions", json=body)
        assert failed.status_code == 500
        error = failed.json()["error"]
        assert error["code"] == 500 and "simulated failure" in error["message"]
        fail_once(engine.runner, "launch", ValueError("simulated failure"))
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][len("data: ") :])["error"]["code"] == 500
        again = client.post("/v1/completions", json=body)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == good.json()["choices"][0]["text"]
        assert client.get("/health").json()["status"] == "ok"
