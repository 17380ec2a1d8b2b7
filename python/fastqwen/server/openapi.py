"""The OpenAPI document, made to say what the server really returns: FastAPI's own lists a 422 it never sends (the
server answers 400), none of its errors, no authentication, and /metrics as JSON.

Here: every error response in OpenAI's shape (ErrorResponse) under the statuses the route can give, the bearer
scheme on the routes behind the API key, the success bodies (models below, for documentation only: the routes build
their JSON themselves), text/event-stream beside JSON where a route streams, and /metrics as Prometheus text.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from .guard import PUBLIC_PATHS


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatMessage(BaseModel):
    role: str
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = []


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class GenerateResponse(BaseModel):
    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]


class ModelCard(BaseModel):
    id: str
    object: str
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int


class ResponseObject(BaseModel):
    """/v1/responses' answer (its items follow OpenAI's Responses types)."""

    id: str
    object: str
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None


class ModelList(BaseModel):
    object: str
    data: list[ModelCard]


class Health(BaseModel):
    status: str
    error: str | None = None


_SUCCESS = {  # (path, method) -> the 200 body's model, and whether the route can stream
    ("/v1/completions", "post"): (CompletionResponse, True),
    ("/v1/chat/completions", "post"): (ChatCompletionResponse, True),
    ("/generate", "post"): (GenerateResponse | list[GenerateResponse], True),
    ("/v1/responses", "post"): (ResponseObject, True),
    ("/v1/responses/{response_id}", "get"): (ResponseObject, False),
    ("/v1/models", "get"): (ModelList, False),
    ("/v1/models/{model_id}", "get"): (ModelCard, False),
    ("/health", "get"): (Health, False),
}
# One server-sent event: `data` is a JSON chunk, an error object, or [DONE] last.
_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
}
_ERROR_STATUSES = {
    "post": {
        "400": "invalid request",
        "401": "missing or wrong API key",
        "404": "unknown model or previous_response_id",
        "413": "request body too large",
        "500": "the engine failed while running the request",
        "503": "loading, shutting down, queue full or engine dead",
    },
    "get": {
        "401": "missing or wrong API key",
        "404": "unknown model or stored response",
        "503": "loading, shutting down or engine dead",
    },
}


def _schema_of(model, components: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of a model (or a union of models), its definitions moved into components."""
    from pydantic import TypeAdapter

    schema = TypeAdapter(model).json_schema(ref_template="#/components/schemas/{model}")
    components.update(schema.pop("$defs", {}))
    if "title" in schema and "properties" in schema:  # a model of its own: refer to it
        components[schema["title"]] = schema
        return {"$ref": f"#/components/schemas/{schema['title']}"}
    return schema


def build_openapi(app: FastAPI, api_key: bool) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    error_ref = _schema_of(ErrorResponse, components)
    doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, operations in doc.get("paths", {}).items():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            success = _SUCCESS.get((path, method))
            if success is not None:
                model, streams = success
                content = {"application/json": {"schema": _schema_of(model, components)}}
                if streams:
                    content["text/event-stream"] = {"schema": _SSE_EVENT}
                responses["200"] = {"description": "OK", "content": content}
            if path == "/metrics":
                responses["200"] = {
                    "description": "Prometheus metrics",
                    "content": {"text/plain": {"schema": {"type": "string"}}},
                }
                continue
            if path in PUBLIC_PATHS:
                if path == "/health":
                    responses["503"] = {
                        "description": "not ready: loading, failed, engine dead or shutting down",
                        "content": {"application/json": {"schema": _schema_of(Health, components)}},
                    }
                continue
            for status, description in _ERROR_STATUSES.get(method, {}).items():
                if status == "401" and not api_key:
                    continue
                responses[status] = {"description": description, "content": {"application/json": {"schema": error_ref}}}
            if method == "get" and any(p.get("in") == "query" for p in operation.get("parameters", [])):
                responses["400"] = {
                    "description": "invalid query parameter",
                    "content": {"application/json": {"schema": error_ref}},
                }
            if path == "/v1/models/{model_id}":
                responses["404"] = {
                    "description": "unknown model",
                    "content": {"application/json": {"schema": error_ref}},
                }
            if api_key:
                operation["security"] = [{"bearer": []}]
    return doc


def _bound_token_ids(node: Any, vocab_size: int | None) -> None:
    """Token ids (marked x-token-id by protocol.py) get the vocabulary's last id as their maximum, once it is known."""
    if isinstance(node, dict):
        if node.pop("x-token-id", False) and vocab_size is not None:
            node["maximum"] = vocab_size - 1
        for value in node.values():
            _bound_token_ids(value, vocab_size)
    elif isinstance(node, list):
        for value in node:
            _bound_token_ids(value, vocab_size)


def install_openapi(app: FastAPI, api_key: bool) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            engine = app.state.server.engine
            doc = build_openapi(app, api_key)
            _bound_token_ids(doc, engine.frontend.info.vocab_size if engine is not None else None)
            if engine is None:
                return doc  # not kept: the vocabulary is known once the model has loaded
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
