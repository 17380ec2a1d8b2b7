"""Qwen3 tool-call blocks parsed into OpenAI tool calls: whole and fed in arbitrary pieces, which must agree."""

from __future__ import annotations

import json
import random

import pytest
from fastqwen.server.tools import ToolCallParser, parse_tool_calls

CALL = '<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'
ARGS = [
    '{"city": "Zürich", "note": "naïve café 🌧 日本"}',
    '{"q": "a \\"quoted\\" } ] { [ string", "nested": {"list": [1, 2.5, {"deep": [true, false, null]}], "e": {}}}',
    "{}",
    '{"esc": "back\\\\slash \\u00e9 \\n"}',
]


def streamed(text: str, seed: int, single_call: bool = False) -> tuple[str, list[dict]]:
    """Feed text in random pieces (1 to 7 characters) and rebuild content and calls from the deltas."""
    rng = random.Random(seed)
    parser, content, calls = ToolCallParser(single_call), "", {}
    at = 0
    while at <= len(text):
        piece = text[at : at + rng.randint(1, 7)]
        at += max(len(piece), 1)
        c, deltas = parser.feed(piece) if piece else parser.finish()
        content += c
        for d in deltas:
            if d.name is not None:
                assert d.index not in calls and d.arguments == "", "the name comes first, alone"
                calls[d.index] = {"id": d.id, "name": d.name, "arguments": ""}
            calls[d.index]["arguments"] += d.arguments
    return content, list(calls.values())


@pytest.mark.parametrize("seed", range(8))
def test_several_calls_whole_and_streamed(seed):
    text = "I will call tools.\n" + "\n".join(CALL.format(name=f"f{i}", args=a) for i, a in enumerate(ARGS))
    content, calls = parse_tool_calls(text)
    assert content == "I will call tools.\n"
    assert [c["function"]["name"] for c in calls] == ["f0", "f1", "f2", "f3"]
    assert [c["function"]["arguments"] for c in calls] == ARGS  # the model's own JSON text, not re-encoded
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [json.loads(a) for a in ARGS]
    assert len({c["id"] for c in calls}) == 4 and all(c["id"].startswith("call_") for c in calls)
    s_content, s_calls = streamed(text, seed)
    assert s_content == content
    assert [(c["name"], c["arguments"]) for c in s_calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls
    ]


@pytest.mark.parametrize(
    "text,content,names",
    [
        ("no calls at all, <tool but not a tag", "no calls at all, <tool but not a tag", []),
        ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
        ('<tool_call>{"other": 1}</tool_call>', '<tool_call>{"other": 1}</tool_call>', []),
        ('<tool_call>\n{"name": "f", "arguments": {"a": [1, 2', "", ["f"]),  # cut off by max_tokens
        ('<tool_call>\n{"name": "f"', '<tool_call>\n{"name": "f"', []),  # never got to its arguments
        ('{"name": "f", "arguments": {}}', '{"name": "f", "arguments": {}}', []),  # no tags: plain content
    ],
)
def test_malformed_and_partial_blocks(text, content, names):
    got_content, calls = parse_tool_calls(text)
    assert got_content == content and [c["function"]["name"] for c in calls] == names
    for seed in range(3):
        s_content, s_calls = streamed(text, seed)
        assert s_content == content and [c["name"] for c in s_calls] == names


def test_single_call_keeps_the_first():
    text = CALL.format(name="a", args="{}") + "\n" + CALL.format(name="b", args='{"x": 1}') + "\ntrailing"
    content, calls = parse_tool_calls(text, single_call=True)
    assert [c["function"]["name"] for c in calls] == ["a"] and content == "\ntrailing"
    assert streamed(text, 1, single_call=True)[1][0]["name"] == "a"


@pytest.mark.parametrize("seed", range(6))
def test_whitespace_after_calls_splits_the_same_however_fed(seed):
    """Newlines between and after calls are not content, but the whitespace in text that follows a call is (a piece
    of only spaces, or a held "<", must not lose it)."""
    calls = CALL.format(name="a", args="{}") + "\n" + CALL.format(name="b", args="{}")
    for tail, content in (("\nsee you < soon\n\n", "\nsee you < soon\n\n"), ("\n\n", ""), ("\n <x", "\n <x")):
        assert parse_tool_calls(calls + tail)[0] == content
        assert streamed(calls + tail, seed)[0] == content
