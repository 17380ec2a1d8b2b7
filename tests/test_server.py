"""The real server on 127.0.0.1 (tiny random checkpoint, CPU), driven by the openai client and raw httpx."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time

import httpx
import openai
import pytest
from checkpoints import make_checkpoint
from fastqwen import LLM, SamplingParams
from fastqwen.server.reasoning import split_reasoning
from server_process import ServerProcess, metric, metrics_when_idle
from test_text import CHAT_TEMPLATE

API_KEY = "test-key-123"
MODEL = "tiny-qwen3"
# The test template can open a think block in the prompt, like newer Qwen templates do.
TEMPLATE = CHAT_TEMPLATE + "{%- if add_generation_prompt and open_think %}{{- '<think>\\n' }}{%- endif %}"
COMMON = [
    "--dtype",
    "float32",
    "--device",
    "cpu",
    "--num-pages",
    "4096",
    "--page-size",
    "8",
    "--served-model-name",
    MODEL,
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("served")
    make_checkpoint(str(path), tied=False, seed=21, max_positions=1024)
    with open(path / "tokenizer_config.json", "w") as f:
        json.dump({"chat_template": TEMPLATE, "eos_token": "<|im_end|>"}, f)
    return str(path)


@pytest.fixture(scope="module")
def server(folder):
    srv = ServerProcess(folder, *COMMON, "--api-key", API_KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(folder, dtype="float32", device="cpu", num_pages=512, page_size=8)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def test_completion_equals_offline_generate(client, llm):
    prompt = "t1 t22 t333 t4"
    result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    expected = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    choice = result.choices[0]
    assert choice.text == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert result.usage.prompt_tokens == expected.num_prompt_tokens == 4
    assert result.usage.completion_tokens == expected.num_completion_tokens
    assert result.usage.total_tokens == 4 + expected.num_completion_tokens
    assert result.usage.prompt_tokens_details.cached_tokens == 0


def test_completion_with_token_ids_and_several_prompts(client, llm):
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    result = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0)
    expected = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    assert [c.text for c in result.choices] == [e.text for e in expected]
    assert result.usage.prompt_tokens == 8
    assert result.usage.completion_tokens == sum(e.num_completion_tokens for e in expected)


def test_streamed_completion_equals_whole(client):
    kwargs = dict(model=MODEL, prompt="t7 t8 t9", max_tokens=10, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_chat_streaming_and_not(client, llm):
    messages = [{"role": "system", "content": "t1"}, {"role": "user", "content": [{"type": "text", "text": "t2 t3"}]}]
    kwargs = dict(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    whole = client.chat.completions.create(**kwargs)
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "system", "content": "t1"}, {"role": "user", "content": "t2 t3"}], enable_thinking=False
    )
    expected = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    assert whole.choices[0].message.content == expected.text
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == expected.num_prompt_tokens
    stream = list(client.chat.completions.create(**kwargs, stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in stream[1:])
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected.text


def test_chat_reasoning_content(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "t9"}], max_tokens=6, temperature=0)
    plain = client.chat.completions.create(**kwargs)
    thinking = client.chat.completions.create(**kwargs, extra_body={"chat_template_kwargs": {"open_think": True}})
    # The prompt opened <think>, and the model never closed it: everything it said is reasoning.
    message = thinking.choices[0].message
    assert message.content == ""
    assert (
        message.model_extra["reasoning_content"] == split_reasoning(message.model_extra["reasoning_content"], True)[0]
    )
    assert len(message.model_extra["reasoning_content"]) > 0
    assert "reasoning_content" not in plain.choices[0].message.model_extra
    chunks = list(
        client.chat.completions.create(**kwargs, stream=True, extra_body={"chat_template_kwargs": {"open_think": True}})
    )
    streamed = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks)
    assert streamed == message.model_extra["reasoning_content"]


def test_n_and_seed(client):
    kwargs = dict(model=MODEL, prompt="t3 t4", max_tokens=12, temperature=1.0, seed=1234, n=2)
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices], "the same seed must reproduce"
    assert first.choices[0].text != first.choices[1].text, "the n choices should differ"
    assert first.usage.prompt_tokens == 2
    assert first.usage.completion_tokens == 24


def test_stop_string(client):
    base = client.completions.create(
        model=MODEL, prompt="t11 t12", max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    text = base.choices[0].text
    words = text.split(" ")
    stop = words[3][-1] + " " + words[4][:2]
    cut = client.completions.create(
        model=MODEL, prompt="t11 t12", max_tokens=16, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].model_extra["stop_reason"] == stop


def test_logprobs(client, llm):
    result = client.completions.create(model=MODEL, prompt="t2 t4", max_tokens=5, temperature=0, logprobs=3)
    lp = result.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == result.usage.completion_tokens
    for token_lp, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3
        assert token_lp == pytest.approx(max(top.values()), abs=1e-5), "greedy picks the most likely token"
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "t1"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)


def test_exact_sse_framing(server):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "t5"}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=auth(), timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = "".join(response.iter_text())
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e[len("data: ") :]) for e in events[:-2]]
    for e in events[:-2]:
        assert re.fullmatch(r"data: \{.*\}", e, flags=re.S) and "\n" not in e
    assert payloads[0]["choices"][0]["delta"]["role"] == "assistant", "the role comes with the first token"
    assert payloads[-1]["choices"] == [] and set(payloads[-1]["usage"]) >= {
        "prompt_tokens",
        "completion_tokens",
        "total_tokens",
        "prompt_tokens_details",
    }
    assert (
        payloads[-2]["choices"][0]["finish_reason"] in ("stop", "length") and payloads[-2]["choices"][0]["delta"] == {}
    )
    assert all(p["object"] == "chat.completion.chunk" and p["id"] == payloads[0]["id"] for p in payloads)


def test_error_statuses(server, client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="t1", max_tokens=-1)  # 0 is allowed: the prompt only
    assert err.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt="t1 t2", max_tokens=5000)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="t1", top_p=1.5)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="t1")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    response = httpx.post(
        server.url + "/v1/completions", content=b"{not json", headers={**auth(), "Content-Type": "application/json"}
    )
    assert response.status_code == 400 and response.json()["error"]["code"] == 400
    response = httpx.post(server.url + "/v1/completions", json={"prompt": ["t1", 7]}, headers=auth())
    assert response.status_code == 400 and set(response.json()["error"]) == {"message", "type", "param", "code"}
    response = httpx.post(
        server.url + "/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]}, headers=auth()
    )
    assert response.status_code == 400 and "wizard" in response.json()["error"]["message"]
    response = httpx.post(
        server.url + "/v1/completions", json={"prompt": "t1", "stream_options": {"include_usage": True}}, headers=auth()
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "stream_options"


def test_health_models_generate_metrics(server, client, llm):
    assert httpx.get(server.url + "/health").status_code == 200
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].model_extra["max_model_len"] == 1024
    single = httpx.post(
        server.url + "/generate",
        json={"text": "t1 t2", "sampling_params": {"max_new_tokens": 5, "temperature": 0}},
        headers=auth(),
    ).json()
    expected = llm.generate("t1 t2", SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)[0]
    assert single["text"] == expected.text and single["output_ids"] == expected.token_ids
    assert single["meta_info"]["prompt_tokens"] == 2 and single["meta_info"]["completion_tokens"] == len(
        expected.token_ids
    )
    assert single["meta_info"]["finish_reason"]["type"] == expected.finish_reason
    batch = httpx.post(
        server.url + "/generate",
        json={"input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
        headers=auth(),
    ).json()
    assert isinstance(batch, list) and len(batch) == 2
    with httpx.stream(
        "POST",
        server.url + "/generate",
        json={"text": "t1 t2", "stream": True, "sampling_params": {"max_new_tokens": 5, "temperature": 0}},
        headers=auth(),
    ) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["text"] == expected.text, "streamed /generate text is cumulative"
    text = httpx.get(server.url + "/metrics").text
    for name in [
        "fastqwen:num_requests_running",
        "fastqwen:num_requests_waiting",
        "fastqwen:kv_cache_usage_perc",
        "fastqwen:prefix_cache_queries_total",
        "fastqwen:prefix_cache_hits_total",
        "fastqwen:prompt_tokens_total",
        "fastqwen:generation_tokens_total",
        "fastqwen:num_aborted_requests_total",
        "fastqwen:request_success_total",
        "fastqwen:time_to_first_token_seconds_bucket",
        "fastqwen:inter_token_latency_seconds_bucket",
        "fastqwen:e2e_request_latency_seconds_bucket",
        "fastqwen:request_queue_time_seconds_bucket",
    ]:
        assert name in text, name
    assert metric(text, "fastqwen:generation_tokens_total") > 0


def test_disconnected_clients_release_everything(server):
    """50 streaming and 50 non-streaming clients go away mid-generation; nothing is left running or allocated."""
    before = metric(httpx.get(server.url + "/metrics").text, "fastqwen:num_aborted_requests_total")

    async def scenario():
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=server.url, headers=auth(), timeout=60, limits=limits) as http:
            body = {"model": MODEL, "prompt": "t1 t2 t3", "max_tokens": 900, "temperature": 0, "ignore_eos": True}

            async def streaming():
                async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    async for _ in r.aiter_lines():
                        pass

            async def whole():
                await http.post("/v1/completions", json=body)

            tasks = [asyncio.create_task(streaming()) for _ in range(50)] + [
                asyncio.create_task(whole()) for _ in range(50)
            ]
            for _ in range(200):
                await asyncio.sleep(0.05)
                text = (await http.get("/metrics")).text
                if metric(text, "fastqwen:num_requests_running") >= 100:
                    break
            assert metric(text, "fastqwen:num_requests_running") >= 100, "the clients never all got running"
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(scenario())
    text = metrics_when_idle(server.url, timeout=20)
    assert metric(text, "fastqwen:num_requests_running") == 0
    assert metric(text, "fastqwen:num_requests_waiting") == 0
    assert metric(text, "fastqwen:kv_cache_usage_perc") == 0, "every KV page must be free again"
    assert metric(text, "fastqwen:num_aborted_requests_total") - before == 100


def test_queue_limit_answers_503_early(folder, llm):
    """200 concurrent requests at a server that runs 4 and queues 16: the overflow gets 503 fast, the rest succeed."""
    srv = ServerProcess(folder, *COMMON, "--max-num-seqs", "4", "--max-queued-requests", "16")
    try:
        prompts = [[(7 * i) % 380 + 1, (11 * i) % 380 + 1, 3] for i in range(200)]
        expected = {
            tuple(p): o.text
            for p, o in zip(
                prompts,
                llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True), use_tqdm=False),
            )
        }

        async def scenario():
            async with httpx.AsyncClient(
                base_url=srv.url, timeout=120, limits=httpx.Limits(max_connections=250)
            ) as http:

                async def one(prompt):
                    started = time.monotonic()
                    r = await http.post(
                        "/v1/completions",
                        json={"prompt": prompt, "max_tokens": 128, "temperature": 0, "ignore_eos": True},
                    )
                    return prompt, r, time.monotonic() - started

                return await asyncio.gather(*(one(p) for p in prompts))

        results = asyncio.run(scenario())
    finally:
        srv.stop()
    ok = [(p, r) for p, r, _ in results if r.status_code == 200]
    ok_times = sorted(dt for _, r, dt in results if r.status_code == 200)
    rejected = [(r, dt) for _, r, dt in results if r.status_code == 503]
    assert len(ok) + len(rejected) == 200
    # At least the queue's 16 (requests on their way to the engine core count as waiting until it admits them).
    assert len(ok) >= 16 and len(rejected) >= 100, (len(ok), len(rejected))
    for prompt, r in ok:
        assert r.json()["choices"][0]["text"] == expected[tuple(prompt)]
    for r, dt in rejected:
        assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == 503
    # Early: before the served requests (the same machine's load slows both), and never after a long wait.
    median_rejected = sorted(dt for _, dt in rejected)[len(rejected) // 2]
    assert median_rejected < ok_times[len(ok_times) // 2] and median_rejected < 10.0, (median_rejected, ok_times)


def test_sigterm_drains_running_requests(folder):
    # 60 s to drain: 200 tokens take about a second alone, but up to 20 s were seen on a loaded 2-core machine.
    srv = ServerProcess(folder, *COMMON, "--shutdown-timeout", "60")
    try:
        result = {}

        def long_request():
            body = {"prompt": "t1", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=90) as r:
                result["events"] = [line for line in r.iter_lines() if line.startswith("data: ")]

        import threading

        worker = threading.Thread(target=long_request)
        worker.start()
        while metric(httpx.get(srv.url + "/metrics").text, "fastqwen:num_requests_running") < 1:
            time.sleep(0.02)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.HTTPError):  # the listening socket is closed: new requests cannot get in
            httpx.post(
                srv.url + "/v1/completions", json={"prompt": "t1", "max_tokens": 1}, timeout=5
            ).raise_for_status()
        worker.join(90)
        # uvicorn re-raises the captured SIGTERM once it has shut down, so the exit status says "terminated".
        assert srv.proc.wait(90) in (0, -signal.SIGTERM)
        assert result["events"][-1] == "data: [DONE]"
        finish = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in result["events"][:-1]]
        assert finish[-1] == "length", "the running request was allowed to finish"
    finally:
        srv.stop()
