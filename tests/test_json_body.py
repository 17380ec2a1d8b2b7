"""Big request bodies are parsed by msgspec where it agrees with json.loads, and by json.loads where it does not:
the result is json.loads's (the independent reference) on every input, valid or not."""

from __future__ import annotations

import json

import pytest
from fastqwen.server.json_body import parse_json

BODIES = [
    b'{"prompt": [1, 2, 3], "max_tokens": 4}',
    b'{"prompt": "t1 \\ud800 t2"}',  # a lone surrogate escape: msgspec refuses it, json.loads takes it
    b'{"temperature": 1e400}',  # past a double: inf for json.loads (then a 400 naming the field)
    b'{"temperature": NaN}',
    b'{"top_k": 123456789012345678901234567890}',
    b'{"a": 1, "a": 2}',
    '{"prompt": "caf\u00e9 \u4e2d\u6587 \U0001f600"}'.encode(),
    b'{"x": [' + b", ".join(str(i).encode() for i in range(50_000)) + b"]}",
]
BROKEN = [b'{"prompt": [1, 2', b"", b"\xff\xfe{}", b'{"a": }']


@pytest.mark.parametrize("body", BODIES)
def test_the_result_is_json_loads(body):
    want = json.loads(body)
    got = parse_json(body)
    assert json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)


@pytest.mark.parametrize("body", BROKEN)
def test_broken_bodies_raise_what_json_loads_raises(body):
    with pytest.raises(Exception) as expected:
        json.loads(body)
    with pytest.raises(type(expected.value)):
        parse_json(body)
