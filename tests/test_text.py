"""Stop strings, the incremental detokenizer and chat templates."""

from __future__ import annotations

import json
import os
import random

import pytest
from checkpoints import EOS_IDS, MULTILINGUAL_TEXT, make_checkpoint, write_byte_level_tokenizer
from fastqwen import LLM, InvalidRequestError, SamplingParams
from fastqwen.tokenizer import ChatTemplate, Tokenizer


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("bytebpe"))
    write_byte_level_tokenizer(folder)
    return Tokenizer(folder)


def stream(tokenizer: Tokenizer, ids: list[int], **kwargs) -> tuple[list[str], object]:
    detok = tokenizer.detokenizer(**kwargs)
    deltas, matched = [], None
    for t in ids:
        matched = detok.append(t)
        deltas.append(detok.take_delta())
        if matched is not None:
            break
    detok.finish()
    deltas.append(detok.take_delta())
    return deltas, (detok, matched)


@pytest.mark.parametrize("text", MULTILINGUAL_TEXT)
def test_detokenizer_streams_whole_characters_only(byte_tokenizer, text):
    ids = byte_tokenizer.encode(text)
    assert any("\ufffd" in byte_tokenizer.decode([t]) for t in ids), "no token splits a character: the test is weak"
    deltas, (detok, _) = stream(byte_tokenizer, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == byte_tokenizer.decode(ids) == text
    assert detok.text == text


def test_detokenizer_emits_invalid_bytes_eventually(byte_tokenizer):
    """A dangling lead byte that no later token completes is emitted (as U+FFFD) rather than held forever."""
    ids = byte_tokenizer.encode("🦊")
    broken = ids[:1] + byte_tokenizer.encode("abcdefgh")
    deltas, _ = stream(byte_tokenizer, broken)
    assert "".join(deltas) == byte_tokenizer.decode(broken)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens_is_cut(byte_tokenizer, include):
    text = MULTILINGUAL_TEXT[1]
    ids = byte_tokenizer.encode(text)
    stop = "狐狸跳"  # several tokens in this tokenizer
    deltas, (detok, matched) = stream(byte_tokenizer, ids, stop=["never", stop], include_stop_str_in_output=include)
    assert matched == stop
    cut = text.index(stop) + (len(stop) if include else 0)
    assert detok.text == text[:cut]
    assert "".join(deltas) == text[:cut]
    if not include:
        assert all(stop[0] not in d for d in deltas), "a piece of the stop string was streamed"


def test_stop_strings_through_the_engine(tmp_path):
    folder = str(tmp_path)
    make_checkpoint(folder, tied=True, seed=8)
    llm = LLM(folder, dtype="float32", device="cpu", num_pages=64)
    prompt = [random.Random(2).randrange(380) for _ in range(10)]
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    words = free.text.split(" ")
    assert len(words) >= 6
    # The end of the 3rd word, a space and the start of the 4th: a stop string across two tokens.
    stop = words[2][-2:] + " " + words[3][:2]
    at = free.text.index(stop)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop])
    rid = llm.add_request(prompt, params)
    streamed, output, steps = [], None, 0
    while llm.has_unfinished():
        steps += 1
        for update in llm.step():
            assert update.request_id == rid
            streamed.append(update.new_text)
            output = update.output
    assert output.finish_reason == "stop" and output.stop_reason == stop
    assert output.text == free.text[:at]
    assert "".join(streamed) == output.text
    completes = next(n for n in range(1, 21) if stop in llm.tokenizer.decode(free.token_ids[:n]))
    assert output.token_ids == free.token_ids[:completes]
    # The engine never sees text: the frontend aborts it there on the match (else it would run to max_tokens).
    assert steps == completes and llm.engine.kv_usage() == 0


