"""What operators and their tools rely on, against the real server (tiny random checkpoint, CPU): vLLM's metric
names for its Grafana dashboard, HTTP conventions (x-request-id, CORS, HEAD probes), model aliases, the per-request
and stats log lines; and `fastqwen chat`, driven through stdin, on a local model and against the server."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import httpx
import pytest
from checkpoints import make_checkpoint
from fastqwen import LLM, SamplingParams
from server_process import ServerProcess, metric
from test_text import CHAT_TEMPLATE

API_KEY = "ops-key"
ORIGIN = "http://dashboard.example"

# Every metric that vLLM's published Grafana dashboard queries: examples/online_serving/prometheus_grafana/grafana.json
# in vllm-project/vllm (read at commit 004f771f3a6b49597546b05c7d83686d1e121fa0), each panel's "expr", by name.
VLLM_DASHBOARD_METRICS = [
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:gpu_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
]
# What issue 17 found missing next to vLLM's current metrics, beyond the dashboard's.
VLLM_OTHER_METRICS = [
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total",
    "vllm:iteration_tokens_total_bucket",
    "vllm:request_inference_time_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:request_time_per_output_token_seconds_bucket",
    "vllm:request_params_max_tokens_bucket",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:cache_config_info",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
CHAT_FLAGS = ["--temperature", "0", "--max-tokens", "8"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("ops")
    make_checkpoint(str(path), tied=False, seed=17, max_positions=1024)
    (path / "template.jinja").write_text(CHAT_TEMPLATE)  # given with --chat-template: the checkpoint has none
    return str(path)


@pytest.fixture(scope="module")
def server(folder):
    srv = ServerProcess(
        folder,
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--num-pages",
        "1024",
        "--page-size",
        "8",
        "--api-key",
        API_KEY,
        "--served-model-name",
        "tiny",
        "tiny-alias",
        "--metrics-compat",
        "vllm",
        "--allowed-origins",
        ORIGIN,
        "--chat-template",
        os.path.join(folder, "template.jinja"),
        "--enable-request-log",
        "--stats-interval",
        "0.5",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(
        folder,
        dtype="float32",
        device="cpu",
        num_pages=256,
        page_size=8,
        chat_template=os.path.join(folder, "template.jinja"),
    )


def auth(**headers) -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}", **headers}


def samples(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(name + "{") or line.startswith(name + " ")]


def test_vllm_dashboard_metrics_exist(server):
    prompt = [5, 6, 7, 8, 9]
    r = httpx.post(
        server.url + "/v1/completions",
        headers=auth(),
        json={"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    text = httpx.get(server.url + "/metrics").text
    for name in VLLM_DASHBOARD_METRICS + VLLM_OTHER_METRICS:
        lines = samples(text, name)
        assert lines, f"{name} is missing from /metrics"
        if name != "vllm:cache_config_info":  # the dashboard selects by model_name
            assert all('model_name="tiny"' in line for line in lines), lines[0]
    assert "_created" not in text, "no _created series"
    assert not re.search(r"^fastqwen:", text, re.M), "one naming at a time"
    assert samples(text, "vllm:request_success_total")[0].count('finished_reason="length"') == 1
    # The values mean what vLLM's do: this was the only request.
    assert metric(text, "vllm:request_prompt_tokens_sum") == len(prompt)
    assert metric(text, "vllm:request_generation_tokens_sum") == 6 == metric(text, "vllm:generation_tokens_total")
    assert metric(text, "vllm:request_max_num_generation_tokens_sum") == 6
    assert metric(text, "vllm:time_per_output_token_seconds_count") == 5  # gaps between 6 tokens
    assert metric(text, "vllm:iteration_tokens_total_sum") >= len(prompt) + 5
    assert metric(text, "vllm:num_preemptions_total") == 0
    info = samples(text, "vllm:cache_config_info")[0]
    assert 'block_size="8"' in info and 'num_gpu_blocks="1024"' in info


def test_request_id_cors_and_head_probes(server):
    r = httpx.post(
        server.url + "/v1/completions",
        headers=auth(**{"x-request-id": "trace-42"}),
        json={"model": "tiny-alias", "prompt": [1, 2], "max_tokens": 2},
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    assert r.json()["model"] == "tiny", "an alias is accepted; responses carry the first name"
    made = httpx.get(server.url + "/health").headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", made), "one is made when the client sends none"
    bad = httpx.get(server.url + "/health", headers={"x-request-id": "two words"}).headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", bad), "an id with spaces is replaced"
    assert [m["id"] for m in httpx.get(server.url + "/v1/models", headers=auth()).json()["data"]] == [
        "tiny",
        "tiny-alias",
    ]
    for path in ("/health", "/metrics"):
        head = httpx.head(server.url + path)
        assert head.status_code == 200 and head.content == b"", path
    # A browser's preflight carries no credentials: it is answered before the API key is checked.
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    ok = httpx.options(server.url + "/v1/chat/completions", headers=preflight)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(server.url + "/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    simple = httpx.get(server.url + "/v1/models", headers=auth(Origin=ORIGIN))
    assert simple.headers["access-control-allow-origin"] == ORIGIN


def test_request_and_stats_log_lines(server):
    httpx.post(
        server.url + "/v1/completions",
        headers=auth(**{"x-request-id": "logged-7"}),
        json={"prompt": [3, 4], "max_tokens": 3, "ignore_eos": True},
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and "fastqwen.stats" not in server.log():
        time.sleep(0.2)
    log = server.log()
    line = next(line for line in log.splitlines() if "x-request-id logged-7" in line)
    assert "fastqwen.requests" in line and "prompt 2 tokens" in line and "output 3 tokens" in line
    assert re.search(
        r"fastqwen\.stats: prompt [\d.,]+ tok/s, generation [\d.,]+ tok/s, running \d+, waiting \d+, "
        r"KV cache [\d.]+% used, prefix cache hit rate",
        log,
    )
    assert "Uvicorn running" not in log
    ready = [
        i for i, line in enumerate(log.splitlines()) if "fastqwen.ready: ready: serving 'tiny' and 'tiny-alias'" in line
    ]
    summary = [i for i, line in enumerate(log.splitlines()) if "parameters (checkpoint weights), 2 layers" in line]
    assert ready and summary and summary[0] < ready[0], "the model summary, then the ready line"


def _chat(args: list[str], stdin: str) -> list[str]:
    # The same interpreter and import path as this test (as ServerProcess does), so the package under test runs.
    result = subprocess.run(
        [sys.executable, "-m", "fastqwen", "chat", *args], input=stdin, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "(conversation reset)" in result.stderr  # status lines go to stderr, replies alone to stdout
    return result.stdout.split("\n")


def _expected_replies(llm) -> list[str]:
    """The same conversation through the offline LLM.chat: two turns, then /reset and the first turn again."""
    first = [{"role": "user", "content": "t5 t6 t7"}]
    r1 = llm.chat(first, GREEDY, use_tqdm=False)[0].text
    second = first + [{"role": "assistant", "content": r1}, {"role": "user", "content": "t8"}]
    r2 = llm.chat(second, GREEDY, use_tqdm=False)[0].text
    assert r1 and r2 and r1 != r2, "a conversation whose turns differ, or the test proves little"
    return [r1, r2, r1, ""]


CONVERSATION = "t5 t6 t7\nt8\n/reset\nt5 t6 t7\n/exit\n"


def test_chat_on_a_local_model_equals_offline_chat(folder, llm):
    template = os.path.join(folder, "template.jinja")
    engine = [
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--num-pages",
        "256",
        "--page-size",
        "8",
        "--chat-template",
        template,
    ]
    assert _chat([folder, *engine, *CHAT_FLAGS], CONVERSATION) == _expected_replies(llm)


def test_chat_against_a_server_equals_offline_chat(server, llm):
    args = ["--url", server.url, "--api-key", API_KEY, *CHAT_FLAGS]
    assert _chat(args, CONVERSATION) == _expected_replies(llm)


def test_think_blocks_are_shown_dimmed_on_a_terminal():
    import io

    from fastqwen.chat import ThinkRenderer

    for styled, expected in ((True, "\x1b[2mthinking: plan\x1b[0m\nanswer\n"), (False, "<think>plan</think>answer\n")):
        out = io.StringIO()
        renderer = ThinkRenderer(out, styled)
        for piece in ["<thi", "nk>pl", "an</th", "ink>", "answer"]:  # tags split across pieces
            renderer.write(piece)
        renderer.finish()
        assert out.getvalue() == expected


def test_access_log_skips_probe_polls():
    import logging

    from fastqwen.server.http_conventions import _SkipProbes

    def line(path):  # uvicorn's access-log record
        return logging.LogRecord(
            "uvicorn.access",
            logging.INFO,
            "",
            0,
            '%s - "%s %s HTTP/%s" %d',
            ("127.0.0.1:5", "GET", path, "1.1", 200),
            None,
        )

    keep = _SkipProbes()
    assert not keep.filter(line("/health")) and not keep.filter(line("/metrics?x=1"))
    assert keep.filter(line("/v1/completions")) and keep.filter(line("/healthz"))


def test_token_gaps_handed_over_in_bulk_fill_the_buckets_observe_would():
    """Metrics.on_tokens keeps gaps and hands them to the histograms in bulk (observe_all): the exposition equals
    one where every gap was observed as it came, boundaries included (a value equal to a bound is in that bucket)."""
    from fastqwen.server.metrics import Metrics

    gaps = [0.0, 0.001, 0.0010001, 0.02, 0.5, 7.0, 1e9, 0.003] * 3
    bulk, each = Metrics("m"), Metrics("m")
    for gap in gaps:
        bulk.on_tokens(2, gap)
        each.itl.observe(gap)
        each.tpot.observe(gap)
        each.generation_tokens.inc(2)
    bulk.on_tokens(1, None)
    each.generation_tokens.inc(1)
    assert bulk.render() == each.render()
