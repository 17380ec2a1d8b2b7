"""Every /v1/chat/completions and /v1/completions body the tests read, checked against the openai package's own types.

The openai client builds its objects without validating them, and pydantic's `model_validate` on those types coerces
("5" becomes 5) and allows extra fields, so shape drift would pass unseen. `check_body` validates strictly (no
coercion) and also walks the raw JSON: every field the type declares as required must be present, at every level.

`install` wraps httpx's real transports (sync and async) for the whole test session (tests/conftest.py calls it), so
every test that talks to a real server through httpx or the openai client is checked without changing the test: a
JSON body is checked once it has been read, an event stream line by line as it arrives (a stream cut short checks
only its whole lines). A mismatch raises in the reading test and is also recorded, so a test whose request runs in a
thread, or behind the openai client's retries, still fails (conftest.py asserts none was recorded).
"""

from __future__ import annotations

import json
import typing

import pydantic

# Mismatches seen since the last `take_mismatches()`; each is "path: what is wrong".
_mismatches: list[str] = []


def _type_for(path: str, streamed: bool):
    """The openai type a 200 body (or one stream chunk) of this endpoint must match, or None for other endpoints."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    if path.endswith("/v1/chat/completions"):
        return ChatCompletionChunk if streamed else ChatCompletion
    if path.endswith("/v1/completions"):
        return Completion  # the openai client reads completion chunks as Completion too
    return None


def _model_types(annotation) -> list[type[pydantic.BaseModel]]:
    """The pydantic models an annotation can hold (through Optional, List, Union, Dict)."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return [annotation]
    found = []
    for arg in typing.get_args(annotation):
        found += _model_types(arg)
    return found


def _missing_required(model: type[pydantic.BaseModel], raw, where: str) -> list[str]:
    """Fields the model declares as required that the raw JSON lacks, at this level and below."""
    if not isinstance(raw, dict):
        return []  # a wrong type: the strict validation reports it
    missing = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        if key not in raw:
            if field.is_required():
                missing.append(f"{where}.{key}")
            continue
        nested = _model_types(field.annotation)
        if len(nested) != 1:  # no model below, or a union of models: the validator decides which one applies
            continue
        value = raw[key]
        if isinstance(value, list):
            for i, item in enumerate(value):
                missing += _missing_required(nested[0], item, f"{where}.{key}[{i}]")
        else:
            missing += _missing_required(nested[0], value, f"{where}.{key}")
    return missing


def _without_documented_nulls(completion: dict, streamed: bool) -> dict:
    """A completion with the nulls OpenAI's legacy endpoint sends, and the openai package's Completion type does not
    allow, filled in: finish_reason null in a chunk whose choice has not ended, and the first echoed prompt token's
    logprob and top logprobs (nothing comes before it to predict it)."""
    choices = completion.get("choices")
    if not isinstance(choices, list):
        return completion
    filled = []
    for choice in choices:
        if isinstance(choice, dict):
            choice = dict(choice)
            if streamed and choice.get("finish_reason", "") is None:
                choice["finish_reason"] = "length"
            logprobs = choice.get("logprobs")
            if isinstance(logprobs, dict):
                logprobs = dict(logprobs)
                for key, first in (("token_logprobs", 0.0), ("top_logprobs", {})):
                    values = logprobs.get(key)
                    if isinstance(values, list) and values and values[0] is None:
                        logprobs[key] = [first, *values[1:]]
                choice["logprobs"] = logprobs
        filled.append(choice)
    return {**completion, "choices": filled}


