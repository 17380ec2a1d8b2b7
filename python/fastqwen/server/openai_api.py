"""/v1/completions and /v1/chat/completions in OpenAI's shapes, streaming (SSE) and not."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from ..engine.messages import TokenLogprobs
from ..frontend import RequestOutput, RequestTracker
from ..grammar import tool_call_structured
from ..limits import check_prompt_logprob_entries
from ..sampling_params import StructuredOutput
from .http_errors import APIError, client_closed_response
from .json_body import JsonBodyRoute
from .prep_pool import SMALL_REQUEST_BYTES
from .protocol import ChatCompletionRequest, CompletionRequest
from .reasoning import CLOSE as THINK_CLOSE
from .reasoning import ReasoningSplitter, prompt_opens_thinking, split_reasoning
from .serving import (
    SSE_DONE,
    StreamingUpdatesResponse,
    TextEvents,
    collect_requests,
    json_response_in_pieces,
    sse,
    stream_requests,
)
from .state import ServerState
from .tools import ToolCallParser, check_tools, messages_for_template, parse_tool_calls

router = APIRouter(route_class=JsonBodyRoute)  # big bodies are parsed off the event loop


def usage(num_prompt: int, num_completion: int, num_cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "prompt_tokens_details": {"cached_tokens": num_cached},
    }


class _RunningUsage:
    """stream_options.continuous_usage_stats: every chunk of a choice carries that choice's usage so far, as vLLM
    sends it."""

    def __init__(self, requests: list[RequestTracker]):
        self.requests = requests
        self.completion = [0] * len(requests)

    def see(self, index: int, num_new_tokens: int, finished: RequestOutput | None = None) -> None:
        self.completion[index] = finished.num_completion_tokens if finished else self.completion[index] + num_new_tokens

    def of(self, index: int) -> dict[str, Any]:
        request = self.requests[index]
        return usage(request.num_prompt_tokens, self.completion[index], request.num_cached_tokens)


def _running_usage(body, requests: list[RequestTracker]) -> _RunningUsage | None:
    options = body.stream_options
    return _RunningUsage(requests) if options is not None and options.continuous_usage_stats else None


def _token_text(state: ServerState, token: int) -> str:
    return state.engine.frontend.tokenizer.token_text(token) if state.has_tokenizer else str(token)


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


def echo_logprobs(
    state: ServerState, prompt_ids: list[int], entries: list[TokenLogprobs | None], as_ids: bool
) -> dict[str, Any]:
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
        ranked = {
            str(entry.token): {
                "logprob": entry.logprob,
                "rank": entry.rank,
                "decoded_token": _token_text(state, entry.token),
            }
        }
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

    return {
        "content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]
    }


async def _build(
    state: ServerState,
    body,
    prompts: list,
    http_request: HTTPRequest,
    structured: StructuredOutput | None = None,
    prompt_logprob_copies: int = 1,
) -> tuple[list, list[int]]:
    """Engine requests for every prompt x n choice (validated all before any is queued), and each one's prompt;
    `structured` replaces the body's output constraint (the tool-call grammar of tool_choice "required" / named).

    A prompt's logprobs are the same for every choice: only its first choice's request computes them (the others
    take them from it: owner_of). prompt_logprob_copies: how many times the response carries them (n for
    completions, one per choice; 1 for chat, beside the choices), for their limit. Tokenizing is CPU work
    proportional to the prompt: the prep pool's, unless the request is small."""
    first = body.to_sampling_params(0)  # validates n and every field before anything else happens
    params = [first] + [replace(body.to_sampling_params(choice), prompt_logprobs=None) for choice in range(1, body.n)]
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
        if first.prompt_logprobs is not None:
            positions = sum(len(r.prompt_ids) - first.prompt_logprobs_start for r in requests[:: body.n])
            param = "prompt_logprobs" if body.prompt_logprobs is not None else "logprobs"
            check_prompt_logprob_entries(positions, first.prompt_logprobs, prompt_logprob_copies, param)
        return requests, prompt_of

    requests, prompt_of = await state.prepare(http_request, make, always_pooled=params[0].structured is not None)
    state.engine.enqueue(requests)
    return requests, prompt_of


