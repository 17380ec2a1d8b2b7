"""Qwen3's thinking block: text between <think> and </think> becomes reasoning_content, the rest content.

One splitter serves streaming (fed delta by delta) and whole responses (fed once), so both split identically. Text
that might be the start of a tag is held until the next delta decides it.

A request whose grammar leaves a thinking block free before its constraint (a structured chat request with thinking
on) takes vLLM's Qwen3 rule: text before the first </think> is reasoning even without a <think> before it, so that
`content` is exactly what the constraint accepts. Its text is held until </think> or the end decides which it is.
Other requests never wait for a </think> that may not come (Instruct-2507 models never write one): their output
is content from the first character that cannot begin <think>.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    def __init__(self, prompt_opened_thinking: bool = False, close_ends_reasoning: bool = False):
        """close_ends_reasoning: text before a </think> is reasoning even when no <think> opened it."""
        # "start": not yet known whether the output opens a think block; "undecided" (close_ends_reasoning): no
        # <think>, but a </think> may still come; "reasoning"; "content".
        self._state = "reasoning" if prompt_opened_thinking else "start"
        self._close_ends_reasoning = close_ends_reasoning
        self._buffer = ""
        self._strip_newlines = False  # content right after </think> starts with blank lines to drop
        self.saw_block = prompt_opened_thinking  # whether the output had a thinking block (possibly empty)

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) text that is now certain."""
        self._buffer += delta
        reasoning = content = ""
        while True:
            if self._state == "start":
                stripped = self._buffer.lstrip()
                if stripped.startswith(OPEN):
                    self._buffer = stripped[len(OPEN) :]
                    self._state = "reasoning"
                    self.saw_block = True
                elif OPEN.startswith(stripped):
                    return reasoning, content  # could still become <think>: wait
                else:
                    self._state = "undecided" if self._close_ends_reasoning else "content"
            elif self._state == "undecided":
                if CLOSE not in self._buffer:
                    return reasoning, content  # reasoning if a </think> comes, content if the output ends first
                self._state = "reasoning"
                self.saw_block = True
            elif self._state == "reasoning":
                at = self._buffer.find(CLOSE)
                if at == -1:
                    keep = partial_tag_suffix(self._buffer, CLOSE)
                    reasoning += self._buffer[: len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return reasoning, content
                reasoning += self._buffer[:at]
                self._buffer = self._buffer[at + len(CLOSE) :]
                self._state = "content"
                self._strip_newlines = True
            else:
                if self._strip_newlines:
                    self._buffer = self._buffer.lstrip("\n")
                    if not self._buffer:
                        return reasoning, content
                    self._strip_newlines = False
                content += self._buffer
                self._buffer = ""
                return reasoning, content

    def finish(self) -> tuple[str, str]:
        """Whatever is held: the output ended."""
        rest, self._buffer = self._buffer, ""
        if self._state == "reasoning":  # ("undecided" ends as content: no </think> came)
            return rest, ""
        return "", rest.lstrip("\n") if self._strip_newlines else rest


def prompt_opens_thinking(prompt: str) -> bool:
    """Templates that put <think> in the prompt (newer Qwen releases) leave the model inside the block."""
    tail = prompt.rstrip()
    return tail.endswith(OPEN)


def split_reasoning(
    text: str, prompt_opened_thinking: bool = False, close_ends_reasoning: bool = False
) -> tuple[str | None, str]:
    splitter = ReasoningSplitter(prompt_opened_thinking, close_ends_reasoning)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.finish()
    return (r1 + r2 if splitter.saw_block else None), c1 + c2