def test_eos_is_reported_as_the_stop_reason(tmp_path):
    folder = str(tmp_path)
    make_checkpoint(folder, tied=False, seed=9)
    llm = LLM(folder, dtype="float32", device="cpu", num_pages=64)
    prompt = [5, 6, 7]
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    # Make the model's own 3rd token an EOS by declaring it one in generation_config.json.
    with open(os.path.join(folder, "generation_config.json")) as f:
        gen = json.load(f)
    gen["eos_token_id"] = EOS_IDS + [free.token_ids[2]]
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump(gen, f)
    stopped = LLM(folder, dtype="float32", device="cpu", num_pages=64).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False
    )[0]
    first = next(i for i, t in enumerate(free.token_ids) if t in gen["eos_token_id"])
    assert stopped.finish_reason == "stop" and stopped.stop_reason == free.token_ids[first]
    assert stopped.token_ids == free.token_ids[: first + 1]


# A ChatML template with Qwen3's features: system prompt, thinking switch, tool results, tojson, raise_exception.
CHAT_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}{% if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{% endif %}
{{- '# Tools\\n' }}{% for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{% endfor %}{{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
{%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}
{{- raise_exception('unknown role ' + message.role) }}
{%- endif %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{%- set ns.turns = ns.turns + 1 %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' + message.content | trim + '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "两个问题 🦊"}],
    [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "  4  "},
        {"role": "tool", "content": '{"result": 4}'},
        {"role": "user", "content": "Thanks"},
    ],
]


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("chat"))
    write_byte_level_tokenizer(folder)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(
            {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast"}, f
        )
    return folder


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(chat_folder, conversation, kwargs, add_generation_prompt):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(chat_folder)
    ours = Tokenizer(chat_folder)
    messages = CONVERSATIONS[conversation]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs) == expected


def test_chat_template_with_tools_and_content_parts_like_transformers(chat_folder):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(chat_folder)
    tools = [{"type": "function", "function": {"name": "météo", "parameters": {"city": "東京"}}}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "line one"}, {"type": "text", "text": "line two"}]}]
    joined = [{"role": "user", "content": "line one\nline two"}]
    expected = hf.apply_chat_template(joined, tools=tools, tokenize=False, add_generation_prompt=True)
    assert Tokenizer(chat_folder).chat_template.render(parts, tools=tools) == expected


def test_chat_template_errors_are_invalid_requests(chat_folder):
    ours = Tokenizer(chat_folder)
    with pytest.raises(InvalidRequestError, match="unknown role") as err:
        ours.apply_chat_template([{"role": "wizard", "content": "hi"}])
    assert err.value.param == "messages"
    with pytest.raises(InvalidRequestError, match="messages"):
        ours.apply_chat_template([])
    with pytest.raises(InvalidRequestError, match="text parts"):
        ours.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])


def test_llm_chat_uses_the_template(tmp_path):
    folder = str(tmp_path)
    make_checkpoint(folder, tied=True, seed=2)
    write_byte_level_tokenizer(folder, vocab_size=384)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHAT_TEMPLATE}, f)
    llm = LLM(folder, dtype="float32", device="cpu", num_pages=64)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    messages = [{"role": "user", "content": "Hello"}]
    via_chat = llm.chat(messages, params, chat_template_kwargs={"enable_thinking": False}, use_tqdm=False)[0]
    prompt = ChatTemplate(CHAT_TEMPLATE).render(messages, enable_thinking=False)
    assert prompt.endswith("<think>\n\n</think>\n\n")
    via_text = llm.generate(prompt, params, use_tqdm=False)[0]
    assert via_chat.prompt_token_ids == via_text.prompt_token_ids == llm.tokenizer.encode(prompt)
    assert via_chat.token_ids == via_text.token_ids


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_late_in_a_long_stream_with_deltas_taken_at_random(byte_tokenizer, include):
    """A stop string thousands of characters in, the deltas taken after some tokens only (a delta of several tokens, as
    speculative decoding hands them): the deltas add up to the text cut at the stop string (str.find on the whole text),
    none holds a piece of it, and the final text is the same."""
    rng = random.Random(5)
    words = ["alpha", "béta", "gamma", "δέλτα", "eps", "zeta", "日本語", "🦊"]
    for trial in range(8):
        stop = ["STOPHERE", "XY", "never"][trial % 3]
        body = " ".join(rng.choice(words) for _ in range(rng.randint(300, 900)))
        at = rng.randint(0, len(body))
        text = body[:at] + (stop if stop != "never" else "") + body[at:]
        ids = byte_tokenizer.encode(text)
        detok = byte_tokenizer.detokenizer(stop=["never", stop, "STOPHERE"], include_stop_str_in_output=include)
        deltas, matched = [], None
        for t in ids:
            matched = detok.append(t)
            if matched is not None or rng.random() < 0.3:
                deltas.append(detok.take_delta())
            if matched is not None:
                break
        detok.finish()
        deltas.append(detok.take_delta())
        if stop == "never":
            assert matched is None and "".join(deltas) == detok.text == text
            continue
        assert matched == stop
        cut = text.index(stop) + (len(stop) if include else 0)
        assert "".join(deltas) == detok.text == text[:cut]
        if not include:
            assert all(stop[0] not in d for d in deltas), "a piece of the stop string was streamed"


