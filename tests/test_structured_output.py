"""Structured output and logit_bias, on a random model (an adversarial one: it wants nothing the grammar wants).

Every completion under a JSON schema or a regex must parse and validate (jsonschema / re, independent of the
grammar engine), through the offline LLM and through the server, streaming and not; bad specs are 400s naming the
field; the bitmask and the bias are checked against plain PyTorch arithmetic and Hugging Face logits.
"""

from __future__ import annotations

import json
import os
import random
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
from checkpoints import hf_logits, make_checkpoint, write_byte_level_tokenizer
from fastqwen import LLM, SamplingParams
from fastqwen.errors import InvalidRequestError
from fastqwen.grammar import check_structured, tool_call_structured
from fastqwen.sampling_params import StructuredOutput
from server_process import ServerProcess
from test_text import CHAT_TEMPLATE

EOS = 2  # <|im_end|> of the byte-level tokenizer
VOCAB = 384

SCHEMAS = [
    {  # nested objects, arrays, enums, required fields
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
            "pos": {
                "type": "object",
                "properties": {"x": {"type": "boolean"}, "y": {"enum": [1, 2, None]}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "tags", "pos"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer", "minimum": -5, "maximum": 5},
                        "kind": {"enum": ["a", "b"]},
                    },
                    "required": ["id", "kind"],
                    "additionalProperties": False,
                },
            },
            "ok": {"type": "boolean"},
        },
        "required": ["items", "ok"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,3}$"}, "minItems": 1, "maxItems": 4},
    {"enum": ["alpha", "beta", {"k": [1, 2]}]},
]
REGEX = r"[0-9]{3}-[a-z]{2,4}( [A-Z]{1,5})?"


def _write_checkpoint(folder: str, **shape) -> None:
    make_checkpoint(folder, tied=True, vocab=VOCAB, seed=5, max_positions=1024, **shape)
    write_byte_level_tokenizer(folder, VOCAB)  # byte-level BPE: any text can be written, as with Qwen's
    for name, value in (("config.json", EOS), ("generation_config.json", [EOS])):
        path = os.path.join(folder, name)
        with open(path) as f:
            data = json.load(f)
        data["eos_token_id"] = value
        with open(path, "w") as f:
            json.dump(data, f)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>"}, f)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("structured"))
    _write_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(folder, dtype="float32", device="cpu", num_pages=2048, page_size=8, max_num_seqs=64)


@pytest.fixture(scope="module")
def server(folder):
    srv = ServerProcess(
        folder,
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--num-pages",
        "4096",
        "--page-size",
        "8",
        "--max-num-seqs",
        "256",
        "--served-model-name",
        "m",
    )
    yield srv
    srv.stop()


def _validate(instance, schema: dict) -> None:
    import jsonschema  # a test extra (imported here so the GPU tests can share this module's helpers without it)

    jsonschema.validate(instance, schema)


def _valid_json(text: str, schema: dict) -> None:
    _validate(json.loads(text), schema)


# ---- the specs ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "structured, words",
    [
        (StructuredOutput("json_schema", '{"type": "frob"}', field="response_format"), "frob"),
        (StructuredOutput("json_schema", "{not json", field="guided_json"), "not valid JSON"),
        (StructuredOutput("json_schema", '{"type": "object", "if": {}}', strict=True), "if"),
        (StructuredOutput("regex", "a(b", field="guided_regex"), "unclosed group"),
        (StructuredOutput("choice", "[]", field="guided_choice"), "non-empty"),
        (StructuredOutput("grammar", "start: missing_rule", field="ebnf"), "missing_rule"),
        (StructuredOutput("grammar", "root ::= (", field="guided_grammar"), "grammar"),
    ],
)
def test_bad_specs_are_refused_naming_the_field(structured, words):
    with pytest.raises(InvalidRequestError) as e:
        check_structured(structured)
    assert e.value.param == structured.field and words in str(e.value)


