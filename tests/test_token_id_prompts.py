"""A prompt of token ids is checked in one pass (Frontend.encode through msgspec, the time to first token of a
32k-token prompt through HTTP): what it accepts and refuses must be what the per-item checks accept and refuse,
with the same errors. The reference here is the rule written out by hand, item by item, not the function."""

from __future__ import annotations

import enum
import random

import pytest
from fastqwen.config import GenerationDefaults
from fastqwen.engine.messages import EngineInfo
from fastqwen.errors import InvalidRequestError
from fastqwen.frontend import Frontend

VOCAB = 1000


def frontend() -> Frontend:
    return Frontend(EngineInfo("m", VOCAB, 4096, 1024, 16, GenerationDefaults()))


def by_hand(prompt) -> str | None:
    """What the rule says of a list of token ids: None (accepted) or the start of the error's message."""
    for t in prompt:
        if type(t) is bool or not isinstance(t, int):
            return "a prompt is a string or a list of integer token ids"
    for t in prompt:
        if not 0 <= t < VOCAB:
            return f"token id {t} is outside the vocabulary [0, {VOCAB})"
    return None


class Token(enum.IntEnum):
    A = 7


CASES = [
    [1, 2, 3],
    (4, 5, 6),  # a tuple (the offline LLM takes one)
    [0, VOCAB - 1],  # both ends of the vocabulary
    [1, VOCAB],  # one past it
    [-1, 2],
    [1, True],  # a bool is an int to Python, not a token id
    [False],
    [1, 2.0],
    [1, "2"],
    [1, None],
    [2**70],  # past int64
    [5, -(2**70)],
    [Token.A, 3],  # an int subclass other than bool is a token id
    [1, [2]],
]


@pytest.mark.parametrize("prompt", CASES, ids=[repr(c)[:30] for c in CASES])
def test_token_id_prompts_are_refused_as_item_by_item(prompt):
    want = by_hand(prompt)
    if want is None:
        ids = frontend().encode(prompt)
        assert ids == [int(t) for t in prompt] and type(ids) is list and ids is not prompt
        assert all(type(t) is int for t in ids)
    else:
        with pytest.raises(InvalidRequestError) as raised:
            frontend().encode(prompt)
        assert str(raised.value).startswith(want) and raised.value.param == "prompt"


def test_a_long_random_prompt_round_trips_and_one_bad_id_is_named():
    rng = random.Random(0)
    prompt = [rng.randrange(VOCAB) for _ in range(32768)]
    assert frontend().encode(prompt) == prompt
    for at, bad in ((0, VOCAB), (16000, -3), (32767, VOCAB + 5)):
        broken = list(prompt)
        broken[at] = bad
        with pytest.raises(InvalidRequestError, match=f"token id {bad} is outside"):
            frontend().encode(broken)