def test_byte_level_fast_path_streams_what_window_decoding_streams(tmp_path):
    """With Qwen3's byte-level tokenizer, a token after whole characters adds its own text (the fast path): the
    deltas, the stop matches and the final text must equal the window decoding's (the path every other tokenizer
    takes), on token streams that split characters across tokens, hold special tokens, and end mid-character."""
    import random

    from checkpoints import make_qwen3_vocab_checkpoint

    make_qwen3_vocab_checkpoint(str(tmp_path))
    tok = Tokenizer.from_folder(str(tmp_path))
    assert tok.decodes_by_concatenation
    text = "Grüße, 日本語 😀 naïve — ok\n\t<think>x</think> end"
    pieces = tok.encode(text)
    bytes_split = [t for t in range(256, 2000) if "\ufffd" in tok.piece(t, False)][:40]  # parts of characters
    special = [151643, 151644, 151645]
    rng = random.Random(3)
    for trial in range(60):
        ids = [rng.choice(pieces + bytes_split + special) for _ in range(rng.randint(1, 40))]
        skip, stop = trial % 2 == 0, (["ok", "日本"] if trial % 3 == 0 else None)
        streams = []
        for by_pieces in (True, False):
            d = tok.detokenizer(skip, stop)
            d._by_pieces = by_pieces
            out = []
            for t in ids:
                out.append((d.append(t), d.take_delta()))
                if d.finished:
                    break
            d.finish()
            streams.append((out, d.take_delta(), d.text))
        assert streams[0] == streams[1], ids
        if not stop:
            assert streams[0][2] == tok.decode(ids, skip)


def test_a_stop_string_inside_a_multi_token_delta_ends_the_streamed_tokens_there(byte_tokenizer):
    """Speculative decoding hands the frontend several tokens in one delta; when a stop string completes at one of
    them, the update streams the tokens up to it (and their logprobs), exactly those the final output keeps."""
    from fastqwen.engine.messages import EngineRequest, RequestDelta, TokenLogprobs
    from fastqwen.frontend import RequestTracker

    ids = byte_tokenizer.encode("ab stop cd ef")
    first = byte_tokenizer.encode("ab st")
    assert ids[: len(first)] == first
    params = SamplingParams(max_tokens=64, stop=["stop"], logprobs=0)
    tracker = RequestTracker(EngineRequest(7, [1, 2], params, 0.0), byte_tokenizer)
    logprobs = [TokenLogprobs(t, -0.5, []) for t in ids]
    streamed = tracker.apply(RequestDelta(7, first, logprobs[: len(first)])).new_token_ids
    update = tracker.apply(RequestDelta(7, ids[len(first) :], logprobs[len(first) :]))
    streamed += update.new_token_ids
    assert update.finished and update.output.finish_reason == "stop"
    assert streamed == update.output.token_ids
    assert len(update.new_logprobs) == len(update.new_token_ids)
    assert len(streamed) < len(ids), "the stop string did not end the output early: the test is weak"
