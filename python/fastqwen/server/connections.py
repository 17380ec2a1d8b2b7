"""Connection hygiene at the HTTP protocol level: uvicorn's h11 protocol plus what it lacks.

uvicorn closes a connection that idles *between* requests (--timeout-keep-alive), but not one that never sends a
request, nor one that sends half a request and stalls: each holds a file descriptor forever, and enough of them stop
the server accepting anyone. So here:
- a request's headers must arrive within `header_timeout` seconds of the connection opening (or of its first byte,
  after a kept-alive request), and its body within `body_timeout` seconds of the headers; otherwise the connection
  is closed (with a 408 when part of a request came);
- at most `max_connections` connections are open: one more is answered 503 and closed at once, so descriptors stay
  bounded whatever clients do;
- a request h11 cannot parse (or whose headers exceed h11's 16 KiB) gets its 400 in OpenAI's JSON shape.
Refusals are logged through the rate-limited log (log_limit.py), so a flood cannot fill the disk.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .state import error_body

logger = logging.getLogger("fastqwen.server")


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    max_connections: int = 2048


def _raw_error(status: int, reason: str, message: str) -> bytes:
    """A complete HTTP/1.1 error response that closes the connection: for when no request (h11 cycle) exists."""
    body = json.dumps(error_body(status, message)).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    limits = ConnectionLimits()  # set per server by protocol_with()

    def connection_made(self, transport) -> None:
        self._timer = None
        self._phase = None  # "headers" or "body" while a request is being read; None otherwise
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            logger.warning("refused a connection: %d open, the limit is %d", len(self.connections) - 1,
                           self.limits.max_connections)  # fmt: skip
            transport.write(_raw_error(503, "Service Unavailable", "too many open connections; retry later"))
            transport.close()
            return
        self._arm("headers")

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        try:
            self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers, reason=b"Bad Request")))
            self.transport.write(self.conn.send(h11.Data(data=json.dumps(error_body(400, msg)).encode())))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:  # h11 cannot frame a response here: close without one
            pass
        self.transport.close()

    # ---- the read deadline of the request in progress ------------------------------------------------------

    def _track(self) -> None:
        """Arm or disarm the deadline from where the connection stands after new data or a finished response."""
        if self.transport is None or self.transport.is_closing():
            self._disarm()
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            if self._phase == "headers" or self.conn.trailing_data[0]:
                self._arm("headers")  # a request has begun (or the connection is new) and its headers are not all in
            else:
                self._disarm()  # idle between requests: uvicorn's keep-alive timeout applies
        elif state is h11.SEND_BODY:
            self._arm("body")
        else:
            self._disarm()  # the request is all in

    def _arm(self, phase: str) -> None:
        if self._phase == phase:
            return
        self._disarm()
        self._phase = phase
        timeout = self.limits.header_timeout if phase == "headers" else self.limits.body_timeout
        self._timer = self.loop.call_later(timeout, self._expired, phase, timeout)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._phase = None, None

    def _expired(self, phase: str, timeout: float) -> None:
        self._timer, self._phase = None, None
        if self.transport.is_closing():
            return
        logger.warning("closed a connection from %s: request %s not received within %g s",
                       self.client[0] if self.client else "?", phase, timeout)  # fmt: skip
        if phase == "headers":
            answer = bool(self.conn.trailing_data[0])  # part of a request came; a silent connection just closes
        else:
            answer = self.cycle is not None and not self.cycle.response_started
        if answer:
            self.transport.write(_raw_error(408, "Request Timeout", f"the request {phase} did not arrive within {timeout:g} s"))
        self.transport.close()  # a route waiting for the body sees the client disconnect


def protocol_with(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """The protocol class to hand uvicorn (Config(http=...)), with these limits."""
    return type("LimitedH11Protocol", (GuardedH11Protocol,), {"limits": limits})
