"""Tool calling in Qwen3's format: the request side (tools and tool_choice checked, messages with tool calls made ready
for the chat template) and the output side (<tool_call>{"name": ..., "arguments": ...}</tool_call> blocks parsed into
OpenAI tool calls).

One parser serves streaming (fed delta by delta) and whole responses (fed once), so both give the same calls. Text
outside the blocks is content. A call's name goes out once its JSON string is complete; its arguments are streamed as
the model writes them, exactly as written (the arguments string is the model's own JSON text, never re-encoded, so
the fragments of a stream always add up to the whole response's string). A block that does not start like a call
(`{"name": "...", "arguments": ...`) is left in the content as it was written.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRequestError

OPEN, CLOSE = "<tool_call>", "</tool_call>"

# A call block opens with these, whitespace allowed around each; None stands for the name's JSON string.
_HEAD = ("{", '"name"', ":", None, ",", '"arguments"', ":")


def _match_head(text: str) -> tuple[str, str | None, int]:
    """("call", name, index of the arguments' first character) when text opens a call block; ("maybe", None, 0)
    while it could still; ("no", None, 0) when it cannot."""
    at = 0
    name = None
    for part in _HEAD:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            return "maybe", None, 0
        if part is None:
            if text[at] != '"':
                return "no", None, 0
            try:
                name, at = json.decoder.scanstring(text, at + 1)
            except json.JSONDecodeError:  # unterminated (or a bad escape, which later text cannot fix: rare)
                return "maybe", None, 0
            continue
        piece = text[at : at + len(part)]
        if not part.startswith(piece):
            return "no", None, 0
        if len(piece) < len(part):
            return "maybe", None, 0
        at += len(part)
    while at < len(text) and text[at].isspace():
        at += 1
    if at == len(text):
        return "maybe", None, 0
    return "call", name, at


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ToolCallDelta:
    """A piece of one call: its start (id and name) or a fragment of its arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        """The chunk's `tool_calls` item, in OpenAI's and vLLM's streaming shape."""
        if self.name is not None:
            return {
                "index": self.index,
                "id": self.id,
                "type": "function",
                "function": {"name": self.name, "arguments": self.arguments},
            }
        return {"index": self.index, "function": {"arguments": self.arguments}}


@dataclass
class _Call:
    id: str
    name: str
    arguments: str = ""


class _ValueScanner:
    """Finds where a JSON value written a piece at a time ends, without parsing it: brackets outside strings."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.started = False

    def feed(self, text: str) -> int | None:
        """Index in text just past the value's end, or None if it goes on."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
                continue
            if not self.started and ch.isspace():
                continue
            self.started = True
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1
            elif self.depth == 0 and ch in ",\n":  # a bare number, true, false or null ended
                return i
        return None


class ToolCallParser:
    def __init__(self, single_call: bool = False):
        self.single_call = (
            single_call  # parallel_tool_calls false: only the first call counts, later blocks are dropped
        )
        self.calls: list[_Call] = []
        self._buffer = ""  # text not yet decided
        self._state = "content"  # "content", "head" (inside a block, before the arguments), "arguments", "tail"
        self._scanner: _ValueScanner | None = None
        self._dropping = False  # inside a call block past the first, with single_call
        # Whitespace after a call, held: content if text follows it, dropped if a call or the end does (so that the
        # output splits the same however it is fed). None: no call just ended.
        self._space_after_call: str | None = None

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """(content, tool-call pieces) that are now certain."""
        self._buffer += text
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while self._step(content, deltas):
            pass
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """Whatever is held: the output ended (a block cut short keeps the arguments written so far)."""
        content, deltas = self.feed("")
        rest, self._buffer = self._buffer, ""
        pieces = [content]
        if self._state == "content":
            self._content(pieces, rest)
        elif self._state == "head":
            self._content(pieces, OPEN + rest)  # it never became a call: the text as written
        elif self._state == "arguments" and rest and not self._dropping:
            self.calls[-1].arguments += rest
            deltas.append(ToolCallDelta(len(self.calls) - 1, arguments=rest))
        return "".join(pieces), deltas

    def _content(self, content: list[str], text: str) -> None:
        # Between and after calls the model writes newlines: not content, unless text follows them.
        if not text:
            return
        if self._space_after_call is not None:
            self._space_after_call += text
            if self._space_after_call.isspace():
                return
            text, self._space_after_call = self._space_after_call, None
        content.append(text)

    def _step(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        """Consume what the buffer decides; True when something changed and another step may decide more."""
        buf = self._buffer
        if self._state == "content":
            at = buf.find(OPEN)
            if at == -1:
                keep = _partial_suffix(buf, OPEN)
                self._content(content, buf[: len(buf) - keep])
                self._buffer = buf[len(buf) - keep :]
                return False
            self._content(content, buf[:at])
            self._buffer = buf[at + len(OPEN) :]
            self._state = "head"
            return True
        if self._state == "head":
            verdict, name, at = _match_head(buf)
            if verdict == "maybe" and CLOSE not in buf:
                return False  # wait for more
            if verdict != "call":  # not a call: the block is content, as written
                self._content(content, OPEN)
                self._state = "content"
                return True
            self._space_after_call = None  # the whitespace before this call is dropped
            self._buffer = buf[at:]
            self._state = "arguments"
            self._scanner = _ValueScanner()
            self._dropping = self.single_call and len(self.calls) >= 1
            if not self._dropping:
                self.calls.append(_Call(f"call_{uuid.uuid4().hex[:24]}", name))
                deltas.append(ToolCallDelta(len(self.calls) - 1, id=self.calls[-1].id, name=name))
            return True
        if self._state == "arguments":
            end = self._scanner.feed(buf)
            piece = buf if end is None else buf[:end]
            if piece and not self._dropping:
                self.calls[-1].arguments += piece
                deltas.append(ToolCallDelta(len(self.calls) - 1, arguments=piece))
            self._buffer = "" if end is None else buf[end:]
            if end is None:
                return False
            self._state = "tail"
            return True
        # "tail": the rest of the block (the closing brace) is dropped up to </tool_call>.
        at = buf.find(CLOSE)
        if at == -1:
            keep = max(_partial_suffix(buf, CLOSE), 0)
            self._buffer = buf[len(buf) - keep :]
            return False
        self._buffer = buf[at + len(CLOSE) :]
        self._state = "content"
        self._space_after_call = ""
        return True


def parse_tool_calls(text: str, single_call: bool = False) -> tuple[str, list[dict[str, Any]]]:
    """A whole output: (content, OpenAI tool calls)."""
    parser = ToolCallParser(single_call)
    content, _ = parser.feed(text)
    rest, _ = parser.finish()
    return content + rest, [openai_call(c) for c in parser.calls]


def openai_call(call: _Call) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


# ---- the request side ----------------------------------------------------------------------------------------------


def check_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None) -> str | None:
    """Validate tools and tool_choice; returns the effective choice: "none", "auto", "required" or a function name
    (None when there are no tools)."""
    names = []
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise InvalidRequestError(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., ...}}}}', "tools"
            )
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"tools[{i}].function.name must be a non-empty string", "tools")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        names.append(name)
    if tool_choice is None:
        return "auto" if names else None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise InvalidRequestError(
                f'tool_choice must be "none", "auto", "required" or a named function, not {tool_choice!r}',
                "tool_choice",
            )
        if tool_choice != "none" and not names:
            raise InvalidRequestError(f'tool_choice "{tool_choice}" needs tools', "tool_choice")
        return tool_choice if names else None
    function = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise InvalidRequestError(
            'a named tool_choice is {"type": "function", "function": {"name": ...}}', "tool_choice"
        )
    if name not in names:
        raise InvalidRequestError(
            f"tool_choice names the function {name!r}, which is not among the tools", "tool_choice"
        )
    return name


def messages_for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: an assistant turn's tool-call arguments, sent by OpenAI clients as JSON
    strings, become objects (Hugging Face's convention, which Qwen3's template renders with tojson); vLLM does the
    same. Arguments that are not JSON stay a string."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if not calls:
            out.append(message)
            continue
        if message.get("role") != "assistant" or not isinstance(calls, list):
            raise InvalidRequestError(f"messages[{i}]: only assistant messages carry a list of tool_calls", "messages")
        converted = []
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise InvalidRequestError(f"messages[{i}].tool_calls[{j}] needs function.name", "messages")
            arguments = function.get("arguments", {})
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments) if arguments.strip() else {}
                except json.JSONDecodeError:
                    pass  # a call cut by max_tokens: kept as text, which Qwen3's template renders as it is (OpenAI
                    # accepts it too; agent loops send such a call back)
            converted.append({**call, "function": {**function, "arguments": arguments}})
        out.append({**message, "tool_calls": converted})
    return out
