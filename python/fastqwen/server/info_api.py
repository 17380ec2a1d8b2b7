"""The small endpoints clients of vLLM and SGLang expect beside generation: one model's card (/v1/models/{id}),
/tokenize and /detokenize in vLLM's shapes (prompts and chat messages), /version, SGLang's /server_info
(alias /get_server_info), and the load report gateways poll (/v1/loads, alias /get_loads)."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi import Request as HTTPRequest
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from .. import __version__
from ..limits import check_token_ids
from .http_errors import APIError
from .json_body import JsonBodyRoute
from .protocol import MESSAGE_SCHEMA, TOKEN_ID_SCHEMA, exactly_one_of
from .state import ServerState
from .tools import check_tools, messages_for_template

router = APIRouter(route_class=JsonBodyRoute)  # big bodies are parsed off the event loop


def model_card(state: ServerState, name: str | None = None) -> dict[str, Any]:
    """The model under `name` (one of its served names; the primary one by default)."""
    return {
        "id": name or state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "fastqwen",
        "root": state.model_name,
        "parent": None,
        "max_model_len": state.max_model_len,
    }


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, http_request: HTTPRequest) -> dict[str, Any]:
    state: ServerState = http_request.app.state.server
    if model_id not in state.model_names:
        raise APIError(404, f"The model `{model_id}` does not exist.", "model")
    return model_card(state, model_id)


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered through the chat template first."""

    model_config = ConfigDict(extra="allow", json_schema_extra=exactly_one_of("prompt", "messages"))
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = Field(
        None, json_schema_extra={"anyOf": [{"type": "array", "minItems": 1, "items": MESSAGE_SCHEMA}, {"type": "null"}]}
    )
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool = False  # Qwen3's tokenizer adds none either way
    return_token_strs: bool = False


def _token_id(value: Any) -> Any:
    """A JSON integer (1.0 is one, by JSON Schema) and nothing else: true and "1" are not token 1."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("a token id is an integer")
    return value


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[Annotated[int, BeforeValidator(_token_id)]] = Field(
        json_schema_extra={"type": "array", "items": TOKEN_ID_SCHEMA}
    )


def _tokenizer(state: ServerState):
    if not state.has_tokenizer:
        raise APIError(400, "this model has no tokenizer.json", None)
    return state.engine.frontend.tokenizer


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, http_request: HTTPRequest) -> dict[str, Any]:
    state: ServerState = http_request.app.state.server
    state.check_model(body.model)
    tokenizer = _tokenizer(state)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", "prompt")

    def run() -> list[int]:
        text = body.prompt
        if body.messages is not None:
            choice = check_tools(body.tools, None)
            text = state.render_chat(
                messages_for_template(body.messages),
                body.add_generation_prompt,
                body.chat_template_kwargs or {},
                body.tools if choice else None,
            )
        return tokenizer.encode(text)

    def run_with_strs() -> tuple[list[int], list[str] | None]:
        ids = run()
        return ids, [tokenizer.token_text(t) for t in ids] if body.return_token_strs else None

    ids, strs = await state.prepare(http_request, run_with_strs)  # CPU work proportional to the prompt
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": strs}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, http_request: HTTPRequest) -> dict[str, Any]:
    state: ServerState = http_request.app.state.server
    state.check_model(body.model)
    tokenizer = _tokenizer(state)

    def run() -> str:
        check_token_ids(body.tokens, state.engine.frontend.info.vocab_size, "tokens")
        return tokenizer.decode(body.tokens, False)

    return {"prompt": await state.prepare(http_request, run)}


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(http_request: HTTPRequest) -> dict[str, Any]:
    """SGLang's server information: what the engine was started with and where it stands."""
    state: ServerState = http_request.app.state.server
    info = state.engine.frontend.info
    defaults = dataclasses.asdict(info.generation_defaults)
    return {
        "version": __version__,
        "model_path": info.model,
        "served_model_name": state.model_name,
        "context_length": info.max_model_len,
        "vocab_size": info.vocab_size,
        "page_size": info.page_size,
        "max_total_num_tokens": info.num_pages * info.page_size,
        "dtype": info.dtype,
        "device": info.device,
        "disable_radix_cache": not info.prefix_caching,
        "kv_cache_bytes": info.kv_bytes,
        "default_sampling_params": defaults,
        # One entry per data-parallel replica, as SGLang lists its DP ranks.
        "internal_states": [dataclasses.asdict(stats) for _, stats in state.engine.client.per_engine()],
    }


# The sections of SGLang's load report; fastqwen fills `core` and leaves the others out (a reader takes them as absent).
LOAD_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")


@router.get("/v1/loads")
@router.get("/get_loads")
async def loads(http_request: HTTPRequest, include: str = Query("core")) -> dict[str, Any]:
    """The scheduler's load in the shape SGLang serves and SMG's load monitor polls (`?include=core,...`): one entry
    per data-parallel rank (--data-parallel-size), with the queue, the running requests and the KV pages in use."""
    unknown = [s for s in (part.strip() for part in include.split(",")) if s and s not in LOAD_SECTIONS]
    if unknown:
        raise APIError(400, f"include: unknown section {unknown[0]!r}; known: {', '.join(LOAD_SECTIONS)}", "include")
    state: ServerState = http_request.app.state.server
    totals = state.metrics.totals
    # Since the server started (SGLang's is recent): prompt tokens found in the prefix cache / looked up.
    hit_rate = totals.prefix_hits / totals.prefix_queries if totals.prefix_queries else 0.0
    ranks = []
    for index, (info, stats) in enumerate(state.engine.client.per_engine()):
        ranks.append(
            {
                "dp_rank": index,
                "num_running_reqs": stats.num_running,
                "num_waiting_reqs": stats.num_waiting,
                "num_total_reqs": stats.num_running + stats.num_waiting,
                "num_used_tokens": round(stats.kv_usage * info.num_pages) * info.page_size,
                "max_total_num_tokens": info.num_pages * info.page_size,
                "token_usage": stats.kv_usage,
                "cache_hit_rate": hit_rate,
            }
        )
    timestamp = datetime.datetime.now(datetime.timezone.utc).isoformat()
    return {"timestamp": timestamp, "dp_rank_count": len(ranks), "loads": ranks}