def test_non_strict_schema_ignores_what_the_compiler_lacks():
    check_structured(StructuredOutput("json_schema", '{"type": "object", "if": {}}', strict=False))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"5": float("nan")}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
        ({"logit_bias": {"-3": 1}}, "logit_bias"),
        ({"structured": '{"type": "object"}'}, "structured"),
    ],
)
def test_bad_sampling_fields(kwargs, field):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == field
    with pytest.raises(InvalidRequestError) as e:
        StructuredOutput("xml", "x", field="response_format")
    assert e.value.param == "response_format"


# ---- offline: masks, completion, bias -----------------------------------------------------------------------------


def test_schema_mix_and_regex_offline(llm):
    """A batch mixing every schema, the regex and unconstrained rows: each constrained output is complete and valid."""
    params, checks = [], []
    for i in range(12):
        k = i % (len(SCHEMAS) + 2)
        if k < len(SCHEMAS):
            params.append(
                SamplingParams(
                    temperature=1.0,
                    max_tokens=160,
                    seed=i,
                    structured=StructuredOutput("json_schema", json.dumps(SCHEMAS[k])),
                )
            )
            checks.append(lambda text, s=SCHEMAS[k]: _valid_json(text, s))
        elif k == len(SCHEMAS):
            params.append(
                SamplingParams(temperature=1.0, max_tokens=60, seed=i, structured=StructuredOutput("regex", REGEX))
            )
            checks.append(lambda text: re.fullmatch(REGEX, text) or pytest.fail(f"{text!r} does not match"))
        else:
            params.append(SamplingParams(temperature=1.0, max_tokens=8, seed=i))
            checks.append(None)
    outs = llm.generate(["hello"] * len(params), params, use_tqdm=False)
    for out, check in zip(outs, checks):
        if check is not None:
            assert out.finish_reason == "stop", (out.text, out.finish_reason)
            check(out.text)


def test_choice_grammar_and_gbnf(llm):
    choices = ["yes", "no", 'a "quoted"\nline', "ünï"]
    specs = [
        (StructuredOutput("choice", json.dumps(choices)), lambda t: t in choices),
        (
            StructuredOutput("grammar", 'start: "<" ITEM ("," ITEM)* ">"\nITEM: /[a-c]{1,2}/'),
            lambda t: re.fullmatch(r"<[a-c]{1,2}(,[a-c]{1,2})*>", t),
        ),
        (StructuredOutput("grammar", 'root ::= "x" ("y" | "z")+ "."'), lambda t: re.fullmatch(r"x[yz]+\.", t)),
    ]
    for structured, ok in specs:
        outs = llm.generate(
            ["hi"] * 6, SamplingParams(temperature=1.0, max_tokens=40, structured=structured), use_tqdm=False
        )
        texts = [o.text for o in outs if o.finish_reason == "stop"]
        assert len(texts) >= 4 and all(ok(t) for t in texts), texts


def test_grammar_ends_the_request_even_with_ignore_eos(llm):
    structured = StructuredOutput("choice", '["done"]')
    out = llm.generate(["x"], SamplingParams(max_tokens=50, ignore_eos=True, structured=structured), use_tqdm=False)[0]
    assert out.text == "done" and out.finish_reason == "stop" and out.stop_reason is None