def owner_of(index: int, n: int) -> int:
    """The request that computed the prompt logprobs of choice `index`: its prompt's first choice."""
    return index - index % n


def _response_bytes(outputs: list[RequestOutput], n: int, top: int, prompt_copies: int) -> int:
    """About how much JSON a finished response makes: big ones are built in the prep pool, off the event loop."""
    entries = sum(len(o.logprobs or ()) for o in outputs)
    entries += prompt_copies * sum(len(o.prompt_logprobs or ()) for o in outputs[::n])
    return 40 * entries * (top + 1) + sum(len(o.text or "") + 8 * len(o.token_ids) for o in outputs)


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
    return replace(
        output,
        token_ids=[],
        text="",
        logprobs=[] if output.logprobs is not None else None,
        num_completion_tokens=0,
        finish_reason="length",
        stop_reason=None,
    )


def _prompt_text(state: ServerState, request: RequestTracker, prompt) -> str:
    """The prompt as echoed: the text as sent, or the token ids decoded."""
    if isinstance(prompt, str):
        return prompt
    return (
        state.engine.frontend.tokenizer.decode(request.prompt_ids, skip_special_tokens=False)
        if state.has_tokenizer
        else ""
    )


def _prompt_texts(state: ServerState, body, requests: list[RequestTracker], prompts: list) -> list[str]:
    """Each prompt's echoed text ("" without echo), made once for its n choices."""
    if not body.echo:
        return [""] * len(prompts)
    return [_prompt_text(state, requests[p * body.n], prompt) for p, prompt in enumerate(prompts)]


@router.post("/v1/completions")
async def completions(body: CompletionRequest, http_request: HTTPRequest) -> Response:
    state: ServerState = http_request.app.state.server
    state.check_model(body.model)
    prompts = body.prompts()
    requests, prompt_of = await _build(state, body, prompts, http_request, prompt_logprob_copies=body.n)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    header = {"id": rid, "object": "text_completion", "created": created, "model": state.model_name}
    texts = await state.prepare(http_request, lambda: _prompt_texts(state, body, requests, prompts))
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        body_iter = _stream_completion(state, body, requests, texts, prompt_of, header, include_usage)
        return StreamingUpdatesResponse(body_iter, state.engine, requests)
    outputs = await collect_requests(state.engine, requests, state.metrics, http_request)
    if outputs is None:
        return client_closed_response()
    if body.prompt_only:
        outputs = [_prompt_only(o) for o in outputs]

    def respond() -> Response:
        choices = _completion_choices(state, body, requests, outputs, texts, prompt_of)
        return json_response_in_pieces({**header, "choices": choices, "usage": _usage_of(outputs, prompt_of)})

    top = max(body.logprobs or 0, body.prompt_logprobs or 0)
    size = _response_bytes(outputs, body.n, top, body.n)
    return await state.prep.run(respond, size, SMALL_REQUEST_BYTES, may_refuse=False)


def _completion_choices(state: ServerState, body: CompletionRequest, requests, outputs, texts, prompt_of) -> list:
    """The choices of a finished completion. A prompt's echoed logprobs and vLLM prompt logprobs are built once, from
    its first choice's output (the one that computed them), and shared by its n choices."""
    as_ids = body.return_tokens_as_token_ids
    shared: dict[int, tuple] = {}  # prompt index -> (echoed logprobs, vLLM prompt logprobs)
    choices = []
    for i, (request, o) in enumerate(zip(requests, outputs)):
        p = prompt_of[i]
        if p not in shared:
            owner = outputs[owner_of(i, body.n)]
            entries = owner.prompt_logprobs or []
            echoed = (
                echo_logprobs(state, owner.prompt_token_ids, entries, as_ids)
                if body.echo and o.logprobs is not None
                else None
            )
            shared[p] = (echoed, vllm_prompt_logprobs(state, entries) if body.prompt_logprobs is not None else None)
        echoed, prompt_logprobs = shared[p]
        logprobs = None
        if o.logprobs is not None:
            logprobs = completion_logprobs(state, o.logprobs, len(texts[p]), as_ids)
            if echoed is not None:
                logprobs = _join_logprobs(echoed, logprobs)
        choice = {
            "index": i,
            "text": texts[p] + (o.text or ""),
            "logprobs": logprobs,
            "finish_reason": o.finish_reason,
            "stop_reason": vllm_stop_reason(request, o),
            "token_ids": o.token_ids,
        }
        if prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs
        choices.append(choice)
    return choices


