"""/v1/responses input items as chat messages, and a response's output items as the assistant message they make.

Input is a string (one user message) or a list of items: messages (role user, system, developer or assistant; content
a string or text parts), function_call and function_call_output items (a tool loop; custom_tool_call and
custom_tool_call_output for custom tools, whose input is the `input` argument of the function they are rendered as:
responses_tools), and reasoning items (a previous output sent back). Calls and reasoning join the assistant message
they belong to, as Qwen3's chat template expects: one assistant turn with reasoning_content, content and tool_calls.
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidRequestError
from .responses_encrypted import reasoning_of
from .responses_tools import custom_arguments

_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def _fail(where: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{where}: {message}", "input")


def _text(content: Any, where: str) -> str:
    """A message's content (a string or a list of text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _fail(where, "content must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise _fail(f"{where}.content[{j}]", f"only text parts are supported, not {kind!r} (this model reads text)")
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise _fail(f"{where}.content[{j}]", "a text part needs its text")
        texts.append(text)
    return "".join(texts)


class _Conversation:
    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self._assistant_open = False  # the last message is an assistant turn that later items may still join

    def assistant(self, fresh: bool = False) -> dict[str, Any]:
        """The open assistant turn (a new one when none is open, or when fresh)."""
        if fresh or not self._assistant_open:
            self.messages.append({"role": "assistant", "content": ""})
            self._assistant_open = True
        return self.messages[-1]

    def add(self, message: dict[str, Any]) -> None:
        self.messages.append(message)
        self._assistant_open = False


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its encrypted_content when it has one (a stateless client's only copy: Codex sends the
    item back with store false), else its content, else its summary."""
    if item.get("encrypted_content") is not None:
        return reasoning_of(item["encrypted_content"], where + ".encrypted_content")
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list):
        raise _fail(where, "a reasoning item's content is a list of reasoning_text parts")
    return "".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))


def input_messages(value: Any) -> list[dict[str, Any]]:
    """The request's input as chat messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("input must be a string or a non-empty list of input items", "input")
    conversation = _Conversation()
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _fail(where, "an input item is an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item.get("role"))
            if role is None:
                raise _fail(where, f"role must be user, system, developer or assistant, not {item.get('role')!r}")
            text = _text(item.get("content"), where)
            if role == "assistant":
                turn = conversation.assistant()
                if turn["content"] or turn.get("tool_calls"):  # a second answer: a turn of its own
                    turn = conversation.assistant(fresh=True)
                turn["content"] = text
            else:
                conversation.add({"role": role, "content": text})
        elif kind == "reasoning":
            text = _reasoning_text(item, where)
            turn = conversation.assistant()
            turn["reasoning_content"] = turn.get("reasoning_content", "") + text
        elif kind in ("function_call", "custom_tool_call"):
            name, call_id = item.get("name"), item.get("call_id")
            arguments = item.get("arguments", "") if kind == "function_call" else item.get("input", "")
            if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(arguments, str):
                field = "arguments" if kind == "function_call" else "input"
                raise _fail(where, f"a {kind} item needs name, call_id and {field} (a string)")
            if kind == "custom_tool_call":
                arguments = custom_arguments(arguments)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            conversation.assistant().setdefault("tool_calls", []).append(call)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise _fail(where, f"a {kind} item needs call_id")
            conversation.add({"role": "tool", "tool_call_id": call_id, "content": _text(output, where + ".output")})
        else:
            raise _fail(where, f"input items of type {kind!r} are not supported")
    return conversation.messages


def assistant_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output items as the assistant turn that continues its conversation (previous_response_id)."""
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in output:
        if item["type"] == "reasoning":
            message["reasoning_content"] = "".join(part["text"] for part in item["content"])
        elif item["type"] == "message":
            message["content"] += "".join(part["text"] for part in item["content"])
        elif item["type"] in ("function_call", "custom_tool_call"):
            arguments = item["arguments"] if item["type"] == "function_call" else custom_arguments(item["input"])
            call = {"name": item["name"], "arguments": arguments}
            message.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": call})
    return message
