"""SGLang's native POST /generate: text or input_ids in, text, output_ids and meta_info out.

Streaming sends the cumulative text and output ids in every event, as SGLang does (its clients read them that way),
then data: [DONE]. As in SGLang, the updates that piled up while the stream was behind go out as one event with the
latest state: a cumulative event loses nothing by skipping the ones before it, and a client under load parses one
event, not one per token. The cumulative parts are kept as JSON text that only grows, so an event costs a copy of the
output so far, not a re-encoding of it. With --incremental-streaming-output (SGLang's flag) each event carries only
what is new since the last event: text, ids and logprobs.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from ..frontend import RequestOutput
from ..limits import check_prompt_logprob_entries
from .http_errors import APIError, client_closed_response
from .json_body import JsonBodyRoute
from .prep_pool import SMALL_REQUEST_BYTES
from .protocol import GenerateRequest
from .serving import (
    SSE_DONE,
    StreamingUpdatesResponse,
    collect_requests,
    json_response_in_pieces,
    sse_event,
    stream_requests,
)
from .state import ServerState

router = APIRouter(route_class=JsonBodyRoute)  # big bodies are parsed off the event loop


def _finish_reason(output: RequestOutput) -> dict[str, Any]:
    if output.finish_reason == "length":
        return {"type": "length", "length": output.num_completion_tokens}
    if output.finish_reason == "stop":
        return {"type": "stop", "matched": output.stop_reason}
    return {"type": output.finish_reason}


def _meta(rid: str, output: RequestOutput | None, prompt_tokens: int, completion_tokens: int, started: float):
    return {
        "id": rid,
        "finish_reason": _finish_reason(output) if output is not None else None,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "cached_tokens": output.num_cached_tokens if output is not None else 0,
        "e2e_latency": time.monotonic() - started,
    }


def _logprobs(output_logprobs, decode=None) -> dict[str, Any]:
    """SGLang's [logprob, token id, text] triples; the text is None unless return_text_in_logprobs (decode given)."""
    text = decode or (lambda _: None)
    return {
        "output_token_logprobs": [[e.logprob, e.token, text(e.token)] for e in output_logprobs],
        "output_top_logprobs": [[[lp, t, text(t)] for t, lp in e.top] for e in output_logprobs],
    }


def _input_logprobs(prompt_ids: list[int], start: int, entries, decode=None) -> dict[str, Any]:
    """SGLang's input_token_logprobs from logprob_start_len on: the first prompt token's logprob is None."""
    text = decode or (lambda _: None)
    entries = entries or []
    return {
        "input_token_logprobs": [
            [None if e is None else e.logprob, t, text(t)] for e, t in zip(entries, prompt_ids[start:])
        ],
        "input_top_logprobs": [None if e is None else [[lp, t, text(t)] for t, lp in e.top] for e in entries],
    }


@router.post("/generate")
async def generate(body: GenerateRequest, http_request: HTTPRequest) -> Response:
    state: ServerState = http_request.app.state.server
    prompts, batched = body.prompts()
    if batched and body.stream:
        raise APIError(400, "streaming is for one prompt at a time", "stream")
    params = body.to_sampling_params()
    state.check_sequences(len(prompts))

    # Tokenizing is CPU work proportional to the prompt: the prep pool's, unless the request is small.
    def make() -> list:
        requests = [state.engine.new_request(p, params) for p in prompts]
        if params.prompt_logprobs is not None:
            positions = sum(len(r.prompt_ids) - params.prompt_logprobs_start for r in requests)
            check_prompt_logprob_entries(positions, params.prompt_logprobs, 1, "logprob_start_len")
        return requests

    requests = await state.prepare(http_request, make, always_pooled=params.structured is not None)
    state.engine.enqueue(requests)
    started = time.monotonic()
    rids = [body.rid or f"gen-{r.rid}" for r in requests]
    if body.stream:
        body_iter = _stream(state, body, requests[0], rids[0], started, state.incremental_streaming_output)
        return StreamingUpdatesResponse(body_iter, state.engine, requests)
    outputs = await collect_requests(state.engine, requests, state.metrics, http_request)
    if outputs is None:
        return client_closed_response()
    decode = _decoder(state) if body.return_text_in_logprobs else None

    def respond() -> Response:
        results = []
        for rid, o in zip(rids, outputs):
            meta = _meta(rid, o, o.num_prompt_tokens, o.num_completion_tokens, started)
            if o.logprobs is not None:
                meta.update(_logprobs(o.logprobs, decode))
                if body.logprob_start_len >= 0:
                    meta.update(_input_logprobs(o.prompt_token_ids, body.logprob_start_len, o.prompt_logprobs, decode))
            results.append({"text": o.text if o.text is not None else "", "output_ids": o.token_ids, "meta_info": meta})
        return json_response_in_pieces(results if batched else results[0])

    entries = sum(len(o.logprobs or ()) + len(o.prompt_logprobs or ()) for o in outputs) * (body.top_logprobs_num + 1)
    size = 40 * entries + sum(len(o.text or "") + 8 * len(o.token_ids) for o in outputs)
    return await state.prep.run(respond, size, SMALL_REQUEST_BYTES, may_refuse=False)  # big ones off the event loop


