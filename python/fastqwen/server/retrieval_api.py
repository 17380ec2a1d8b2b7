"""/v1/embeddings (OpenAI's shape) for Qwen3-Embedding; /v1/rerank, /rerank, /v2/rerank (the Cohere/Jina shape vLLM
serves, with SGLang's request fields) and /score (vLLM's text_1 / text_2) for Qwen3-Reranker.

Each input or document is one prefill-only request (pooling.py) in the engine's ordinary steps; one HTTP request
holds at most --max-sequences-per-request of them, like the prompts x n of a completion.
"""

from __future__ import annotations

import base64
import struct
import time
import uuid
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from ..frontend import RequestOutput
from ..retrieval import check_dimensions, truncate_embedding
from .http_errors import APIError, client_closed_response
from .json_body import JsonBodyRoute
from .protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from .serving import collect_requests
from .state import ServerState

router = APIRouter(route_class=JsonBodyRoute)


def _check_task(state: ServerState, task: str, endpoint: str) -> None:
    served = state.engine.frontend.info.task
    if served != task:
        raise APIError(
            400, f"this model serves {served}, not {endpoint} (start the server with --task {task})", "model"
        )


async def _run(state: ServerState, http_request: HTTPRequest, make) -> list[RequestOutput] | None:
    trackers = await state.prepare(http_request, make)
    state.engine.enqueue(trackers)
    outputs = await collect_requests(state.engine, trackers, state.metrics, http_request)
    if outputs is None:
        return None
    failed = next((o for o in outputs if o.pooled is None), None)
    if failed is not None:
        raise APIError(500, f"the engine could not compute this request: {failed.error or failed.finish_reason}")
    return outputs


def _base64(vector: list[float]) -> str:
    """OpenAI's base64 encoding: the float32 values, little-endian."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, http_request: HTTPRequest) -> Response:
    state: ServerState = http_request.app.state.server
    state.check_model(body.model)
    body.check_refused()
    _check_task(state, "embed", "embeddings")
    frontend = state.engine.frontend
    check_dimensions(body.dimensions, frontend.info.hidden_size)
    inputs = body.inputs()
    state.check_sequences(len(inputs), "input", "inputs")

    def make() -> list:
        return [frontend.new_embedding_request(i, "input") for i in inputs]

    outputs = await _run(state, http_request, make)
    if outputs is None:
        return client_closed_response()
    data = []
    for index, output in enumerate(outputs):
        vector = truncate_embedding(output.pooled, body.dimensions)
        embedding = _base64(vector) if body.encoding_format == "base64" else vector
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    tokens = sum(o.num_prompt_tokens for o in outputs)
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "model": state.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


async def _scores(state: ServerState, http_request: HTTPRequest, pairs: list[tuple[str, str]], instruction, param):
    _check_task(state, "score", "scores")
    state.check_sequences(len(pairs), param, param)
    frontend = state.engine.frontend

    def make() -> list:
        return [frontend.new_score_request(q, d, instruction, param) for q, d in pairs]

    return await _run(state, http_request, make)


async def _rerank(body: RerankRequest, http_request: HTTPRequest) -> Response:
    state: ServerState = http_request.app.state.server
    state.check_model(body.model)
    body.check_refused()
    documents = body.document_texts()
    top_n = body.checked_top_n(len(documents))
    outputs = await _scores(
        state, http_request, [(body.query, d) for d in documents], body.instruction_text(), "documents"
    )
    if outputs is None:
        return client_closed_response()
    order = sorted(range(len(documents)), key=lambda i: -outputs[i].pooled[0])[:top_n]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": outputs[i].pooled[0]}
        if body.return_documents:
            result["document"] = {"text": documents[i]}
        results.append(result)
    tokens = sum(o.num_prompt_tokens for o in outputs)
    return JSONResponse(
        {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": state.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "results": results,
        }
    )


for _path in ("/v1/rerank", "/rerank", "/v2/rerank"):
    router.add_api_route(_path, _rerank, methods=["POST"])


@router.post("/score")
@router.post("/v1/score")
async def score(body: ScoreRequest, http_request: HTTPRequest) -> Response:
    state: ServerState = http_request.app.state.server
    state.check_model(body.model)
    body.check_refused()
    pairs = body.pairs()
    outputs = await _scores(state, http_request, pairs, body.instruction_text(), "text_2")
    if outputs is None:
        return client_closed_response()
    tokens = sum(o.num_prompt_tokens for o in outputs)
    return JSONResponse(
        {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": state.model_name,
            "data": [{"index": i, "object": "score", "score": o.pooled[0]} for i, o in enumerate(outputs)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )
