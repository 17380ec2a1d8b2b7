"""/v1/completions and /v1/chat/completions in OpenAI's shapes, streaming (SSE) and not."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from ..engine.messages import TokenLogprobs
from ..frontend import RequestOutput, RequestTracker
from ..grammar import tool_call_structured
from ..sampling_params import StructuredOutput
from .protocol import ChatCompletionRequest, CompletionRequest
from .reasoning import CLOSE as THINK_CLOSE, ReasoningSplitter, prompt_opens_thinking, split_reasoning
from .serving import SSE_DONE, StreamingUpdatesResponse, collect_requests, sse, stream_requests
from .state import APIError, ServerState, client_closed_response
from .tools import ToolCallParser, check_tools, messages_for_template, parse_tool_calls

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


def _token_id_key(token: int) -> str:
    return f"token_id:{token}"  # vLLM's --return-tokens-as-token-ids form


def completion_logprobs(
    state: ServerState, entries: list[TokenLogprobs | None], offset: int = 0, as_ids: bool = False
) -> dict[str, Any]:
    """OpenAI's completion logprobs; None entries (the first prompt token's, under echo) give null logprobs.
    top_logprobs is keyed by token text, as vLLM keys it; a token whose text is already a key at that position (two
    byte tokens that both decode to U+FFFD, say) is keyed by its id ("token_id:N") instead, so none is lost.
    as_ids (vLLM's return_tokens_as_token_ids): every token as "token_id:N"."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for entry in entries:
        if entry is None:
            continue
        text = _token_text(state, entry.token)
        tokens.append(_token_id_key(entry.token) if as_ids else text)
        token_logprobs.append(entry.logprob)
        alternatives: dict[str, float] = {}
        for t, lp in entry.top:
            key = _token_id_key(t) if as_ids else _token_text(state, t)
            alternatives[_token_id_key(t) if key in alternatives else key] = lp
        top.append(alternatives)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def echo_logprobs(state: ServerState, prompt_ids: list[int], entries: list[TokenLogprobs | None], as_ids: bool) -> dict[str, Any]:
    """The prompt's part of echoed logprobs: every prompt token, the first with null logprob and top_logprobs."""
    first = prompt_ids[0]
    out = completion_logprobs(state, entries, len(_token_text(state, first)), as_ids)
    out["tokens"].insert(0, _token_id_key(first) if as_ids else _token_text(state, first))
    out["token_logprobs"].insert(0, None)
    out["top_logprobs"].insert(0, None)
    out["text_offset"].insert(0, 0)
    return out


def vllm_prompt_logprobs(state: ServerState, entries: list[TokenLogprobs | None]) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: per prompt position None (the first) or {token id: {logprob, rank, decoded_token}} for
    the prompt token and the most likely ones."""
    out: list[dict[str, Any] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranked = {str(entry.token): {"logprob": entry.logprob, "rank": entry.rank, "decoded_token": _token_text(state, entry.token)}}
        for rank, (t, lp) in enumerate(entry.top, 1):
            ranked.setdefault(str(t), {"logprob": lp, "rank": rank, "decoded_token": _token_text(state, t)})
        out.append(ranked)
    return out


def vllm_stop_reason(request: RequestTracker, output: RequestOutput) -> int | str | None:
    """vLLM's stop_reason: the stop string or stop token id that matched; null for an EOS (and anything else)."""
    reason = output.stop_reason
    if isinstance(reason, int) and reason not in request.request.params.stop_token_ids:
        return None
    return reason


def chat_logprobs(state: ServerState, entries: list[TokenLogprobs]) -> dict[str, Any]:
    def item(token: int, logprob: float) -> dict[str, Any]:
        text = _token_text(state, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]}


async def _build(state: ServerState, body, prompts: list, structured: StructuredOutput | None = None) -> tuple[list, list[int]]:
    """Engine requests for every prompt x n choice (validated all before any is queued), and each one's prompt;
    `structured` replaces the body's output constraint (the tool-call grammar of tool_choice "required" / named).

    Tokenizing is CPU work proportional to the prompt: it runs in a worker thread, never on the event loop."""
    first = body.to_sampling_params(0)  # validates n and every field before anything else happens
    params = [first] + [body.to_sampling_params(choice) for choice in range(1, body.n)]
    if structured is not None:
        params = [replace(p, structured=structured) for p in params]
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


def _prompt_only(output: RequestOutput) -> RequestOutput:
    """max_tokens 0: the prompt's part only (the engine sampled one token to finish the prefill; it is dropped)."""
    if output.finish_reason not in ("length", "stop"):
        return output  # an abort or an error is what it is
    return replace(output, token_ids=[], text="", logprobs=[] if output.logprobs is not None else None,
                   num_completion_tokens=0, finish_reason="length", stop_reason=None)  # fmt: skip