def test_requests_with_one_spec_spread_over_independent_compiles(folder, llm):
    """llguidance's copies of one compiled grammar share its lexer behind one lock; the compiler spreads the requests
    of one spec round robin over `lexer_groups` compiles of their own (so their masks can be filled in parallel).
    Walking the same tokens, a matcher of every compile gives the same masks; and the engine's outputs do not
    depend on how many compiles there are."""
    from fastqwen.grammar import GrammarCompiler, fill_bitmasks

    spec = StructuredOutput("json_schema", json.dumps(SCHEMAS[0]))
    compiler = GrammarCompiler(os.path.join(folder, "tokenizer.json"), VOCAB, [EOS], lexer_groups=3)
    futures = [compiler.submit(spec) for _ in range(7)]
    # While a compile runs, a finished one may serve, so the first seven need not cycle, and waiting on the futures
    # they got need not wait for all three compiles: wait on the spec's compiles themselves.
    compiles = compiler.compiles_of(spec)
    assert len(compiles) == 3
    for f in compiles:
        f.result()
    futures += [compiler.submit(spec) for _ in range(6)]  # every compile is done now: round robin over all three
    assert len({id(f) for f in futures}) == 3
    assert len({id(f) for f in futures[7:10]}) == 3 and futures[10:13] == futures[7:10]
    matchers = [compiler.matcher(f) for f in futures[7:10]]
    masks = np.zeros((3, (VOCAB + 31) // 32), dtype=np.int32)
    rng = random.Random(4)
    for _ in range(30):
        fill_bitmasks([(m, i) for i, m in enumerate(matchers)], masks)
        assert (masks == masks[0]).all()
        allowed = np.flatnonzero(np.unpackbits(masks[0].view(np.uint8), bitorder="little")[:VOCAB])
        token = int(allowed[rng.randrange(len(allowed))])
        if not all([m.advance(token) for m in matchers]):
            break
    compiler.close()
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=60, structured=spec) for i in range(6)]
    one = LLM(folder, dtype="float32", device="cpu", num_pages=512, page_size=8, max_num_seqs=8)
    one.engine.grammars.lexer_groups = 1
    groups, llm.engine.grammars.lexer_groups = llm.engine.grammars.lexer_groups, 4
    try:
        spread = [o.token_ids for o in llm.generate(["x"] * 6, params, use_tqdm=False)]
    finally:
        llm.engine.grammars.lexer_groups = groups
    assert spread == [o.token_ids for o in one.generate(["x"] * 6, params, use_tqdm=False)]


