"""The server's shared state: the engine once loaded, metrics, the prep pool, and the checks every endpoint shares."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from .async_engine import AsyncEngine
from .http_errors import APIError
from .metrics import Metrics
from .prep_pool import SMALL_REQUEST_BYTES, PrepPool
from .reasoning import CLOSE as THINK_CLOSE
from .reasoning import OPEN as THINK_OPEN
from .responses_store import ResponseStore

T = TypeVar("T")


class ServerState:
    def __init__(self, model_name: str, metrics: Metrics, max_sequences_per_request: int = 256):
        self.model_name = model_name
        self.model_names: tuple[str, ...] = (model_name,)  # every name `model` may take, model_name first
        self.metrics = metrics
        self.max_sequences_per_request = max_sequences_per_request
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's event loop, once it runs
        self.engine: AsyncEngine | None = None  # None while the model loads
        self.all_loaded = True  # False until every front end has loaded, with several (app.FrontEndRole)
        self.load_error: BaseException | None = None
        self.created = 0  # unix time the model finished loading
        self.draining = False
        self.incremental_streaming_output = False  # /generate streams: only the new part in each event
        self.stats_task: asyncio.Task | None = None  # the periodic stats line
        self.prep = PrepPool()  # CPU work that grows with a request: parsing, tokenizing, big responses
        self.responses = ResponseStore()  # /v1/responses kept for previous_response_id (bounded: responses_store.py)

    async def prepare(self, http_request, fn: Callable[[], T], always_pooled: bool = False) -> T:
        """fn(): the CPU work of preparing this request, inline on the event loop when its body is small (and the work
        is not always_pooled: unbounded whatever the body's size, as compiling a grammar is), else in the prep pool."""
        size = len(await http_request.body())  # read already: FastAPI parsed it
        if always_pooled:
            size = max(size, SMALL_REQUEST_BYTES)
        return await self.prep.run(fn, size, SMALL_REQUEST_BYTES)

    @property
    def ready(self) -> bool:
        """Loaded, here and in every other front end: requests may be served."""
        return self.engine is not None and self.all_loaded

    @property
    def has_tokenizer(self) -> bool:
        return self.engine.frontend.tokenizer is not None

    @property
    def max_model_len(self) -> int:
        return self.engine.frontend.info.max_model_len

    def check_sequences(self, count: int, param: str = "n", what: str = "prompts x n") -> None:
        """One HTTP request may ask for at most max_sequences_per_request sequences (prompts x n; inputs to embed,
        documents to score)."""
        if count > self.max_sequences_per_request:
            raise APIError(
                400,
                f"this request asks for {count} sequences ({what}); at most "
                f"{self.max_sequences_per_request} are allowed per request",
                param,
            )
        if count < 1:
            raise APIError(400, "the request has no prompt", "prompt" if param == "n" else param)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    def token_ids(self, *tokens: str) -> tuple[int, ...] | None:
        """The ids of these tokens when the tokenizer has every one of them as a token of its own, else None."""
        tokenizer = self.engine.frontend.tokenizer
        if tokenizer is None:
            return None
        ids = tuple(tokenizer.token_id(t) for t in tokens)
        return None if None in ids else ids

    def thinking_tokens(self) -> tuple[int, int] | None:
        """The ids of <think> and </think> when the tokenizer has both (a reasoning model such as Qwen3)."""
        return self.token_ids(THINK_OPEN, THINK_CLOSE)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        kwargs: dict[str, Any],
        tools: list | None = None,
    ) -> str:
        tokenizer = self.engine.frontend.tokenizer
        if tokenizer is None:
            raise APIError(
                400, "this model has no tokenizer, so it cannot chat: use /v1/completions with token ids", "messages"
            )
        reserved = sorted({"messages", "add_generation_prompt", "tools"} & set(kwargs))
        if reserved:
            raise APIError(
                400,
                f"chat_template_kwargs may not set {', '.join(reserved)}: pass them as request fields",
                "chat_template_kwargs",
            )
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tools=tools or None, **kwargs
        )
