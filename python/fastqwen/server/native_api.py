"""SGLang's native POST /generate: text or input_ids in, text, output_ids and meta_info out.

Streaming sends the cumulative text and output ids in every event, as SGLang does (its clients read them that way),
then data: [DONE]. As in SGLang, the updates that piled up while the stream was behind go out as one event with the
latest state: a cumulative event loses nothing by skipping the ones before it, and a client under load parses one
event, not one per token. The cumulative parts are kept as JSON text that only grows, so an event costs a copy of the
output so far, not a re-encoding of it. With --incremental-streaming-output (SGLang's flag) each event carries only
what is new since the last event: text, ids and logprobs.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from ..frontend import RequestOutput
from .protocol import GenerateRequest
from .serving import SSE_DONE, StreamingUpdatesResponse, collect_requests, sse_event, stream_requests
from .state import APIError, ServerState, client_closed_response

router = APIRouter()


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
    # Tokenizing is CPU work proportional to the prompt: a worker thread's, never the event loop's.
    requests = await asyncio.to_thread(lambda: [state.engine.new_request(p, params) for p in prompts])
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
    results = []
    for rid, o in zip(rids, outputs):
        meta = _meta(rid, o, o.num_prompt_tokens, o.num_completion_tokens, started)
        if o.logprobs is not None:
            meta.update(_logprobs(o.logprobs, decode))
            if body.logprob_start_len >= 0:
                meta.update(_input_logprobs(o.prompt_token_ids, body.logprob_start_len, o.prompt_logprobs, decode))
        results.append({"text": o.text if o.text is not None else "", "output_ids": o.token_ids, "meta_info": meta})
    return JSONResponse(results if batched else results[0])


def _decoder(state: ServerState):
    tokenizer = state.engine.frontend.tokenizer
    return (lambda t: tokenizer.decode([t], skip_special_tokens=False)) if tokenizer is not None else None


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


async def _stream(state: ServerState, body: GenerateRequest, request, rid: str, started: float, incremental: bool) -> AsyncIterator[str]:
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
                if first is not None:
                    inputs = _input_logprobs(request.prompt_ids, body.logprob_start_len, first.prompt_logprobs, decode)
                    input_logprobs = "".join(f',"{k}":{json.dumps(v, ensure_ascii=False, separators=(",", ":"))}' for k, v in inputs.items())
                fields += input_logprobs
            meta_json = meta_json[:-1] + fields + "}"
        yield sse_event(f'{{"text":"{text}","output_ids":[{ids}],"meta_info":{meta_json}}}')
    yield SSE_DONE