def test_mask_reference_against_plain_arithmetic():
    """ops.sample's reference with a bitmask and biases: greedy rows pick the argmax of (logits + bias) over the
    allowed tokens, computed here with float64 and Python bit arithmetic; sampled rows draw only allowed tokens."""
    from fastqwen import ops
    from fastqwen.ops.sampling import sample_reference

    gen = torch.Generator().manual_seed(0)
    rows, vocab = 6, 200
    logits = torch.randn(rows, vocab, generator=gen)
    allowed = torch.rand(rows, vocab, generator=gen) < 0.1
    words = (vocab + 31) // 32
    bits = np.zeros((rows, words), dtype=np.uint32)
    for r in range(rows):
        for t in allowed[r].nonzero().flatten().tolist():
            bits[r, t // 32] |= np.uint32(1 << (t % 32))
    mask = torch.from_numpy(bits.view(np.int32))
    bias_ids = torch.full((rows, 3), -1, dtype=torch.int32)
    bias = torch.zeros(rows, 3)
    for r in range(rows):
        ids = allowed[r].nonzero().flatten()[:3]
        bias_ids[r, : len(ids)] = ids.to(torch.int32)
        bias[r, : len(ids)] = torch.tensor([3.0, -2.0, 1.5][: len(ids)])
    masked = [1, 1, 1, 0, 1, 1]
    temperature = [0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    packed = ops.pack_sampler_rows(temperature, num_blocked=[3] * rows, masked=masked, seed=list(range(rows)))
    tokens = torch.zeros(rows, dtype=torch.int64)
    sample_reference(logits, packed, tokens, blocked=bias_ids, bias=bias, mask=mask)
    for r in range(rows):
        x = logits[r].double().clone()
        for t, b in zip(bias_ids[r].tolist(), bias[r].tolist()):
            if t >= 0:
                x[t] += b
        if masked[r]:
            x[~allowed[r]] = float("-inf")
            assert allowed[r, tokens[r]]
        if temperature[r] == 0.0:
            assert tokens[r] == int(x.argmax())


def test_logit_bias_against_hf(folder):
    """Greedy with logit_bias: every token is the argmax of Hugging Face's logits plus the bias, and the bias changed
    the output (a bias big enough to matter, small enough not to decide every step)."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    llm = LLM(folder, dtype="float32", device="cpu", num_pages=256, page_size=8)
    prompt = llm.tokenizer.encode("the bias test")
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    raw = hf_logits(model, prompt, plain.token_ids)
    # Favour the runner-up of a few steps, and push down the winner of the first: each value small enough to be a
    # real contest.
    second = raw.topk(2, dim=-1).indices[:, 1].tolist()
    bias = {second[3]: 0.3, second[7]: 0.5, plain.token_ids[0]: -0.2}
    out = llm.generate(
        [prompt],
        SamplingParams(
            temperature=0.0, max_tokens=12, ignore_eos=True, logit_bias={str(k): v for k, v in bias.items()}
        ),
        use_tqdm=False,
    )[0]
    logits = hf_logits(model, prompt, out.token_ids)
    for i, token in enumerate(out.token_ids):
        x = logits[i].double().clone()
        for t, b in bias.items():
            x[t] += b
        assert token == int(x.argmax()), i
    assert out.token_ids != plain.token_ids


def test_tool_call_spec_gives_valid_calls(llm):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "city": {"enum": ["Paris", "東京"]},
                        "days": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["city", "days"],
                    "additionalProperties": False,
                },
            },
        },
        {"type": "function", "function": {"name": "now"}},
    ]
    block = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.S)
    schemas = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in tools}
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        structured = tool_call_structured(tools, choice)
        outs = llm.generate(
            ["call"] * 6, SamplingParams(temperature=1.0, max_tokens=200, seed=3, structured=structured), use_tqdm=False
        )
        for out in outs:
            assert out.finish_reason == "stop", out.text
            calls = block.findall(out.text)
            assert calls and "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls) == out.text
            for call in calls:
                parsed = json.loads(call)
                assert set(parsed) == {"name", "arguments"}
                _validate(parsed["arguments"], schemas[parsed["name"]])
            if choice != "required":
                assert len(calls) == 1 and json.loads(calls[0])["name"] == "get_weather"
    with pytest.raises(InvalidRequestError) as e:
        tool_call_structured(tools, {"type": "function", "function": {"name": "nope"}})
    assert e.value.param == "tool_choice"


# ---- through the server: 200+ completions, streaming and not -------------------------------------------------------


def _sse_texts(response: httpx.Response, n: int, chat: bool) -> list[str]:
    texts = [""] * n
    for line in response.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[6:])["choices"]:
            piece = choice["delta"].get("content") if chat else choice["text"]
            texts[choice["index"]] += piece or ""
    return texts


def _run(server, path: str, payload: dict, chat: bool) -> list[str]:
    with httpx.Client(base_url=server.url, timeout=600) as http:
        if payload.get("stream"):
            with http.stream("POST", path, json=payload) as r:
                assert r.status_code == 200
                return _sse_texts(r, payload["n"], chat)
        r = http.post(path, json=payload)
        assert r.status_code == 200, r.text
        if path == "/generate":
            return [r.json()["text"]]
        choices = r.json()["choices"]
        assert all(c["finish_reason"] == "stop" for c in choices), choices
        return [c["message"]["content"] if chat else c["text"] for c in choices]


def test_server_structured_requests_all_valid(server):
    """>= 200 completions over the schema mix and the regex, every API dialect, streaming and not, all in flight
    together: every one valid."""
    jobs = []  # (path, payload, check)
    for schema in SCHEMAS:
        variants = [
            ("/v1/completions", {"prompt": "json:", "guided_json": schema}),
            (
                "/v1/chat/completions",
                {
                    "messages": [{"role": "user", "content": "json"}],
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "s", "schema": schema, "strict": True},
                    },
                },
            ),
            ("/v1/completions", {"prompt": "json:", "structured_outputs": {"json": json.dumps(schema)}}),
        ]
        for path, body in variants:
            for stream in (False, True):
                payload = {"model": "m", "max_tokens": 160, "temperature": 1.0, "n": 8, "stream": stream, **body}
                jobs.append((path, payload, lambda t, s=schema: _valid_json(t, s)))
    for stream in (False, True):
        payload = {
            "model": "m",
            "prompt": "id:",
            "max_tokens": 60,
            "temperature": 1.0,
            "n": 8,
            "stream": stream,
            "guided_regex": REGEX,
        }
        jobs.append(
            ("/v1/completions", payload, lambda t: re.fullmatch(REGEX, t) or pytest.fail(f"{t!r} does not match"))
        )
    jobs.append(
        (
            "/generate",
            {
                "text": "x",
                "sampling_params": {"max_new_tokens": 160, "temperature": 1.0, "json_schema": json.dumps(SCHEMAS[1])},
            },
            lambda t: _valid_json(t, SCHEMAS[1]),
        )
    )
    jobs.append(
        (
            "/generate",
            {"text": "x", "sampling_params": {"max_new_tokens": 40, "temperature": 1.0, "ebnf": 'root ::= "a" [0-9]+'}},
            lambda t: re.fullmatch(r"a[0-9]+", t) or pytest.fail(t),
        )
    )
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: _run(server, job[0], job[1], "chat" in job[0]), jobs))
    checked = 0
    for (_, _, check), texts in zip(jobs, results):
        for text in texts:
            check(text)
            checked += 1
    assert checked >= 200


@pytest.mark.parametrize(
    "path, body, field",
    [
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "frob"}}}},
            "response_format",
        ),
        ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
        ("/v1/completions", {"guided_regex": "a(b"}, "guided_regex"),
        ("/v1/completions", {"guided_grammar": "start: nothing_here"}, "guided_grammar"),
        ("/v1/completions", {"guided_choice": []}, "guided_choice"),
        ("/v1/completions", {"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
        ("/v1/completions", {"structured_outputs": {"json": "{bad"}}, "structured_outputs"),
        ("/v1/completions", {"logit_bias": {"999999": 1}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"5": -101}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"five": 1}}, "logit_bias"),
        ("/generate", {"sampling_params": {"regex": "(("}}, "regex"),
        ("/generate", {"sampling_params": {"json_schema": "{"}}, "json_schema"),
    ],
)
def test_server_refuses_bad_specs_with_400(server, path, body, field):
    if path == "/generate":
        payload = {"text": "x", **body}
    elif "chat" in path:
        payload = {"model": "m", "messages": [{"role": "user", "content": "x"}], **body}
    else:
        payload = {"model": "m", "prompt": "x", **body}
    r = httpx.post(server.url + path, json=payload, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.json()


def test_a_tokenizer_the_grammar_engine_cannot_read_is_a_400(tmp_path):
    """The word-level test tokenizer has no decoder: llguidance cannot use it, and the request is refused up front."""
    make_checkpoint(str(tmp_path), tied=True, seed=1)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", num_pages=64, page_size=8)
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(
            ["t1"], SamplingParams(structured=StructuredOutput("json_object", field="guided_json")), use_tqdm=False
        )
    assert e.value.param == "guided_json" and "not available" in str(e.value)


def test_server_tool_choice_required_and_named_always_call(server):
    """tool_choice "required" / a named function through the openai client: the random model's output is forced into
    Qwen3's call blocks, which come back as tool_calls whose arguments follow each tool's schema, streamed or not."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "city": {"enum": ["Paris", "東京"]},
                        "days": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["city", "days"],
                    "additionalProperties": False,
                },
            },
        },
        {
            "type": "function",
            "function": {
                "name": "now",
                "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
            },
        },
    ]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    messages = [{"role": "user", "content": "weather?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        whole = client.chat.completions.create(
            model="m", messages=messages, tools=tools, tool_choice=choice, max_tokens=300, temperature=1.0, n=4, seed=11
        )
        for c in whole.choices:
            assert c.finish_reason == "tool_calls" and c.message.tool_calls, c.message
            for call in c.message.tool_calls:
                _validate(json.loads(call.function.arguments), schemas[call.function.name])
            if choice is named:
                assert [call.function.name for call in c.message.tool_calls] == ["get_weather"]
        stream = client.chat.completions.create(
            model="m",
            messages=messages,
            tools=tools,
            tool_choice=choice,
            max_tokens=300,
            temperature=1.0,
            seed=11,
            stream=True,
        )
        names, arguments, finish = {}, {}, None
        for chunk in stream:
            for c in chunk.choices:
                finish = c.finish_reason or finish
                for d in c.delta.tool_calls or []:
                    if d.function.name:
                        names[d.index] = d.function.name
                    arguments[d.index] = arguments.get(d.index, "") + (d.function.arguments or "")
        assert finish == "tool_calls" and names
        for index, name in names.items():
            _validate(json.loads(arguments[index]), schemas[name])
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="m", messages=messages, tools=tools, tool_choice="required", response_format={"type": "json_object"}
        )
    assert err.value.body["param"] == "tool_choice"
