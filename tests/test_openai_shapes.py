"""The shape checker every server test reads through (tests/openai_shapes.py): the bodies OpenAI documents pass, and
each kind of drift fails, so a lenient checker cannot hide a server that drifts."""

from __future__ import annotations

import copy

import pytest
from openai_shapes import check_body

CHAT = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1700000000,
    "model": "m",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop", "logprobs": None}
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}
CHUNK = {
    "id": "chatcmpl-1",
    "object": "chat.completion.chunk",
    "created": 1700000000,
    "model": "m",
    "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None, "logprobs": None}],
}
COMPLETION_CHUNK = {
    "id": "cmpl-1",
    "object": "text_completion",
    "created": 1700000000,
    "model": "m",
    "choices": [{"index": 0, "text": "hi", "finish_reason": None, "logprobs": None}],
}


def test_documented_bodies_pass():
    check_body("/v1/chat/completions", CHAT, streamed=False)
    check_body("/v1/chat/completions", CHUNK, streamed=True)
    check_body("/v1/completions", COMPLETION_CHUNK, streamed=True)  # null finish_reason until a choice ends
    check_body("/v1/chat/completions", {"error": {"message": "m", "type": "t", "param": None, "code": 500}}, True)


@pytest.mark.parametrize(
    "body, path, streamed, where",
    [
        (CHUNK, ("object",), True, "object"),  # dropped
        (CHUNK, ("created",), True, "created"),
        (CHAT, ("choices", 0, "index"), False, "index"),  # dropped below the top level
        (CHAT, ("usage", "total_tokens"), False, "total_tokens"),
    ],
)
def test_a_missing_required_field_fails(body, path, streamed, where):
    broken = copy.deepcopy(body)
    parent = broken
    for key in path[:-1]:
        parent = parent[key]
    del parent[path[-1]]
    with pytest.raises(AssertionError, match=where):
        check_body("/v1/chat/completions", broken, streamed)


@pytest.mark.parametrize(
    "field, value",
    [("created", "now"), ("created", "1700000000"), ("object", "chat.completion"), ("choices", {}), ("model", 7)],
)
def test_a_wrong_type_fails_without_coercion(field, value):
    with pytest.raises(AssertionError, match=field):
        check_body("/v1/chat/completions", {**CHUNK, field: value}, streamed=True)