def _join_logprobs(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    return {key: first[key] + second[key] for key in first}


async def _stream_completion(state, body, requests, texts, prompt_of, header, include_usage) -> AsyncIterator[str]:
    outputs: list[RequestOutput | None] = [None] * len(requests)
    offsets = [0] * len(requests)
    as_ids = body.return_tokens_as_token_ids
    # Echoed prompt logprobs go out with each choice's first token. Only the prompt's first choice computes them: the
    # other choices' updates are held until it has (echoed), then sent in order.
    echo_logprobs_on = body.echo and body.logprobs is not None
    echoed: dict[int, dict[str, Any]] = {}  # prompt index -> its echoed logprobs
    held: dict[int, list] = {}  # prompt index -> [(choice index, update)] waiting for them
    sent_echo = [False] * len(requests)
    running = _running_usage(body, requests)

    def event(i: int, choice: dict[str, Any]) -> str:
        return sse({**header, "choices": [choice], **({"usage": running.of(i)} if running else {})})

    # A token's event in the common case (no logprobs, no running usage), from a template: the same bytes as event().
    text_event = TextEvents(
        lambda i, text: {**header, "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": None}]}
    )

    if body.echo:  # the prompt goes first, one event per choice
        events = []
        for i in range(len(requests)):
            offsets[i] = len(texts[prompt_of[i]])
            events.append(event(i, {"index": i, "text": texts[prompt_of[i]], "logprobs": None, "finish_reason": None}))
        yield "".join(events)

    def events_of(i: int, update, events: list[str]) -> None:
        echo_part = None
        if echo_logprobs_on and not sent_echo[i] and update.new_logprobs is not None:
            sent_echo[i] = True
            echo_part = echoed.get(prompt_of[i])
        o = None
        if update.finished:
            o = _prompt_only(update.output) if body.prompt_only else update.output
        if running:
            running.see(i, 0 if body.prompt_only else len(update.new_token_ids), o)
        if not body.prompt_only:
            text = update.new_text or ""
            logprobs = None
            if update.new_logprobs is not None:
                logprobs = completion_logprobs(state, update.new_logprobs, offsets[i], as_ids)
                if echo_part is not None:
                    logprobs = _join_logprobs(echo_part, logprobs)
            offsets[i] += len(text)
            # One event per token, even when its text is still held back: clients time tokens by events.
            if logprobs is None and running is None:
                events.append(text_event(i, text))
            else:
                events.append(event(i, {"index": i, "text": text, "logprobs": logprobs, "finish_reason": None}))
        elif echo_part is not None:
            events.append(event(i, {"index": i, "text": "", "logprobs": echo_part, "finish_reason": None}))
        if o is not None:
            outputs[i] = o
            choice = {
                "index": i,
                "text": "",
                "logprobs": None,
                "finish_reason": o.finish_reason,
                "stop_reason": vllm_stop_reason(requests[i], o),
            }
            events.append(event(i, choice))

    def render(batch) -> str:
        events: list[str] = []  # the batch's events go out in one write
        for item in batch:
            update, i = item.timed.update, item.index
            p = prompt_of[i]
            if echo_logprobs_on and update.prompt_logprobs is not None:
                echoed[p] = echo_logprobs(state, requests[i].prompt_ids, update.prompt_logprobs, as_ids)
            if echo_logprobs_on and p not in echoed:
                held.setdefault(p, []).append((i, update))
                continue
            for j, earlier in held.pop(p, []):
                events_of(j, earlier, events)
            events_of(i, update, events)
        return "".join(events)

    async for batch in stream_requests(state.engine, requests, state.metrics):
        # The batch that brings a prompt's logprobs echoes them to every choice: built off the event loop when big.
        entries = (
            sum(len(item.timed.update.prompt_logprobs or ()) for item in batch) * body.n if echo_logprobs_on else 0
        )
        yield await state.prep.run(
            lambda: render(batch), 40 * entries * ((body.logprobs or 0) + 1), SMALL_REQUEST_BYTES, may_refuse=False
        )
    if held:  # a prompt whose first choice ended without its logprobs (aborted): the rest go out without them
        events: list[str] = []
        for waiting in held.values():
            for i, update in waiting:
                events_of(i, update, events)
        yield "".join(events)
    if include_usage:
        yield sse({**header, "choices": [], "usage": _usage_of(outputs, prompt_of)})
    yield SSE_DONE


