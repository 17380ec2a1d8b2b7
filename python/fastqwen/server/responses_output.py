"""A chat output as /v1/responses output items, with the stream events that build them.

One builder serves streaming (fed delta by delta) and whole responses (fed once), so both give the same items. It is
fed what the reasoning splitter and the tool-call parser made certain: reasoning text opens a reasoning item, content
a message item, each call a function_call item (a custom_tool_call item for a custom tool, its input given whole when
the call is done: responses_tools); an item is done when the next one opens or the output ends. The events follow the
order OpenAI documents: output_item.added, content_part.added, the deltas, their done event, content_part.done,
output_item.done. Whitespace the model writes before a call is held, and dropped if a call follows.
"""

from __future__ import annotations

import copy
import uuid
from typing import Any

from .responses_encrypted import encrypted_content
from .responses_logprobs import TextLogprobs, without_bytes
from .responses_tools import ToolCatalog, custom_input
from .tools import ToolCallDelta


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    def __init__(
        self, encrypt_reasoning: bool = False, logprobs: TextLogprobs | None = None, tools: ToolCatalog | None = None
    ) -> None:
        self.encrypt_reasoning = encrypt_reasoning  # include reasoning.encrypted_content: set when an item is done
        self.logprobs = logprobs  # include message.output_text.logprobs: what each output_text delta carries
        self.tools = tools or ToolCatalog()  # which calls are custom tools' and which belong to a namespace
        self._arguments = ""  # the open custom tool call's arguments as the model writes them ({"input": ...})
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._held = ""  # whitespace content not yet given to a message

    # ---- feeding ----

    def feed(self, reasoning: str, content: str, calls: list[ToolCallDelta]) -> list[dict[str, Any]]:
        """The events (without sequence numbers) of what is now certain."""
        events: list[dict[str, Any]] = []
        if reasoning:
            if not self._is_open("reasoning"):
                self._start(events, {"type": "reasoning", "summary": [], "content": []}, "rs", "reasoning_text")
            self._add_text(events, reasoning, "response.reasoning_text.delta")
        if content:
            self._add_content(events, content)
        for call in calls:
            if call.name is not None:
                item = self.tools.call_item(call.id, call.name)
                self._held = ""
                if self.logprobs is not None:
                    self.logprobs.skip_to_call()
                self._start(events, item, "fc" if item["type"] == "function_call" else "ctc", None)
            if call.arguments and self._is_open("custom_tool_call"):
                self._arguments += call.arguments  # (its input is known once the arguments end)
            elif call.arguments:
                self._open["arguments"] += call.arguments
                events.append(self._event("response.function_call_arguments.delta", delta=call.arguments))
        return events

    def finish(self, incomplete: bool) -> list[dict[str, Any]]:
        """The output ended (cut by max_output_tokens when incomplete: the last item is incomplete)."""
        events: list[dict[str, Any]] = []
        if self._held and not any(item["type"] in _CALLS for item in self.items):
            self._add_content(events, "", flush=True)
        if not self.items:  # nothing at all: an empty answer, as chat's content ""
            self._start(events, _message(), "msg", "output_text")
        if self._is_open("message") and self.logprobs is not None:
            self._take_logprobs(self._open["content"][0])  # tokens whose text came with the last delta, held till now
        self._close(events, "incomplete" if incomplete else "completed")
        return events

    def _add_content(self, events: list[dict[str, Any]], content: str, flush: bool = False) -> None:
        text = self._held + content
        if not self._is_open("message") and not text.strip() and not flush:
            self._held = text  # maybe the newlines before a call
            return
        self._held = ""
        if not self._is_open("message"):
            self._start(events, _message(), "msg", "output_text")
        self._add_text(events, text, "response.output_text.delta")

    # ---- items and their events ----

    def _is_open(self, kind: str) -> bool:
        return self._open is not None and self._open["type"] == kind

    def _event(self, kind: str, **fields) -> dict[str, Any]:
        return {"type": kind, "item_id": self._open["id"], "output_index": len(self.items) - 1, **fields}

    def _start(self, events: list[dict[str, Any]], item: dict[str, Any], prefix: str, part: str | None) -> None:
        self._close(events, "completed")
        item = {"id": new_id(prefix), **item, "status": "in_progress"}
        self.items.append(item)
        self._open = item
        events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": _copy(item)})
        if part is not None:
            item["content"].append(_part(part, ""))
            events.append(self._event("response.content_part.added", content_index=0, part=_part(part, "")))

    def _add_text(self, events: list[dict[str, Any]], text: str, kind: str) -> None:
        part = self._open["content"][0]
        part["text"] += text
        extra = {}
        if kind == "response.output_text.delta":
            given = self._take_logprobs(part)
            extra = {"logprobs": without_bytes(given)}
        events.append(self._event(kind, content_index=0, delta=text, **extra))

    def _take_logprobs(self, part: dict[str, Any]) -> list[dict[str, Any]]:
        given = self.logprobs.take() if self.logprobs is not None else []
        part["logprobs"] += given
        return given

    def _close(self, events: list[dict[str, Any]], status: str) -> None:
        item = self._open
        if item is None:
            return
        if item["type"] == "function_call":
            events.append(self._event("response.function_call_arguments.done", arguments=item["arguments"]))
            events[-1]["name"] = item["name"]
        elif item["type"] == "custom_tool_call":
            item["input"], self._arguments = custom_input(self._arguments), ""
            if item["input"]:
                events.append(self._event("response.custom_tool_call_input.delta", delta=item["input"]))
            events.append(self._event("response.custom_tool_call_input.done", input=item["input"]))
        else:
            part = item["content"][0]
            if item["type"] == "message":
                logprobs = without_bytes(part["logprobs"])
                events.append(
                    self._event("response.output_text.done", content_index=0, text=part["text"], logprobs=logprobs)
                )
            else:
                events.append(self._event("response.reasoning_text.done", content_index=0, text=part["text"]))
                if self.encrypt_reasoning:
                    item["encrypted_content"] = encrypted_content(part["text"])
            events.append(self._event("response.content_part.done", content_index=0, part=_copy(part)))
        item["status"] = status
        events.append({"type": "response.output_item.done", "output_index": len(self.items) - 1, "item": _copy(item)})
        self._open = None


_CALLS = ("function_call", "custom_tool_call")


def _message() -> dict[str, Any]:
    return {"type": "message", "role": "assistant", "content": []}


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "output_text":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": kind, "text": text}


def _copy(value: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(value)


def reasoning_tokens(token_ids: list[int], think_close: int | None, thought: bool) -> int:
    """How many output tokens were reasoning: up to and including </think>, or all of them when the output thought
    (a reasoning item) and never closed the block."""
    if not thought:
        return 0
    if think_close is not None and think_close in token_ids:
        return token_ids.index(think_close) + 1
    return len(token_ids)


def usage(num_prompt: int, num_cached: int, num_output: int, num_reasoning: int) -> dict[str, Any]:
    return {
        "input_tokens": num_prompt,
        # cache_write_tokens: OpenAI's explicit prompt caching, which this server does not have.
        "input_tokens_details": {"cached_tokens": num_cached, "cache_write_tokens": 0},
        "output_tokens": num_output,
        "output_tokens_details": {"reasoning_tokens": num_reasoning},
        "total_tokens": num_prompt + num_output,
    }
