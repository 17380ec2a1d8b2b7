"""What every endpoint shares: running a set of engine requests for one HTTP request, as one stream of updates or as
finished outputs, recording the latency metrics, and aborting everything when the client goes away."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request as HTTPRequest
from fastapi.responses import Response, StreamingResponse

from ..frontend import RequestOutput, RequestTracker
from .async_engine import AsyncEngine, Mailbox, ServingError, TimedUpdate
from .http_conventions import current_request_id
from .http_errors import error_body
from .metrics import Metrics, RequestTimes

logger = logging.getLogger("fastqwen.server")

_DISCONNECT_POLL_S = 0.05


@dataclass
class IndexedUpdate:
    index: int  # which of the HTTP request's engine requests
    timed: TimedUpdate


class _Observer:
    """Latency metrics of one engine request, from the times its updates were produced."""

    def __init__(self, metrics: Metrics | None, request: RequestTracker, prefix_cache_on: bool):
        self.metrics = metrics
        self.request = request
        self.prefix_cache_on = prefix_cache_on
        self.request_id = current_request_id()  # the HTTP request's x-request-id, for the per-request log
        self.first: float | None = None
        self.last: float | None = None

    def see(self, timed: TimedUpdate) -> None:
        m = self.metrics
        if m is None:
            return
        update, now, request = timed.update, timed.time, self.request
        if self.first is None:
            self.first = now
            m.on_first_token(request, now - request.arrival_time)
            if self.prefix_cache_on:
                m.on_prefix_lookup(request.num_prompt_tokens, request.num_cached_tokens)
        m.on_tokens(len(update.new_token_ids), None if self.last is None else now - self.last)
        self.last = now
        if update.finished:
            times = RequestTimes(request.arrival_time, request.first_scheduled_time, self.first, now)
            m.on_request_finished(request, update.output, times, self.request_id)


async def stream_requests(
    engine: AsyncEngine, requests: list[RequestTracker], metrics: Metrics | None
) -> AsyncIterator[list[IndexedUpdate]]:
    """All updates of several enqueued requests, interleaved as they come, in batches of those already waiting (the
    event loop falls behind under load: a batch is then one write instead of one per token). Closing the iterator
    aborts the rest."""
    if len(requests) == 1:  # nothing to merge: the request's own queue, without a task in between
        observer = _Observer(metrics, requests[0], engine.frontend.info.prefix_caching)
        updates = engine.updates(requests[0])
        try:
            async for timed_batch in updates:
                for timed in timed_batch:
                    observer.see(timed)
                yield [IndexedUpdate(0, timed) for timed in timed_batch]
        finally:
            await updates.aclose()
        return
    merged = Mailbox()

    async def pump(index: int, request: RequestTracker) -> None:
        observer = _Observer(metrics, request, engine.frontend.info.prefix_caching)
        try:
            async for timed_batch in engine.updates(request):
                for timed in timed_batch:
                    observer.see(timed)
                    merged.put_nowait(IndexedUpdate(index, timed))
        except BaseException as e:  # surfaced to the consumer below
            merged.put_nowait(e)
            raise

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    remaining = len(requests)
    try:
        while remaining:
            batch = await merged.take_all()
            for item in batch:
                if isinstance(item, BaseException):
                    raise item
                if item.timed.update.finished:
                    remaining -= 1
            yield batch
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect_requests(
    engine: AsyncEngine, requests: list[RequestTracker], metrics: Metrics | None, http_request: HTTPRequest
) -> list[RequestOutput] | None:
    """Finished outputs in order, or None if the client disconnected first. Every request that did not finish is
    aborted, whatever ends the wait (a disconnect, a cancelled handler, an error)."""

    async def collect() -> list[RequestOutput]:
        outputs: list[RequestOutput | None] = [None] * len(requests)
        async for batch in stream_requests(engine, requests, metrics):
            for item in batch:
                if item.timed.update.finished:
                    outputs[item.index] = item.timed.update.output
        return outputs

    task = asyncio.create_task(collect())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await http_request.is_disconnected():
                return None
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for request in requests:
            engine.abort(request)


# JSON leaves these raw inside strings, but clients that split a stream with str.splitlines() (httpx's iter_lines
# among them) end a line at each; escaped, an event stays one line and decodes to the same text. (Only strings can
# hold them, so replacing them in encoded JSON is safe.)
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def sse_event(json_text: str) -> str:
    """One server-sent event carrying encoded JSON, on one line for every client."""
    return f"data: {json_text.translate(_LINE_BREAKS)}\n\n"


def sse(payload: dict) -> str:
    return sse_event(json.dumps(payload, ensure_ascii=False, separators=(",", ":")))


SSE_DONE = "data: [DONE]\n\n"

# json.dumps of a lone string with ensure_ascii=False is this C function; called directly it skips dumps' set-up.
_encode_string = json.encoder.encode_basestring
_INDEX_MARK, _TEXT_MARK = "\x00fastqwen-index\x00", "\x00fastqwen-text\x00"


class TextEvents:
    """The events of a stream that differ only in a choice's index and one string: sse() of the chunk, byte for byte,
    from the chunk encoded once with placeholders. Encoding each token's whole chunk with json.dumps was the largest
    single cost of a streamed token in the front end (bench/frontend_rate.py).

    make_chunk(index, text) builds the chunk as sse() would be given it; it is called once, with placeholders."""

    def __init__(self, make_chunk):
        encoded = sse(make_chunk(_INDEX_MARK, _TEXT_MARK))
        head, rest = encoded.split(_encode_string(_INDEX_MARK), 1)
        middle, tail = rest.split(_encode_string(_TEXT_MARK), 1)
        self._head, self._middle, self._tail = head, middle, tail

    def __call__(self, index: int, text: str) -> str:
        return f"{self._head}{index}{self._middle}{_encode_string(text).translate(_LINE_BREAKS)}{self._tail}"


_PIECE_ITEMS = 256


def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))  # as JSONResponse encodes


def _flat(value) -> bool:
    """No container inside: one json.dumps call encodes it quickly."""
    if isinstance(value, dict):
        return not any(isinstance(v, (dict, list)) for v in value.values())
    if isinstance(value, list):
        return len(value) <= _PIECE_ITEMS and not any(isinstance(v, (dict, list)) for v in value)
    return True


def _encode_pieces(value, out: list[str]) -> None:
    if _flat(value):
        out.append(_dumps(value))
    elif isinstance(value, dict):
        out.append("{")
        for i, (key, item) in enumerate(value.items()):
            out.append(("," if i else "") + _dumps(str(key)) + ":")
            _encode_pieces(item, out)
        out.append("}")
    else:
        out.append("[")
        for start in range(0, len(value), _PIECE_ITEMS):
            part = value[start : start + _PIECE_ITEMS]
            if start:
                out.append(",")
            if all(_flat(item) for item in part):
                out.append(_dumps(part)[1:-1])
            else:
                for i, item in enumerate(part):
                    if i:
                        out.append(",")
                    _encode_pieces(item, out)
        out.append("]")


def json_response_in_pieces(payload) -> Response:
    """A JSON response encoded a part at a time. json.dumps is C code that holds the GIL until it returns: on a
    30 MB response, even in a worker thread, that stalled the event loop for seconds; each part takes a millisecond or
    so. The same bytes as JSONResponse."""
    out: list[str] = []
    _encode_pieces(payload, out)
    return Response("".join(out).encode("utf-8"), media_type="application/json")


async def _with_error_event(body: AsyncIterator[str]) -> AsyncIterator[str]:
    """Once the status line is out, an error can only be told in the stream: an error event, then [DONE]."""
    try:
        async for chunk in body:
            yield chunk
    except ServingError as e:
        yield sse(error_body(e.status, str(e)))
        yield SSE_DONE
    except Exception:  # a bug: the stream still ends in the protocol's terms, and the connection stays usable
        logger.exception("a stream failed")
        yield sse(error_body(500, "internal server error (logged on the server)"))
        yield SSE_DONE


class StreamingUpdatesResponse(StreamingResponse):
    """A streaming response that aborts its requests however it ends, even if its body never started (a client
    gone before the first byte): the body's own finally blocks would not run then."""

    def __init__(self, body, engine: AsyncEngine, requests: list[RequestTracker]):
        super().__init__(_with_error_event(body), media_type="text/event-stream")
        self._engine = engine
        self._requests = requests

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for request in self._requests:
                self._engine.abort(request)
