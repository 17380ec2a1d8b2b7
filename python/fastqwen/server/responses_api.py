"""/v1/responses (OpenAI's Responses API): a request becomes a chat request (responses_items, protocol's
ResponsesRequest) and runs the chat path (start_chat: template, tools, structured output); its output goes through the
same reasoning splitter and tool-call parser, then becomes output items (responses_output). Stored responses
(responses_store) continue a conversation through previous_response_id and are served by GET /v1/responses/{id}."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from itertools import count
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from ..frontend import RequestOutput
from .http_errors import APIError, client_closed_response
from .json_body import JsonBodyRoute
from .openai_api import ChatStart, start_chat
from .protocol import ResponsesRequest
from .reasoning import ReasoningSplitter
from .responses_items import assistant_message, input_messages
from .responses_logprobs import TextLogprobs
from .responses_output import OutputBuilder, new_id, reasoning_tokens, usage
from .responses_store import json_size
from .serving import StreamingUpdatesResponse, collect_requests, sse, stream_requests
from .state import ServerState
from .tools import CLOSE as TOOL_CALL_CLOSE
from .tools import ToolCallParser

router = APIRouter(route_class=JsonBodyRoute)


class _Turn:
    """One response being made: its request, its conversation and the shape it is answered in."""

    def __init__(self, state: ServerState, body: ResponsesRequest):
        self.state = state
        self.body = body
        self.id = new_id("resp")
        self.created_at = int(time.time())
        history, history_size = [], 0
        if body.previous_response_id is not None:
            stored = state.responses.get(body.previous_response_id)
            if stored is None:
                raise APIError(
                    404, f"Previous response with id '{body.previous_response_id}' not found.", "previous_response_id"
                )
            history, history_size = stored.conversation, stored.conversation_size
        self.new_messages = input_messages(body.input)
        self.history, self.history_size = history, history_size
        instructions = [{"role": "system", "content": body.instructions}] if body.instructions else []
        self.messages = instructions + history + self.new_messages  # instructions are never carried to the next turn

    def response(self, output: list[dict[str, Any]], finished: RequestOutput | None, start: ChatStart) -> dict:
        """The response object: in progress (finished None, while streaming) or finished."""
        body = self.body
        status, used, incomplete = "in_progress", None, None
        if finished is not None:
            status = "incomplete" if finished.finish_reason == "length" else "completed"
            incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
            thinking = self.state.thinking_tokens()
            thought = any(item["type"] == "reasoning" for item in output)
            reasoning = reasoning_tokens(finished.token_ids, thinking and thinking[1], thought)
            request = start.requests[0]
            used = usage(
                request.num_prompt_tokens, request.num_cached_tokens, finished.num_completion_tokens, reasoning
            )
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": int(time.time()) if finished is not None else None,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "model": self.state.model_name,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": (body.reasoning or {}).get("effort"), "summary": None},
            "store": body.store,
            "temperature": body.temperature,
            "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": body.tools or [],
            "top_logprobs": body.top_logprobs,
            "top_p": body.top_p,
            "truncation": "disabled",
            "usage": used,
            "user": body.user,
        }

    def remember(self, response: dict[str, Any]) -> None:
        if not self.body.store:
            return
        turn = [*self.new_messages, assistant_message(response["output"])]
        self.state.responses.put(response, self.history + turn, self.history_size + json_size(turn))


def _parsers(
    state: ServerState, body: ResponsesRequest, start: ChatStart
) -> tuple[ReasoningSplitter, ToolCallParser | None, OutputBuilder]:
    parser = ToolCallParser(single_call=not body.parallel_tool_calls) if start.parse_calls else None
    splitter = ReasoningSplitter(*start.splitting)
    logprobs = None
    if body.includes_output_logprobs():
        logprobs = TextLogprobs(state.engine.frontend.tokenizer.token_text, splitter, start.parse_calls)
    return splitter, parser, OutputBuilder(body.includes_encrypted_reasoning(), logprobs, body.tool_catalog())


def _feed(
    splitter, parser, builder: OutputBuilder, text: str, logprobs: list | None, finished: RequestOutput | None
) -> list[dict]:
    """Output text (and its tokens' logprobs) through the reasoning splitter and the tool-call parser into the
    builder: its events."""
    if builder.logprobs is not None:
        builder.logprobs.add(logprobs or [])
        if finished is not None:
            builder.logprobs.finish()
    reasoning, content = splitter.feed(text)
    if finished is not None:
        r2, c2 = splitter.finish()
        reasoning, content = reasoning + r2, content + c2
    if parser is None:
        events = builder.feed(reasoning, content, [])
    else:  # the content goes through the tool-call parser (reasoning never does), one call at a time: text after a
        # call (in the same piece) is an item after it
        events, pieces = [], content.split(TOOL_CALL_CLOSE)
        for i, piece in enumerate(pieces):
            text, calls = parser.feed(piece if i == len(pieces) - 1 else piece + TOOL_CALL_CLOSE)
            events += builder.feed(reasoning if i == 0 else "", text, calls)
        if finished is not None:
            events += builder.feed("", *parser.finish())
    if finished is not None:
        events += builder.finish(finished.finish_reason == "length")
    return events


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, http_request: HTTPRequest) -> Response:
    state: ServerState = http_request.app.state.server
    body.check()
    turn = _Turn(state, body)
    start = await start_chat(state, body.to_chat_request(turn.messages), http_request)
    if body.stream:
        return StreamingUpdatesResponse(_stream(turn, start), state.engine, start.requests)
    outputs = await collect_requests(state.engine, start.requests, state.metrics, http_request)
    if outputs is None:
        return client_closed_response()
    output = outputs[0]
    splitter, parser, builder = _parsers(state, body, start)
    _feed(splitter, parser, builder, output.text or "", output.logprobs, output)
    response = turn.response(builder.items, output, start)
    turn.remember(response)
    return JSONResponse(response)


def _event(sequence: count, event: dict[str, Any]) -> str:
    event["sequence_number"] = next(sequence)
    return f"event: {event['type']}\n" + sse(event)


async def _stream(turn: _Turn, start: ChatStart) -> AsyncIterator[str]:
    state, sequence = turn.state, count()
    snapshot = turn.response([], None, start)
    yield _event(sequence, {"type": "response.created", "response": snapshot}) + _event(
        sequence, {"type": "response.in_progress", "response": snapshot}
    )
    splitter, parser, builder = _parsers(state, turn.body, start)
    finished = None
    async for batch in stream_requests(state.engine, start.requests, state.metrics):
        events = []
        for item in batch:
            update = item.timed.update
            if update.finished:
                finished = update.output
            events += _feed(splitter, parser, builder, update.new_text or "", update.new_logprobs, finished)
        yield "".join(_event(sequence, e) for e in events)
    response = turn.response(builder.items, finished, start)
    turn.remember(response)
    kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    yield _event(sequence, {"type": kind, "response": response})


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, http_request: HTTPRequest) -> Response:
    state: ServerState = http_request.app.state.server
    stored = state.responses.get(response_id)
    if stored is None:
        raise APIError(404, f"Response with id '{response_id}' not found.", "response_id")
    return JSONResponse(stored.response)
