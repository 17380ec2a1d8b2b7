"""Connection hygiene at the HTTP protocol level: uvicorn's h11 protocol plus what it lacks.

uvicorn closes a connection that idles *between* requests (--timeout-keep-alive), but not one that never sends a
request, nor one that sends half a request and stalls: each holds a file descriptor forever, and enough of them stop
the server accepting anyone. So here:
- a request's headers must arrive within `header_timeout` seconds of the connection opening (or of its first byte,
  after a kept-alive request); its body gets as long again, plus one second per `min_body_rate` bytes that came, up
  to `body_timeout` seconds in all. Otherwise the connection is closed, with a 408 when part of a request came. A
  body dribbled a byte at a time (slowloris) is cut off after about `header_timeout` seconds, not `body_timeout`;
- connection slots are shared out by ConnectionSlots below: at most `max_connections` in all, at most
  `max_connections_per_peer` from one client address, and the last `reserved_connections` only for fresh peers and
  /health, so one client (or a few) can neither hold every slot nor keep the health probe out. A refused connection
  gets its 503 (server full) or 429 (this peer holds its share) at once and is closed;
- a request h11 cannot parse gets its 400 in OpenAI's JSON shape, and one whose head exceeds `max_header_bytes` or
  `max_header_count` a 431: h11's own 16 KiB bound only applies to a head still incomplete, so a 100 KB head sent
  in one write would pass without the check here.
Refusals are logged through the rate-limited log (log_limit.py), so a flood cannot fill the disk.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .http_errors import error_body

logger = logging.getLogger("fastqwen.server")

HEALTH_PATH = b"/health"


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    min_body_rate: float = 1024.0  # bytes/s a body must average once its first header_timeout seconds are spent
    max_connections: int = 2048
    max_connections_per_peer: int = 1920  # max_connections - reserved_connections: a gateway may use every general slot
    reserved_connections: int = 128  # of max_connections: only fresh peers and /health may take these
    fresh_peer_connections: int = 2  # a peer holding fewer connections than this is fresh
    max_header_bytes: int = 16 * 1024  # request line and header lines together
    max_header_count: int = 100

    def __post_init__(self) -> None:
        if not 0 <= self.reserved_connections < self.max_connections:
            raise ValueError(
                f"reserved_connections ({self.reserved_connections}) must be at least 0 and below "
                f"max_connections ({self.max_connections})"
            )


# ---- who may hold a connection slot ----------------------------------------------------------------------------

# The kinds of slot a connection can get. A health-only connection serves /health and nothing else, then closes.
GENERAL, RESERVED, HEALTH_ONLY = "general", "reserved", "health only"


@dataclass(frozen=True)
class Refusal:
    status: int
    message: str


class ConnectionSlots:
    """The admission policy for connections, one per server (all on the event loop thread, so no lock).

    A new connection from `peer` (its IP address) gets, in this order of preference:
    - a general slot, while fewer than max_connections - reserved_connections are open and the peer holds fewer
      than max_connections_per_peer;
    - a reserved slot, while fewer than max_connections are open, if the peer is fresh (holds fewer than
      fresh_peer_connections): a client arriving while others hold the general slots still gets in;
    - a health-only slot, while fewer than max_connections are open, if the peer holds no other health-only one:
      a probe gets its answer even from an address that holds its whole share, and a flood from one address takes
      one reserved slot at most, for at most header_timeout;
    - else a refusal: 429 when the peer holds its share, 503 when the server is full.
    Invariant: `open` is the sum of `held`, a peer is in `held` only while it holds a connection, and every
    admitted connection is released exactly once (GuardedH11Protocol.connection_lost).
    """

    def __init__(self, limits: ConnectionLimits):
        self.limits = limits
        self.open = 0
        self.held: dict[str, int] = {}  # peer -> connections open from it, of every kind
        self.health_only: set[str] = set()  # peers holding a health-only connection

    def admit(self, peer: str) -> str | Refusal:
        limits, held = self.limits, self.held.get(peer, 0)
        if self.open >= limits.max_connections:
            return Refusal(
                503, f"the server holds as many connections as it may ({limits.max_connections}); retry later"
            )
        within_share = held < limits.max_connections_per_peer
        if within_share and self.open < limits.max_connections - limits.reserved_connections:
            kind = GENERAL
        elif within_share and held < limits.fresh_peer_connections:
            kind = RESERVED
        elif peer not in self.health_only:
            kind = HEALTH_ONLY
            self.health_only.add(peer)
        else:
            return self.refusal(peer)
        self.open += 1
        self.held[peer] = held + 1
        return kind

    def release(self, peer: str, kind: str) -> None:
        self.open -= 1
        left = self.held[peer] - 1
        if left:
            self.held[peer] = left
        else:
            del self.held[peer]
        if kind == HEALTH_ONLY:
            self.health_only.discard(peer)

    def refusal(self, peer: str) -> Refusal:
        """Why `peer` gets nothing more than /health now."""
        held, limit = self.held.get(peer, 0), self.limits.max_connections_per_peer
        general = self.limits.max_connections - self.limits.reserved_connections
        if held >= limit and limit < general:  # (a share as large as every general slot: the server is full, 503)
            return Refusal(
                429,
                f"too many connections from {peer or 'this client'} (at most {limit} at once); "
                "reuse them or retry later",
            )
        return Refusal(503, "the server's connections are taken; retry later")


# ---- the protocol ------------------------------------------------------------------------------------------------


def _raw_error(status: int, reason: str, message: str) -> bytes:
    """A complete HTTP/1.1 error response that closes the connection: for when no request (h11 cycle) exists."""
    body = json.dumps(error_body(status, message)).encode()
    retry = "retry-after: 1\r\n" if status in (429, 503) else ""
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        f"{retry}connection: close\r\n\r\n"
    )
    return head.encode() + body


_REASONS = {
    400: b"Bad Request",
    429: b"Too Many Requests",
    431: b"Request Header Fields Too Large",
    503: b"Service Unavailable",
}


class ScreenedConnection(h11.Connection):
    """h11's server connection, plus a look at each request head before uvicorn acts on it, and a count of the
    body bytes of the request in progress (for the body's minimum rate)."""

    def __init__(self, protocol: GuardedH11Protocol, max_incomplete_event_size: int):
        super().__init__(h11.SERVER, max_incomplete_event_size)
        self._protocol = protocol
        self.refusal: Refusal | None = None  # why the last RemoteProtocolError was raised
        self.body_received = 0

    def next_event(self):
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as e:
            if e.error_status_hint == 431:  # h11's bound on a head still incomplete, which is ours
                message = f"the request head is larger than {self._protocol.limits.max_header_bytes} bytes"
            else:
                message = f"the request is not valid HTTP/1.1: {e}"
            self.refusal = Refusal(e.error_status_hint, message)
            raise
        if type(event) is h11.Request:
            self.body_received = 0
            event, self.refusal = self._protocol.screen(event)
            if self.refusal is not None:
                # uvicorn answers a RemoteProtocolError through send_400_response (below), with self.refusal
                raise h11.RemoteProtocolError(self.refusal.message, self.refusal.status)
        elif type(event) is h11.Data:
            self.body_received += len(event.data)
        return event


LINGER_S = 2.0  # how long a closed connection still reads (and drops) what the client sends after our response


class _LingeringTransport:
    """The connection's transport, closed the way a server must close while the client may still be sending (a 413
    before the body, a refusal mid-upload): our response, then a FIN, then whatever the client still sends is read and
    dropped for LINGER_S (at most; the slot is held meanwhile) before the socket closes. Closing at once would leave unread bytes in the kernel's buffer,
    which makes it reset the connection, and the reset can destroy our response before the client reads it."""

    def __init__(self, transport, protocol: GuardedH11Protocol) -> None:
        self._transport = transport
        self._protocol = protocol
        self._closing = False

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        transport = self._transport
        # Only a client cut off mid-body can still be sending: every other close is at once (a refused or finished
        # connection must not outlive its slot).
        mid_body = getattr(getattr(self._protocol, "conn", None), "their_state", None) is h11.SEND_BODY
        if not mid_body or transport.is_closing() or not transport.can_write_eof():
            transport.close()
            return
        self._protocol.lingering = True
        try:
            transport.write_eof()
            transport.resume_reading()
        except (OSError, RuntimeError):
            transport.close()
            return
        asyncio.get_running_loop().call_later(LINGER_S, transport.close)

    def is_closing(self) -> bool:
        return self._closing or self._transport.is_closing()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class GuardedH11Protocol(H11Protocol):
    limits = ConnectionLimits()  # set per server by protocol_with(), with its own slots
    slots = ConnectionSlots(limits)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.conn = ScreenedConnection(self, self.limits.max_header_bytes)

    def connection_made(self, transport) -> None:
        self._timer = None
        self._phase = None  # "headers" or "body" while a request is being read; None otherwise
        self._slot: str | None = None  # the kind of slot this connection holds; None: refused (or released)
        self.lingering = False  # closed by us: what arrives now is dropped (_LingeringTransport)
        transport = _LingeringTransport(transport, self)
        super().connection_made(transport)
        self._peer = self.client[0] if self.client else ""
        admitted = self.slots.admit(self._peer)
        if isinstance(admitted, Refusal):
            logger.warning("refused a connection from %s: %s", self._peer or "?", admitted.message)
            reason = _REASONS[admitted.status].decode()
            transport.write(_raw_error(admitted.status, reason, admitted.message))
            transport.close()
            return
        self._slot = admitted
        self._arm("headers")

    def data_received(self, data: bytes) -> None:
        if self.lingering:  # the rest of a body we already answered: dropped
            return
        super().data_received(data)
        self._track()

    def _close_now(self) -> None:
        """Close without lingering: a refusal or a deadline must free the slot at once, whatever the client sends."""
        transport = self.transport
        (transport._transport if isinstance(transport, _LingeringTransport) else transport).close()

    def eof_received(self) -> bool | None:
        if self.lingering:  # the client is done sending too: close now
            self.transport._transport.close()
            return None
        return super().eof_received()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track()

    def connection_lost(self, exc) -> None:
        self._disarm()
        if self._slot is not None:
            self.slots.release(self._peer, self._slot)
            self._slot = None
        super().connection_lost(exc)

    def screen(self, request: h11.Request) -> tuple[h11.Request, Refusal | None]:
        """The request to hand uvicorn, or why it is refused, from its head alone."""
        limits = self.limits
        if len(request.headers) > limits.max_header_count:
            return request, Refusal(
                431,
                f"the request has {len(request.headers)} header lines; at most {limits.max_header_count} are accepted",
            )
        # The head as sent, to within the separators: "METHOD TARGET HTTP/x.y\r\n", "name: value\r\n" each, "\r\n".
        size = (
            len(request.method)
            + len(request.target)
            + 16
            + sum(len(n) + len(v) + 4 for n, v in request.headers.raw_items())
        )
        if size > limits.max_header_bytes:
            return request, Refusal(
                431, f"the request head is about {size} bytes; at most {limits.max_header_bytes} are accepted"
            )
        if self._slot == HEALTH_ONLY:
            if request.target.partition(b"?")[0] != HEALTH_PATH:
                return request, self.slots.refusal(self._peer)
            # The reserved slot is given back after this answer: "connection: close" in the request makes uvicorn
            # say it in the response, and h11 then closes the connection.
            headers = [*request.headers.raw_items(), (b"connection", b"close")]
            request = h11.Request(
                method=request.method, target=request.target, headers=headers, http_version=request.http_version
            )
        return request, None

    def send_400_response(self, msg: str) -> None:
        refusal = self.conn.refusal or Refusal(400, msg)
        body = json.dumps(error_body(refusal.status, refusal.message)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
            (b"connection", b"close"),
        ]
        if refusal.status in (429, 503):
            headers.append((b"retry-after", b"1"))
        try:
            reason = _REASONS.get(refusal.status, b"Bad Request")
            self.transport.write(
                self.conn.send(h11.Response(status_code=refusal.status, headers=headers, reason=reason))
            )
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:  # h11 cannot frame a response here: close without one
            pass
        self._close_now()

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
        self._phase_started = self.loop.time()
        self._timer = self.loop.call_later(self._allowance(phase), self._expired, phase)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._phase = None, None

    def _allowance(self, phase: str) -> float:
        """Seconds this phase may take, as far as its bytes so far earn."""
        limits = self.limits
        if phase == "headers":
            return limits.header_timeout
        return min(limits.body_timeout, limits.header_timeout + self.conn.body_received / limits.min_body_rate)

    def _expired(self, phase: str) -> None:
        self._timer = None
        if self.transport.is_closing():
            self._phase = None
            return
        if phase == "body" and self.flow.read_paused:
            # The route has not taken the body already buffered (uvicorn stopped reading): that wait is ours, not
            # the client's, so its clock starts again.
            self._phase = None
            self.conn.body_received = 0
            self._arm("body")
            return
        allowed = self._allowance(phase)
        elapsed = self.loop.time() - self._phase_started
        if elapsed < allowed:  # the body came fast enough so far: look again when its allowance is spent
            self._timer = self.loop.call_later(allowed - elapsed, self._expired, phase)
            return
        self._phase = None
        logger.warning(
            "closed a connection from %s: request %s not received within %.3g s", self._peer or "?", phase, elapsed
        )
        if phase == "headers":
            answer = bool(self.conn.trailing_data[0])  # part of a request came; a silent connection just closes
            detail = f"the request headers did not arrive within {allowed:g} s"
        else:
            answer = self.cycle is not None and not self.cycle.response_started
            detail = (
                f"the request body arrived too slowly ({self.conn.body_received} bytes in {elapsed:.3g} s; "
                f"at least {self.limits.min_body_rate:g} bytes/s after the first {self.limits.header_timeout:g} s, "
                f"and all of it within {self.limits.body_timeout:g} s)"
            )
        if answer:
            self.transport.write(_raw_error(408, "Request Timeout", detail))
        self._close_now()  # a route waiting for the body sees the client disconnect


def protocol_with(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """The protocol class to hand uvicorn (Config(http=...)), with these limits and slots of its own."""
    return type("LimitedH11Protocol", (GuardedH11Protocol,), {"limits": limits, "slots": ConnectionSlots(limits)})