def _prompt_text(state: ServerState, request: RequestTracker, prompt) -> str:
    """The prompt as echoed: the text as sent, or the token ids decoded."""
    if isinstance(prompt, str):
        return prompt
    return state.engine.frontend.tokenizer.decode(request.prompt_ids, skip_special_tokens=False) if state.has_tokenizer else ""


@router.post("/v1/completions")
async def completions(body: CompletionRequest, http_request: HTTPRequest) -> Response:
    state: ServerState = http_request.app.state.server
    state.check_model(body.model)
    prompts = body.prompts()
    requests, prompt_of = await _build(state, body, prompts)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    header = {"id": rid, "object": "text_completion", "created": created, "model": state.model_name}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        body_iter = _stream_completion(state, body, requests, prompts, prompt_of, header, include_usage)
        return StreamingUpdatesResponse(body_iter, state.engine, requests)
    outputs = await collect_requests(state.engine, requests, state.metrics, http_request)
    if outputs is None:
        return client_closed_response()
    if body.prompt_only:
        outputs = [_prompt_only(o) for o in outputs]
    as_ids = body.return_tokens_as_token_ids
    choices = []
    for i, (request, o) in enumerate(zip(requests, outputs)):
        text = o.text if o.text is not None else ""
        logprobs = completion_logprobs(state, o.logprobs, as_ids=as_ids) if o.logprobs is not None else None
        if body.echo:
            prompt_text = _prompt_text(state, request, prompts[prompt_of[i]])
            text = prompt_text + text
            if logprobs is not None:
                echoed = echo_logprobs(state, o.prompt_token_ids, o.prompt_logprobs or [], as_ids)
                logprobs = _join_logprobs(echoed, completion_logprobs(state, o.logprobs, len(prompt_text), as_ids))
        choice = {
            "index": i,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": o.finish_reason,
            "stop_reason": vllm_stop_reason(request, o),
            "token_ids": o.token_ids,
        }
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(state, o.prompt_logprobs or [])
        choices.append(choice)
    return JSONResponse({**header, "choices": choices, "usage": _usage_of(outputs, prompt_of)})


def _join_logprobs(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    return {key: first[key] + second[key] for key in first}


async def _stream_completion(state, body, requests, prompts, prompt_of, header, include_usage) -> AsyncIterator[str]:
    outputs: list[RequestOutput | None] = [None] * len(requests)
    offsets = [0] * len(requests)
    as_ids = body.return_tokens_as_token_ids
    if body.echo:  # the prompt goes first, one event per choice
        events = []
        for i, request in enumerate(requests):
            text = _prompt_text(state, request, prompts[prompt_of[i]])
            offsets[i] = len(text)
            # Echoed prompt logprobs come with the first token's update (the engine computes them in the prefill).
            events.append(sse({**header, "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": None}]}))
        yield "".join(events)
    async for batch in stream_requests(state.engine, requests, state.metrics):
        events = []  # the batch's events go out in one write
        for item in batch:
            update, i = item.timed.update, item.index
            if not body.prompt_only:
                text = update.new_text or ""
                logprobs = None
                if update.new_logprobs is not None:
                    logprobs = completion_logprobs(state, update.new_logprobs, offsets[i], as_ids)
                    if body.echo and update.prompt_logprobs is not None:
                        echoed = echo_logprobs(state, requests[i].prompt_ids, update.prompt_logprobs, as_ids)
                        logprobs = _join_logprobs(echoed, logprobs)
                offsets[i] += len(text)
                # One event per token, even when its text is still held back: clients time tokens by events.
                choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": None}
                events.append(sse({**header, "choices": [choice]}))
            elif body.echo and update.prompt_logprobs is not None and update.new_logprobs is not None:
                logprobs = echo_logprobs(state, requests[i].prompt_ids, update.prompt_logprobs, as_ids)
                events.append(sse({**header, "choices": [{"index": i, "text": "", "logprobs": logprobs, "finish_reason": None}]}))
            if update.finished:
                o = _prompt_only(update.output) if body.prompt_only else update.output
                outputs[i] = o
                choice = {"index": i, "text": "", "logprobs": None, "finish_reason": o.finish_reason,
                          "stop_reason": vllm_stop_reason(requests[i], o)}  # fmt: skip
                events.append(sse({**header, "choices": [choice]}))
        yield "".join(events)
    if include_usage:
        yield sse({**header, "choices": [], "usage": _usage_of(outputs, prompt_of)})
    yield SSE_DONE


