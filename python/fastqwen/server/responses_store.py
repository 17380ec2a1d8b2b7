"""The responses kept for previous_response_id and GET /v1/responses/{id}: in memory, bounded, oldest dropped first.

Bounds: the last MAX_RESPONSES responses created with store true, and at most MAX_BYTES of their JSON (each entry
counts its response and its whole conversation, so a long chain of turns is counted once per turn: the bound errs on
the side of memory). Nothing survives a restart; a dropped or unknown id is a 404.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_RESPONSES = 1000
MAX_BYTES = 128 * 2**20


def json_size(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


@dataclass
class StoredResponse:
    response: dict[str, Any]  # as it was answered
    conversation: list[dict[str, Any]]  # its chat messages without instructions, the answer last
    conversation_size: int  # bytes of the conversation's JSON (the next turn adds its own to this)
    size: int  # bytes the entry is counted for


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES):
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._entries.get(response_id)

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]], conversation_size: int) -> None:
        entry = StoredResponse(response, conversation, conversation_size, conversation_size + json_size(response))
        if entry.size > self.max_bytes:
            return  # bigger than the whole store: not kept (a later previous_response_id gets a 404)
        self._entries[response["id"]] = entry
        self._bytes += entry.size
        while len(self._entries) > self.max_responses or self._bytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self._bytes -= dropped.size
