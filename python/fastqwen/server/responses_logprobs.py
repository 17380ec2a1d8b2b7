"""include ["message.output_text.logprobs"]: the logprobs of the tokens whose text an output_text holds.

The output's text goes through the reasoning splitter and the tool-call parser; an output_text holds what comes after
the thinking block (less the newlines the splitter drops after </think>) and outside <tool_call> ... </tool_call>.
Tokens are placed by their own text (as logprobs show it, special tokens spelled), in order: when the output had a
thinking block, the tokens up to the one that completes the first </think> are its; the tokens that overlap a
<tool_call> ... </tool_call> span (with tools) are a call's; whitespace held before a call and dropped goes with it.

A delta carries the tokens placed by the time its text is released: a token that may begin a <tool_call> tag waits
for the next delta, so the deltas' logprobs add up to the part's, and the tokens' texts to the part's text.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..engine.messages import TokenLogprobs
from .reasoning import CLOSE, ReasoningSplitter, partial_tag_suffix
from .tools import CLOSE as CALL_CLOSE
from .tools import OPEN as CALL_OPEN

INCLUDE_NAME = "message.output_text.logprobs"  # the include value that asks for them


class TextLogprobs:
    def __init__(self, token_text: Callable[[int], str], splitter: ReasoningSplitter, parse_calls: bool):
        self._token_text = token_text
        self._splitter = splitter  # whether the output had a thinking block (decided before any content comes)
        self._parse_calls = parse_calls
        self._entries: list[TokenLogprobs] = []
        self._texts: list[str] = []
        self._starts: list[int] = []  # each token's offset in _text
        self._text = ""
        self._next = 0  # the first token neither given out nor passed over
        self._past_thinking = False
        self._call_end: int | None = None  # inside a call: the offset its </tool_call> ends at (-1: not yet seen)
        self._final = False

    def add(self, entries: list[TokenLogprobs]) -> None:
        """The logprobs of the next output tokens (before their text is fed to the splitter)."""
        for entry in entries:
            text = self._token_text(entry.token)
            self._entries.append(entry)
            self._texts.append(text)
            self._starts.append(len(self._text))
            self._text += text

    def finish(self) -> None:
        """The output ended: no token waits for text that may still come."""
        self._final = True

    def take(self) -> list[dict[str, Any]]:
        """The logprobs of the output_text tokens placed since the last take (for the delta being released)."""
        if self._splitter.saw_block and not self._past_thinking:
            close = self._text.find(CLOSE)
            if close == -1:
                return []  # (content comes only after the block closes)
            self._pass_to(close + len(CLOSE))
            while self._next < len(self._entries) and self._texts[self._next].strip("\n") == "":
                self._next += 1  # the newlines the splitter drops after </think>
            self._past_thinking = True
        out: list[dict[str, Any]] = []
        while self._next < len(self._entries):
            place = self._place(self._next)
            if place == "wait" or (place == "call" and out):  # (text after a call is another item's)
                break
            if place == "text":
                out.append(_logprob(self._entries[self._next], self._texts[self._next], self._token_text))
            self._next += 1
        return out

    def skip_to_call(self) -> None:
        """A call starts: what was not given out before its <tool_call> was whitespace the output dropped."""
        if self._next < len(self._entries):
            opening = self._text.find(CALL_OPEN, self._starts[self._next])
            while opening != -1 and self._next < len(self._entries) and self._end(self._next) <= opening:
                self._next += 1

    def _place(self, i: int) -> str:
        """Token i: "text" (an output_text's), "call" (a call's) or "wait" (it may begin a call's tag)."""
        if not self._parse_calls:
            return "text"
        start, end = self._starts[i], self._end(i)
        if self._call_end is None:
            opening = self._text.find(CALL_OPEN, start)
            if opening != -1 and opening < end:
                self._call_end = -1
            elif not self._final and end > len(self._text) - partial_tag_suffix(self._text, CALL_OPEN):
                return "wait"
            else:
                return "text"
        if self._call_end == -1:
            closing = self._text.find(CALL_CLOSE, start)
            if closing == -1:
                return "call"
            self._call_end = closing + len(CALL_CLOSE)
        if start < self._call_end:
            return "call"
        self._call_end = None
        return self._place(i)

    def _end(self, i: int) -> int:
        return self._starts[i] + len(self._texts[i])

    def _pass_to(self, offset: int) -> None:
        """Pass over the tokens that hold text before `offset`."""
        while self._next < len(self._entries) and self._starts[self._next] < offset:
            self._next += 1


def _logprob(entry: TokenLogprobs, text: str, token_text: Callable[[int], str]) -> dict[str, Any]:
    """One token as ResponseOutputText's Logprob: its text, logprob, UTF-8 bytes and top alternatives."""
    top = [(token_text(t), lp) for t, lp in entry.top]
    return {
        "token": text,
        "logprob": entry.logprob,
        "bytes": list(text.encode("utf-8")),
        "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))} for t, lp in top],
    }


def without_bytes(logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The stream events' shape of the same logprobs (ResponseTextDeltaEvent's Logprob has no bytes)."""
    return [
        {
            "token": lp["token"],
            "logprob": lp["logprob"],
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in lp["top_logprobs"]],
        }
        for lp in logprobs
    ]
