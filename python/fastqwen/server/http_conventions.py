"""HTTP conventions operators and browsers expect: `x-request-id` (the client's, or a new one) echoed on every
response and available to the per-request log; CORS when --allowed-origins is given (off by default); access-log
lines without the probes (/health, /metrics polls)."""

from __future__ import annotations

import contextvars
import logging
import re
import uuid

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("fastqwen_request_id", default=None)
# What a client may pass as its id: printable, no spaces, bounded (it goes into log lines and a response header).
_VALID_ID = re.compile(r"^[!-~]{1,128}$")
PROBE_PATHS = ("/health", "/metrics")


def current_request_id() -> str | None:
    """The x-request-id of the HTTP request being handled (None outside one)."""
    return _request_id.get()


class RequestIdMiddleware:
    """A plain ASGI middleware (no per-request task): takes the client's x-request-id when it is a sane token,
    otherwise makes one, and adds it to the response's headers."""

    def __init__(self, app, served_by: str | None = None):
        """served_by: with several front-end processes, this one's index, sent as x-fastqwen-api-server."""
        self.app = app
        self.served_by = None if served_by is None else (b"x-fastqwen-api-server", served_by.encode("latin-1"))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        text = given.decode("latin-1") if given is not None else ""
        request_id = text if _VALID_ID.match(text) else uuid.uuid4().hex
        token = _request_id.set(request_id)
        headers = [(b"x-request-id", request_id.encode("latin-1"))]
        if self.served_by is not None:
            headers.append(self.served_by)

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *headers]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            _request_id.reset(token)


def install(app: FastAPI, allowed_origins: list[str] | None, served_by: str | None = None) -> None:
    """Call after every other middleware is added: these wrap them (CORS preflights are answered before the API key
    is checked, as browsers send them without credentials). served_by: RequestIdMiddleware's."""
    if allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=allowed_origins,
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["x-request-id", "x-fastqwen-api-server"],
            allow_credentials="*" not in allowed_origins,
        )
    app.add_middleware(RequestIdMiddleware, served_by=served_by)


class _SkipProbes(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args  # uvicorn's access line: (client, method, path, http version, status)
        return not (isinstance(args, tuple) and len(args) >= 3 and str(args[2]).split("?")[0] in PROBE_PATHS)


def configure_access_log(enabled: bool) -> None:
    """Access logs without a line per /health or /metrics poll (a probe every few seconds drowns the rest). Call after
    uvicorn.Config, which sets the access logger to --uvicorn-log-level: its lines are INFO, so at the default
    "warning" an enabled access log would log nothing."""
    access = logging.getLogger("uvicorn.access")
    access.addFilter(_SkipProbes())
    if enabled:
        access.setLevel(logging.INFO)