def check_body(path: str, raw: dict, streamed: bool) -> None:
    """Raise AssertionError when a 200 body (or one stream chunk) of `path` does not match its openai type."""
    model = _type_for(path, streamed)
    if model is None:
        return
    if streamed and "error" in raw:  # an error event mid-stream has OpenAI's error shape instead
        assert set(raw["error"]) >= {"message", "type", "code"}, f"{path}: error event {raw}"
        return
    if model.__name__ == "Completion":
        raw = _without_documented_nulls(raw, streamed)
    missing = _missing_required(model, raw, model.__name__)
    assert not missing, f"{path}: {model.__name__} lacks required fields {missing} in {raw}"
    try:
        model.model_validate(raw, strict=True)
    except pydantic.ValidationError as error:
        raise AssertionError(f"{path}: not a valid {model.__name__}: {error}\n{raw}") from None


def _checked(path: str, raw: bytes | str, streamed: bool) -> None:
    try:
        check_body(path, json.loads(raw), streamed)
    except AssertionError as error:
        _mismatches.append(str(error))
        raise


class _Lines:
    """Feeds the bytes of a response to the checker: whole SSE `data:` lines as they come, or the whole JSON body."""

    def __init__(self, path: str, streamed: bool):
        self.path, self.streamed, self.buffer = path, streamed, b""

    def feed(self, chunk: bytes) -> None:
        self.buffer += chunk
        if not self.streamed:
            return
        *lines, self.buffer = self.buffer.split(b"\n")
        for line in lines:
            if line.startswith(b"data: {"):
                _checked(self.path, line[len(b"data: ") :], streamed=True)

    def end(self) -> None:
        if not self.streamed and self.buffer:
            _checked(self.path, self.buffer, streamed=False)


def _checking_stream(http, kind: str):
    """A byte stream class of this httpx module that feeds what passes through it to a _Lines."""

    if kind == "sync":

        class Checked(http.SyncByteStream):
            def __init__(self, inner, lines: _Lines):
                self.inner, self.lines = inner, lines

            def __iter__(self):
                for chunk in self.inner:
                    self.lines.feed(chunk)
                    yield chunk
                self.lines.end()

            def close(self) -> None:
                self.inner.close()

    else:

        class Checked(http.AsyncByteStream):
            def __init__(self, inner, lines: _Lines):
                self.inner, self.lines = inner, lines

            async def __aiter__(self):
                async for chunk in self.inner:
                    self.lines.feed(chunk)
                    yield chunk
                self.lines.end()

            async def aclose(self) -> None:
                await self.inner.aclose()

    return Checked


def _lines_for(request, response) -> _Lines | None:
    # Only a POST answers with a completion (a HEAD probe or a CORS preflight to the same path has no body).
    if request.method != "POST" or response.status_code != 200 or _type_for(request.url.path, False) is None:
        return None
    streamed = response.headers.get("content-type", "").startswith("text/event-stream")
    return _Lines(request.url.path, streamed)


def _install_into(http) -> None:
    if getattr(http.HTTPTransport, "_openai_shapes", False):
        return
    sync_send, async_send = http.HTTPTransport.handle_request, http.AsyncHTTPTransport.handle_async_request
    sync_stream, async_stream = _checking_stream(http, "sync"), _checking_stream(http, "async")

    def handle_request(self, request):
        response = sync_send(self, request)
        lines = _lines_for(request, response)
        if lines is not None:
            response.stream = sync_stream(response.stream, lines)
        return response

    async def handle_async_request(self, request):
        response = await async_send(self, request)
        lines = _lines_for(request, response)
        if lines is not None:
            response.stream = async_stream(response.stream, lines)
        return response

    http.HTTPTransport.handle_request = handle_request
    http.AsyncHTTPTransport.handle_async_request = handle_async_request
    http.HTTPTransport._openai_shapes = True


def install() -> None:
    """Check every chat and completion response that passes through the real transports from now on: httpx's (raw
    tests) and httpx2's (the fork the openai client uses since its 3.x releases)."""
    import importlib

    for name in ("httpx", "httpx2"):
        try:
            _install_into(importlib.import_module(name))
        except ImportError:
            continue


def take_mismatches() -> list[str]:
    """The mismatches recorded since the last call (and forget them)."""
    taken = _mismatches[:]
    _mismatches.clear()
    return taken