def _after_thinking(
    state: ServerState, structured: StructuredOutput | None, prompt: str, opened: bool
) -> StructuredOutput | None:
    """A chat constraint applies to the answer: a reasoning model (its tokenizer has <think> and </think>) may think
    first, as vLLM does with a reasoning parser, unless the prompt closed the block already (Qwen3 with
    enable_thinking false); with the block opened by the prompt, the output must close it first."""
    thinking = state.thinking_tokens()
    if structured is None or thinking is None or (not opened and prompt.rstrip().endswith(THINK_CLOSE)):
        return structured
    return replace(structured, thinking=thinking, thinking_open=opened)


@dataclass
class ChatStart:
    """A chat request queued on the engine, and what reading its output needs."""

    requests: list[RequestTracker]
    prompt_of: list[int]
    # The reasoning splitter's arguments (reasoning.py): whether the prompt opened the thinking block, and whether the
    # text before the first </think> is reasoning anyway (the grammar leaves thinking free until it: see why there).
    splitting: tuple[bool, bool]
    parse_calls: bool  # tools were rendered: the output goes through the tool-call parser


async def start_chat(state: ServerState, body: ChatCompletionRequest, http_request: HTTPRequest) -> ChatStart:
    """Validate a chat request, render its prompt with the chat template (tools included), choose its output
    constraint (response_format, or the tool-call grammar) and queue it. /v1/responses runs through here too."""
    state.check_model(body.model)
    constraint = body.to_sampling_params().structured  # a bad field is refused before the template is rendered
    choice = check_tools(body.tools, body.tool_choice)
    if choice not in (None, "none", "auto"):
        # "required" or a named function: the output is constrained to Qwen3's <tool_call> blocks whose JSON names an
        # allowed function with arguments matching its schema, so the parser below always finds a valid call.
        if constraint is not None:
            raise APIError(
                400,
                f"tool_choice {body.tool_choice!r} constrains the output already; it cannot be combined "
                "with response_format or guided decoding",
                "tool_choice",
            )
        constraint = tool_call_structured(
            body.tools, body.tool_choice, state.token_ids("<tool_call>", "</tool_call>") is not None
        )
    # tool_choice "none" renders no tools (vLLM's --exclude-tools-when-tool-choice-none): a model shown tools may
    # still write calls, which would then come back as content.
    tools = body.tools if choice not in (None, "none") else None
    messages = messages_for_template(body.messages)
    kwargs = body.chat_template_kwargs or {}
    prompt = await state.prepare(
        http_request, lambda: state.render_chat(messages, body.add_generation_prompt, kwargs, tools)
    )
    opened = prompt_opens_thinking(prompt)
    structured = _after_thinking(state, constraint, prompt, opened)
    # The grammar leaves thinking free until </think>: split where it does (reasoning.py says why only here).
    splitting = (opened, structured is not None and structured.thinking is not None)
    requests, prompt_of = await _build(state, body, [prompt], http_request, structured=structured)
    return ChatStart(requests, prompt_of, splitting, tools is not None)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, http_request: HTTPRequest) -> Response:
    state: ServerState = http_request.app.state.server
    start = await start_chat(state, body, http_request)
    requests, prompt_of, splitting, parse_calls = start.requests, start.prompt_of, start.splitting, start.parse_calls
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    header = {"id": rid, "object": "chat.completion", "created": created, "model": state.model_name}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunk_header = {**header, "object": "chat.completion.chunk"}
        body_iter = _stream_chat(state, body, requests, prompt_of, chunk_header, include_usage, splitting, parse_calls)
        return StreamingUpdatesResponse(body_iter, state.engine, requests)
    outputs = await collect_requests(state.engine, requests, state.metrics, http_request)
    if outputs is None:
        return client_closed_response()
    top = max(body.top_logprobs or 0, body.prompt_logprobs or 0)
    size = _response_bytes(outputs, body.n, top, 1)
    return await state.prep.run(
        lambda: _chat_response(state, body, requests, outputs, prompt_of, header, splitting, parse_calls),
        size,
        SMALL_REQUEST_BYTES,
        may_refuse=False,
    )


