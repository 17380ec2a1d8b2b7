"""The gate every HTTP request passes before any route sees it (a plain ASGI middleware, inside Starlette's error
middleware and outside everything else):

1. Authentication first, from the headers alone: an unauthenticated body is never read, let alone parsed.
2. The body is read here, up to --max-request-body-bytes (a larger Content-Length is refused before a byte is read),
   then handed to the route as one message.
3. Text that cannot be UTF-8 is refused: JSON lets a client send a lone surrogate ("\\ud800", or its raw bytes, which
   Python's json decodes too), and such a string fails later, wherever it is encoded (the tokenizer, a response).
4. An exception that escapes a route before its response started becomes a 500 in OpenAI's shape here, on a
   connection that stays usable (uvicorn would answer plain text and close it).

Every refusal is an OpenAI-shaped JSON error. When the body was not read (an over-long one, or one sent without
credentials beyond a few KiB), the response says Connection: close: the client is still sending it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
from typing import Any

from .http_errors import error_body

logger = logging.getLogger("fastqwen.server")

# Paths anyone may call (probes and docs); every other path needs the API key when one is set.
PUBLIC_PATHS = frozenset({"/health", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
# An unauthenticated body up to this size is read and dropped, so the connection can serve the next request.
_DRAIN_LIMIT = 64 * 1024
# A surrogate code point, as a JSON escape or as its (invalid) UTF-8 bytes: only bodies with one get the full check.
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}|\xed[\xa0-\xbf]")


async def send_error(
    send,
    status: int,
    message: str,
    param: str | None = None,
    close: bool = False,
    headers: dict[str, str] | None = None,
) -> None:
    body = json.dumps(error_body(status, message, param)).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    if close:
        raw_headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def find_undecodable(value: Any, where: str = "") -> str | None:
    """The path of the first string in a parsed JSON value that is not valid Unicode text (a lone surrogate)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where or "body"
        return None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = find_undecodable(key, where) if isinstance(key, str) else None
        found = found or find_undecodable(item, f"{where}.{key}" if where else str(key))
        if found:
            return found
    return None


def _undecodable_field(body: bytes) -> str | None:
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return None  # not JSON (or nested beyond what json parses): the route says so
    return find_undecodable(parsed)


class RequestGuard:
    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app = app
        self.api_key = api_key.encode() if api_key is not None else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = self._content_length(scope)
        if self.api_key is not None and scope["path"] not in PUBLIC_PATHS and not self._authorized(scope):
            close = length is None or length > _DRAIN_LIMIT
            if not close and not await self._drain(receive):
                return
            await send_error(
                send, 401, "a valid API key is required: send it as 'Authorization: Bearer <key>'", close=close
            )
            return
        if length is not None and length > self.max_body_bytes:
            await self._too_large(send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                await self._too_large(send)
                return
            if not message.get("more_body", False):
                break
        # (the two substring tests find nothing in most bodies at memchr speed: a 32k-token prompt's 238 KB of
        # digits took 1.2 ms of the regex, on the way to its first token)
        if (b"\\u" in body or b"\xed" in body) and _MAYBE_SURROGATE.search(body):
            where = await asyncio.to_thread(_undecodable_field, bytes(body))
            if where is not None:
                param = where.split(".", 1)[0]
                await send_error(send, 400, f"{where}: the text is not valid Unicode (a lone surrogate)", param)
                return
        await self._call_app(scope, bytes(body), receive, send)

    async def _call_app(self, scope, body: bytes, receive, send) -> None:
        delivered = False
        started = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # afterwards only http.disconnect can come

        async def watch(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, replay, watch)
        except Exception:
            if started:
                raise  # the status line is out: nothing better than closing the connection (uvicorn does)
            logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            await send_error(send, 500, "internal server error (logged on the server)")

    def _authorized(self, scope) -> bool:
        header = _header(scope, b"authorization") or b""
        scheme, _, token = header.partition(b" ")
        # Bytes on both sides: a token that is not ASCII is simply wrong, never an error.
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.api_key)

    @staticmethod
    def _content_length(scope) -> int | None:
        value = _header(scope, b"content-length")
        if value is None:
            return None if _header(scope, b"transfer-encoding") else 0
        try:
            return int(value)
        except ValueError:
            return None

    @staticmethod
    async def _drain(receive) -> bool:
        """Read and drop a small body; False if the client went away."""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return False
            if not message.get("more_body", False):
                return True

    async def _too_large(self, send) -> None:
        await send_error(
            send, 413, f"the request body is larger than this server accepts ({self.max_body_bytes} bytes)", close=True
        )