def _decoder(state: ServerState):
    tokenizer = state.engine.frontend.tokenizer
    return tokenizer.token_text if tokenizer is not None else None


def _input_logprobs_json(prompt_ids: list[int], start: int, entries, decode) -> str:
    """The input logprobs as JSON members (',"key":value' each), to add to an event's meta_info."""
    inputs = _input_logprobs(prompt_ids, start, entries, decode)
    return "".join(f',"{k}":{json.dumps(v, ensure_ascii=False, separators=(",", ":"))}' for k, v in inputs.items())


def _json_items(values) -> str:
    """Comma-separated JSON of a list's items: a fragment that later items are appended to."""
    return json.dumps(values, ensure_ascii=False, separators=(",", ":"))[1:-1]


class _Cumulative:
    """A JSON fragment that only grows: the output so far, encoded once per piece."""

    def __init__(self, incremental: bool):
        self.incremental = incremental
        self.text = ""  # JSON-escaped, without quotes
        self.lists: dict[str, str] = {}  # key -> comma-separated JSON items

    def add_text(self, delta: str) -> str:
        piece = json.dumps(delta, ensure_ascii=False)[1:-1]
        self.text = piece if self.incremental else self.text + piece
        return self.text

    def add_items(self, key: str, values: list) -> str:
        piece = _json_items(values)
        if self.incremental or not self.lists.get(key):
            self.lists[key] = piece
        elif piece:
            self.lists[key] += "," + piece
        return self.lists[key]


async def _stream(
    state: ServerState, body: GenerateRequest, request, rid: str, started: float, incremental: bool
) -> AsyncIterator[str]:
    out = _Cumulative(incremental)
    count = 0
    with_logprobs = body.return_logprob
    decode = _decoder(state) if body.return_text_in_logprobs else None
    input_logprobs = None  # once known (with the first token), in every cumulative event; in the first incremental one
    async for batch in stream_requests(state.engine, [request], state.metrics):
        updates = [item.timed.update for item in batch]
        count += sum(len(u.new_token_ids) for u in updates)
        text = out.add_text("".join(u.new_text or "" for u in updates))
        ids = out.add_items("output_ids", [t for u in updates for t in u.new_token_ids])
        meta = _meta(rid, updates[-1].output, request.num_prompt_tokens, count, started)
        meta_json = json.dumps(meta, ensure_ascii=False, separators=(",", ":"))
        if with_logprobs:
            new = _logprobs([e for u in updates for e in (u.new_logprobs or [])], decode)
            fields = "".join(f',"{key}":[{out.add_items(key, values)}]' for key, values in new.items())
            first = next((u for u in updates if u.prompt_logprobs is not None), None)
            if body.logprob_start_len >= 0 and (first is not None or (input_logprobs and not incremental)):
                if first is not None:  # up to 32,768 positions: encoded off the event loop when big
                    input_logprobs = await state.prep.run(
                        lambda: _input_logprobs_json(
                            request.prompt_ids, body.logprob_start_len, first.prompt_logprobs, decode
                        ),
                        40 * len(first.prompt_logprobs) * (body.top_logprobs_num + 1),
                        SMALL_REQUEST_BYTES,
                        may_refuse=False,
                    )
                fields += input_logprobs
            meta_json = meta_json[:-1] + fields + "}"
        yield sse_event(f'{{"text":"{text}","output_ids":[{ids}],"meta_info":{meta_json}}}')
    yield SSE_DONE