def _chat_response(state, body, requests, outputs, prompt_of, header, splitting, parse_calls) -> Response:
    choices = []
    for i, (request, o) in enumerate(zip(requests, outputs)):
        reasoning, content = split_reasoning(o.text or "", *splitting)
        calls = []
        if parse_calls:
            content, calls = parse_tool_calls(content, single_call=not body.parallel_tool_calls)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content if content or not calls else None,
            "tool_calls": calls,
        }
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
        response["prompt_logprobs"] = vllm_prompt_logprobs(
            state, outputs[0].prompt_logprobs or []
        )  # (the one computed)
    return json_response_in_pieces(response)


def _chat_finish_reason(output: RequestOutput, called: bool) -> str:
    """ "tool_calls" when the model stopped after calling (a call cut by max_tokens stays "length")."""
    return "tool_calls" if called and output.finish_reason == "stop" else output.finish_reason


async def _stream_chat(
    state, body, requests, prompt_of, header, include_usage, splitting, parse_calls
) -> AsyncIterator[str]:
    outputs: list[RequestOutput | None] = [None] * len(requests)
    splitters = [ReasoningSplitter(*splitting) for _ in requests]
    parsers = [ToolCallParser(single_call=not body.parallel_tool_calls) if parse_calls else None for _ in requests]
    started = [False] * len(requests)
    running = _running_usage(body, requests)

    def chunk(index: int, delta: dict[str, Any], logprobs=None, finish_reason=None, **extra) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason, **extra}
        return sse({**header, "choices": [choice], **({"usage": running.of(index)} if running else {})})

    # A token's event in the common case (only content, no logprobs, no running usage): the same bytes as chunk().
    content_chunk = TextEvents(
        lambda i, text: {
            **header,
            "choices": [{"index": i, "delta": {"content": text}, "logprobs": None, "finish_reason": None}],
        }
    )

    async for batch in stream_requests(state.engine, requests, state.metrics):
        events = []  # the batch's events go out in one write
        for item in batch:
            i, update = item.index, item.timed.update
            if running:
                running.see(i, len(update.new_token_ids), update.output if update.finished else None)
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
            # One event per token, even when its text is still held back.
            if logprobs is None and running is None and len(delta) == 1 and "content" in delta:
                events.append(content_chunk(i, delta["content"]))
            else:
                events.append(chunk(i, delta, logprobs))
            if update.finished:
                outputs[i] = o = update.output
                called = parsers[i] is not None and bool(parsers[i].calls)
                events.append(
                    chunk(i, {}, None, _chat_finish_reason(o, called), stop_reason=vllm_stop_reason(requests[i], o))
                )
        yield "".join(events)
    if include_usage:
        yield sse({**header, "choices": [], "usage": _usage_of(outputs, prompt_of)})
    yield SSE_DONE
