"""/v1/completions and /v1/chat/completions in OpenAI's shapes, streaming (SSE) and not."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from ..engine.messages import TokenLogprobs
from ..frontend import RequestOutput
from .protocol import ChatCompletionRequest, CompletionRequest
from .reasoning import ReasoningSplitter, prompt_opens_thinking, split_reasoning
from .serving import SSE_DONE, StreamingUpdatesResponse, collect_requests, sse, stream_requests
from .state import ServerState, client_closed_response

router = APIRouter()


def usage(num_prompt: int, num_completion: int, num_cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "prompt_tokens_details": {"cached_tokens": num_cached},
    }


def _token_text(state: ServerState, token: int) -> str:
    return state.engine.frontend.tokenizer.decode([token], skip_special_tokens=False) if state.has_tokenizer else str(token)


def completion_logprobs(state: ServerState, entries: list[TokenLogprobs], offset: int = 0) -> dict[str, Any]:
    tokens, token_logprobs, top, offsets = [], [], [], []
    for entry in entries:
        text = _token_text(state, entry.token)
        tokens.append(text)
        token_logprobs.append(entry.logprob)
        top.append({_token_text(state, t): lp for t, lp in entry.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(state: ServerState, entries: list[TokenLogprobs]) -> dict[str, Any]:
    def item(token: int, logprob: float) -> dict[str, Any]:
        text = _token_text(state, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]}


async def _build(state: ServerState, body, prompts: list) -> tuple[list, list[int]]:
    """Engine requests for every prompt x n choice (validated all before any is queued), and each one's prompt.

    Tokenizing is CPU work proportional to the prompt: it runs in a worker thread, never on the event loop."""
    first = body.to_sampling_params(0)  # validates n and every field before anything else happens
    params = [first] + [body.to_sampling_params(choice) for choice in range(1, body.n)]
    state.check_sequences(len(prompts) * body.n)

    def make() -> tuple[list, list[int]]:
        requests, prompt_of = [], []
        for p_index, prompt in enumerate(prompts):
            ids = None
            for choice in range(body.n):
                tracker = state.engine.new_request(prompt if ids is None else ids, params[choice])
                ids = tracker.prompt_ids  # the n choices share one tokenization
                requests.append(tracker)
                prompt_of.append(p_index)
        return requests, prompt_of

    requests, prompt_of = await asyncio.to_thread(make)
    state.engine.enqueue(requests)
    return requests, prompt_of


def _usage_of(outputs: list[RequestOutput], prompt_of: list[int]) -> dict[str, Any]:
    first_of_prompt = {}
    for output, p in zip(outputs, prompt_of):
        first_of_prompt.setdefault(p, output)
    return usage(
        sum(o.num_prompt_tokens for o in first_of_prompt.values()),
        sum(o.num_completion_tokens for o in outputs),
        sum(o.num_cached_tokens for o in first_of_prompt.values()),
    )


@router.post("/v1/completions")
async def completions(body: CompletionRequest, http_request: HTTPRequest) -> Response:
    state: ServerState = http_request.app.state.server
    state.check_model(body.model)
    requests, prompt_of = await _build(state, body, body.prompts())
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    header = {"id": rid, "object": "text_completion", "created": created, "model": state.model_name}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        body_iter = _stream_completion(state, requests, prompt_of, header, include_usage)
        return StreamingUpdatesResponse(body_iter, state.engine, requests)
    outputs = await collect_requests(state.engine, requests, state.metrics, http_request)
    if outputs is None:
        return client_closed_response()
    choices = [
        {
            "index": i,
            "text": o.text if o.text is not None else "",
            "logprobs": completion_logprobs(state, o.logprobs) if o.logprobs is not None else None,
            "finish_reason": o.finish_reason,
            "stop_reason": o.stop_reason,
            "token_ids": o.token_ids,
        }
        for i, o in enumerate(outputs)
    ]
    return JSONResponse({**header, "choices": choices, "usage": _usage_of(outputs, prompt_of)})


async def _stream_completion(state, requests, prompt_of, header, include_usage) -> AsyncIterator[str]:
    outputs: list[RequestOutput | None] = [None] * len(requests)
    offsets = [0] * len(requests)
    async for batch in stream_requests(state.engine, requests, state.metrics):
        events = []  # the batch's events go out in one write
        for item in batch:
            update = item.timed.update
            text = update.new_text or ""
            logprobs = None
            if update.new_logprobs is not None:
                logprobs = completion_logprobs(state, update.new_logprobs, offsets[item.index])
            offsets[item.index] += len(text)
            # One event per token, even when its text is still held back: clients time tokens by events.
            choice = {"index": item.index, "text": text, "logprobs": logprobs, "finish_reason": None}
            events.append(sse({**header, "choices": [choice]}))
            if update.finished:
                outputs[item.index] = update.output
                o = update.output
                choice = {"index": item.index, "text": "", "logprobs": None, "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}
                events.append(sse({**header, "choices": [choice]}))
        yield "".join(events)
    if include_usage:
        yield sse({**header, "choices": [], "usage": _usage_of(outputs, prompt_of)})
    yield SSE_DONE


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, http_request: HTTPRequest) -> Response:
    state: ServerState = http_request.app.state.server
    state.check_model(body.model)
    body.to_sampling_params()  # a bad field is refused before the template is rendered
    prompt = await asyncio.to_thread(state.render_chat, body.messages, body.add_generation_prompt, body.chat_template_kwargs or {})
    opened = prompt_opens_thinking(prompt)
    requests, prompt_of = await _build(state, body, [prompt])
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    header = {"id": rid, "object": "chat.completion", "created": created, "model": state.model_name}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunk_header = {**header, "object": "chat.completion.chunk"}
        body_iter = _stream_chat(state, requests, prompt_of, chunk_header, include_usage, opened)
        return StreamingUpdatesResponse(body_iter, state.engine, requests)
    outputs = await collect_requests(state.engine, requests, state.metrics, http_request)
    if outputs is None:
        return client_closed_response()
    choices = []
    for i, o in enumerate(outputs):
        reasoning, content = split_reasoning(o.text or "", opened)
        message: dict[str, Any] = {"role": "assistant", "content": content, "tool_calls": []}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": chat_logprobs(state, o.logprobs) if o.logprobs is not None else None,
                "finish_reason": o.finish_reason,
                "stop_reason": o.stop_reason,
            }
        )
    return JSONResponse({**header, "choices": choices, "usage": _usage_of(outputs, prompt_of)})


async def _stream_chat(state, requests, prompt_of, header, include_usage, opened) -> AsyncIterator[str]:
    outputs: list[RequestOutput | None] = [None] * len(requests)
    splitters = [ReasoningSplitter(opened) for _ in requests]
    started = [False] * len(requests)

    def chunk(index: int, delta: dict[str, Any], logprobs=None, finish_reason=None, **extra) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason, **extra}
        return sse({**header, "choices": [choice]})

    async for batch in stream_requests(state.engine, requests, state.metrics):
        events = []  # the batch's events go out in one write
        for item in batch:
            i, update = item.index, item.timed.update
            reasoning, content = splitters[i].feed(update.new_text or "")
            if update.finished:
                r2, c2 = splitters[i].finish()
                reasoning, content = reasoning + r2, content + c2
            logprobs = chat_logprobs(state, update.new_logprobs) if update.new_logprobs is not None else None
            delta: dict[str, Any] = {}
            if not started[i]:  # the role goes out with the first token, never before one exists
                delta["role"] = "assistant"
                started[i] = True
            if reasoning:
                delta["reasoning_content"] = reasoning
            if content or not reasoning:
                delta["content"] = content
            events.append(chunk(i, delta, logprobs))  # one event per token, even when its text is still held back
            if update.finished:
                outputs[i] = update.output
                events.append(chunk(i, {}, None, update.output.finish_reason, stop_reason=update.output.stop_reason))
        yield "".join(events)
    if include_usage:
        yield sse({**header, "choices": [], "usage": _usage_of(outputs, prompt_of)})
    yield SSE_DONE