def _after_thinking(state: ServerState, structured: StructuredOutput | None, prompt: str, opened: bool) -> StructuredOutput | None:
    """A chat constraint applies to the answer: a reasoning model (its tokenizer has <think> and </think>) may think
    first, as vLLM does with a reasoning parser, unless the prompt closed the block already (Qwen3 with
    enable_thinking false); with the block opened by the prompt, the output must close it first."""
    thinking = state.thinking_tokens()
    if structured is None or thinking is None or (not opened and prompt.rstrip().endswith(THINK_CLOSE)):
        return structured
    return replace(structured, thinking=thinking, thinking_open=opened)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, http_request: HTTPRequest) -> Response:
    state: ServerState = http_request.app.state.server
    state.check_model(body.model)
    constraint = body.to_sampling_params().structured  # a bad field is refused before the template is rendered
    choice = check_tools(body.tools, body.tool_choice)
    if choice not in (None, "none", "auto"):
        # "required" or a named function: the output is constrained to Qwen3's <tool_call> blocks whose JSON names an
        # allowed function with arguments matching its schema, so the parser below always finds a valid call.
        if constraint is not None:
            raise APIError(400, f"tool_choice {body.tool_choice!r} constrains the output already; it cannot be combined "
                           "with response_format or guided decoding", "tool_choice")  # fmt: skip
        constraint = tool_call_structured(body.tools, body.tool_choice, state.token_ids("<tool_call>", "</tool_call>") is not None)
    # tool_choice "none" renders no tools (vLLM's --exclude-tools-when-tool-choice-none): a model shown tools may
    # still write calls, which would then come back as content.
    tools = body.tools if choice not in (None, "none") else None
    messages = messages_for_template(body.messages)
    kwargs = body.chat_template_kwargs or {}
    prompt = await asyncio.to_thread(state.render_chat, messages, body.add_generation_prompt, kwargs, tools)
    opened = prompt_opens_thinking(prompt)
    structured = _after_thinking(state, constraint, prompt, opened)
    requests, prompt_of = await _build(state, body, [prompt], structured=structured)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    header = {"id": rid, "object": "chat.completion", "created": created, "model": state.model_name}
    parse_calls = tools is not None
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunk_header = {**header, "object": "chat.completion.chunk"}
        body_iter = _stream_chat(state, body, requests, prompt_of, chunk_header, include_usage, opened, parse_calls)
        return StreamingUpdatesResponse(body_iter, state.engine, requests)
    outputs = await collect_requests(state.engine, requests, state.metrics, http_request)
    if outputs is None:
        return client_closed_response()
    choices = []
    for i, (request, o) in enumerate(zip(requests, outputs)):
        reasoning, content = split_reasoning(o.text or "", opened)
        calls = []
        if parse_calls:
            content, calls = parse_tool_calls(content, single_call=not body.parallel_tool_calls)
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None, "tool_calls": calls}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": chat_logprobs(state, o.logprobs) if o.logprobs is not None else None,
                "finish_reason": _chat_finish_reason(o, bool(calls)),
                "stop_reason": vllm_stop_reason(request, o),
            }
        )
    response = {**header, "choices": choices, "usage": _usage_of(outputs, prompt_of)}
    if body.prompt_logprobs is not None:  # vLLM puts them beside the choices (every choice has the same prompt)
        response["prompt_logprobs"] = vllm_prompt_logprobs(state, outputs[0].prompt_logprobs or [])
    return JSONResponse(response)


def _chat_finish_reason(output: RequestOutput, called: bool) -> str:
    """"tool_calls" when the model stopped after calling (a call cut by max_tokens stays "length")."""
    return "tool_calls" if called and output.finish_reason == "stop" else output.finish_reason


async def _stream_chat(state, body, requests, prompt_of, header, include_usage, opened, parse_calls) -> AsyncIterator[str]:
    outputs: list[RequestOutput | None] = [None] * len(requests)
    splitters = [ReasoningSplitter(opened) for _ in requests]
    parsers = [ToolCallParser(single_call=not body.parallel_tool_calls) if parse_calls else None for _ in requests]
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
            calls = []
            if parsers[i] is not None:  # the content goes through the tool-call parser; reasoning never does
                content, calls = parsers[i].feed(content)
                if update.finished:
                    c3, calls3 = parsers[i].finish()
                    content, calls = content + c3, calls + calls3
            logprobs = chat_logprobs(state, update.new_logprobs) if update.new_logprobs is not None else None
            delta: dict[str, Any] = {}
            if not started[i]:  # the role goes out with the first token, never before one exists
                delta["role"] = "assistant"
                started[i] = True
            if reasoning:
                delta["reasoning_content"] = reasoning
            if content or not (reasoning or calls):
                delta["content"] = content
            if calls:
                delta["tool_calls"] = [c.to_openai() for c in calls]
            events.append(chunk(i, delta, logprobs))  # one event per token, even when its text is still held back
            if update.finished:
                outputs[i] = o = update.output
                called = parsers[i] is not None and bool(parsers[i].calls)
                events.append(chunk(i, {}, None, _chat_finish_reason(o, called), stop_reason=vllm_stop_reason(requests[i], o)))
        yield "".join(events)
    if include_usage:
        yield sse({**header, "choices": [], "usage": _usage_of(outputs, prompt_of)})
    yield SSE_DONE
