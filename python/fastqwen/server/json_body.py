"""Request bodies parsed off the event loop when they are big: json.loads of a 14 MB body held the loop for 1.0 to
1.7 s (issue 40), and every other request with it. Routes of the API use JsonBodyRoute; FastAPI then parses their
body through JsonBodyRequest.json, which hands a body of JSON_INLINE_BELOW bytes or more to the prep pool."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import msgspec
from fastapi import HTTPException, Request
from fastapi.routing import APIRoute

from .prep_pool import PrepPoolFull

# json.loads takes about 0.3 ms for 64 KiB: below that a thread hop costs more than it saves.
JSON_INLINE_BELOW = 64 * 1024


def parse_json(body: bytes) -> Any:
    """json.loads's result, through msgspec's decoder where it agrees: 4 to 7 times faster on big bodies (7.5 MB of
    token ids 105 -> 26 ms, 14 MB of text 68 -> 10 ms), and both hold the interpreter lock, so the event loop waits
    that much less. What msgspec refuses (a lone surrogate escape, NaN, a number past a double, text that is not
    JSON) goes to json.loads, so that validation sees the same values and a broken body the same error as before."""
    try:
        return msgspec.json.decode(body)
    except msgspec.DecodeError:  # (msgspec.ValidationError is one too)
        return json.loads(body)


class JsonBodyRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = await self.app.state.server.prep.run(
                    lambda: parse_json(body), len(body), JSON_INLINE_BELOW
                )
            except PrepPoolFull as e:  # FastAPI turns anything but an HTTPException raised here into a 400
                raise HTTPException(503, str(e), {"Retry-After": "1"}) from e
        return self._json


class JsonBodyRoute(APIRoute):
    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def parse_off_the_loop(request: Request):
            return await handler(JsonBodyRequest(request.scope, request.receive))

        return parse_off_the_loop
