"""The frontend's half of every request, shared by the HTTP server and the offline LLM.

In: a prompt (text or token ids) and SamplingParams become a validated EngineRequest: token ids, every default
filled from generation_config.json, checked against the vocabulary, the context length and the KV pool, and a
structured-output spec compiled once in a validator worker process (grammar/validator.py), so that a bad request is
refused here and never reaches the engine. The tokenizer is the one the engine was configured with (EngineInfo).
Out: the engine's token deltas become text. Each request's RequestTracker detokenizes incrementally, matches stop
strings (the engine never sees text: when one matches, the tracker finishes the request and its owner aborts it in
the engine), accumulates logprobs, and produces RequestUpdates for streaming and a RequestOutput at the end.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Annotated

import msgspec

from .engine.messages import EngineInfo, EngineRequest, RequestDelta, TokenLogprobs
from .errors import InvalidRequestError
from .grammar import check_structured, check_tokenizer
from .limits import check_fits, check_prompt_logprobs, check_token_ids
from .pooling import PoolingParams
from .retrieval import rerank_prompt
from .sampling_params import SamplingParams
from .tokenizer import Tokenizer


def _all_token_ids(values) -> bool:
    """Whether every value is an int and none a bool (Frontend.encode's check item by item, where msgspec's one
    pass refused a prompt)."""
    return all(isinstance(t, int) and not isinstance(t, bool) for t in values)


@dataclass
class RequestOutput:
    """A finished request."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens, the EOS or stop token included
    text: str | None  # None when the model has no tokenizer
    finish_reason: str  # "stop", "length", "abort" or "error"
    stop_reason: int | str | None  # the token id or stop string that matched, for finish_reason "stop"
    logprobs: list[TokenLogprobs] | None
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_tokens: int  # prompt tokens whose KV came from the prefix cache
    error: str | None = None  # for finish_reason "error"
    # For params.prompt_logprobs: one per prompt position from params.prompt_logprobs_start on; None for position 0.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # A prefill-only request's result (pooling.py): the normalized embedding, or the score's probabilities.
    pooled: list[float] | None = None


@dataclass
class RequestUpdate:
    """What one step did for one request, as text: for streaming. `output` is set once the request has finished."""

    request_id: int
    new_token_ids: list[int]
    new_text: str | None  # text that can no longer change; may be empty while a character or stop string pends
    new_logprobs: list[TokenLogprobs] | None
    finished: bool
    output: RequestOutput | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # in the first update, when the request asked for them


class RequestTracker:
    """One request as the frontend sees it: what was asked, what came back, and the text made of it."""

    def __init__(self, request: EngineRequest, tokenizer: Tokenizer | None):
        self.request = request
        params = request.params
        self.detokenizer = None
        if tokenizer is not None:
            self.detokenizer = tokenizer.detokenizer(
                params.skip_special_tokens, params.stop, params.include_stop_str_in_output
            )
        self.output_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.num_cached_tokens = 0
        self.first_scheduled_time: float | None = None
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        self.pooled: list[float] | None = None

    @property
    def rid(self) -> int:
        return self.request.rid

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def arrival_time(self) -> float:
        return self.request.arrival_time

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, delta: RequestDelta) -> RequestUpdate | None:
        """Take one engine delta. None if the request had already finished here (a stop string matched, or it was
        aborted, while the engine was still computing it). After a stop string matched, `finished` is True and the
        engine still runs it: the caller aborts it there."""
        if self.finish_reason is not None:  # (finished)
            return None
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.pooled is not None:
            self.pooled = delta.pooled
        if delta.first_scheduled_time is not None:
            self.first_scheduled_time = delta.first_scheduled_time
        params = self.request.params
        new_prompt_logprobs = None
        if delta.prompt_logprobs is not None and self.prompt_logprobs is None:
            # Position 0 has no logprob (nothing precedes it), as in vLLM's prompt_logprobs.
            new_prompt_logprobs = [None] * (params.prompt_logprobs_start == 0) + list(delta.prompt_logprobs)
            self.prompt_logprobs = new_prompt_logprobs
        # (Locals: this loop runs for every token the server streams.)
        output_ids, detokenizer, min_tokens = self.output_ids, self.detokenizer, params.min_tokens
        before = len(output_ids)
        logprobs = self.logprobs if delta.new_logprobs is not None else None
        for i, token in enumerate(delta.new_token_ids):
            output_ids.append(token)
            if logprobs is not None:
                logprobs.append(delta.new_logprobs[i])
            if detokenizer is not None:
                # Stop strings only count once min_tokens tokens are out, as stop tokens do in the engine.
                matched = detokenizer.append(token, check_stop=len(output_ids) > min_tokens)
                if matched is not None and delta.finish_reason != "stop":
                    self.finish_reason, self.stop_reason = "stop", matched
                    break
        if self.finish_reason is None and delta.finish_reason is not None:
            self.finish_reason, self.stop_reason, self.error = delta.finish_reason, delta.stop_reason, delta.error
        taken = len(output_ids) - before  # a stop string may end the output inside a multi-token (speculative) delta
        update = self._update(delta.new_token_ids[:taken], delta.new_logprobs)
        update.prompt_logprobs = new_prompt_logprobs
        return update

    def abort(self, reason: str = "abort", error: str | None = None) -> RequestUpdate | None:
        """Finish it here (the caller aborts it in the engine); None if it had finished already."""
        if self.finished:
            return None
        self.finish_reason, self.error = reason, error
        return self._update([], None)

    def _update(self, new_ids: list[int], new_logprobs: list[TokenLogprobs] | None) -> RequestUpdate:
        finished, detokenizer = self.finish_reason is not None, self.detokenizer
        if finished and detokenizer is not None:
            detokenizer.finish()
        return RequestUpdate(
            request_id=self.request.rid,
            new_token_ids=list(new_ids),
            new_text=detokenizer.take_delta() if detokenizer is not None else None,
            new_logprobs=new_logprobs[: len(new_ids)]
            if new_logprobs is not None and self.logprobs is not None
            else None,
            finished=finished,
            output=self.output() if finished else None,
        )

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.rid,
            prompt_token_ids=self.prompt_ids,
            token_ids=list(self.output_ids),
            text=self.detokenizer.text if self.detokenizer is not None else None,
            finish_reason=self.finish_reason or "abort",
            stop_reason=self.stop_reason,
            logprobs=self.logprobs,
            num_prompt_tokens=self.num_prompt_tokens,
            num_completion_tokens=len(self.output_ids),
            num_cached_tokens=self.num_cached_tokens,
            error=self.error,
            prompt_logprobs=self.prompt_logprobs,
            pooled=self.pooled,
        )


class Frontend:
    """Prompts to validated EngineRequests, for one engine (described by its EngineInfo)."""

    def __init__(self, info: EngineInfo, tokenizer: Tokenizer | None = None, ids: Iterator[int] | None = None):
        """ids: the request ids to give out, in arrival order (default 0, 1, 2, ...; one of several front ends of
        one engine gets its share: engine/messages.py's request_ids)."""
        self.info = info
        self.tokenizer = tokenizer
        self._ids = ids if ids is not None else itertools.count()
        # A prompt of token ids as msgspec checks it in one pass in C: ints, not bools, in the vocabulary (a 32k-token
        # prompt: 0.3 ms, against 1.25 ms for _all_token_ids and check_token_ids, on the way to its first token).
        self._prompt_ids_type = list[Annotated[int, msgspec.Meta(ge=0, lt=info.vocab_size)]]

    @classmethod
    def for_engine(cls, info: EngineInfo, ids: Iterator[int] | None = None) -> Frontend:
        """With the tokenizer the engine was configured with (by default the checkpoint folder's, if it has one)."""
        folder = info.tokenizer or (info.model if os.path.isdir(info.model) else os.path.dirname(info.model))
        return cls(info, Tokenizer.from_folder(folder, info.chat_template) if folder else None, ids)

    def encode(self, prompt: str | list[int], add_special_tokens: bool = False) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "this model has no tokenizer.json: pass prompts as lists of token ids", "prompt"
                )
            # Refused before tokenizing when its length alone says it cannot fit: tokenizing 15 MB took 45 s, only
            # to refuse it then. (A prompt of the whole context is refused too: a request generates at least one token.)
            at_least = self.tokenizer.min_token_count(prompt)
            if at_least >= self.info.max_model_len:
                raise InvalidRequestError(
                    f"this model's maximum context length is {self.info.max_model_len} tokens, but the prompt has "
                    f"{len(prompt)} characters, which make at least {at_least} tokens: shorten the prompt",
                    "prompt",
                )
            return self.tokenizer.encode(prompt, add_special_tokens)
        if isinstance(prompt, (list, tuple)):
            try:
                return msgspec.convert(prompt, self._prompt_ids_type)
            except msgspec.ValidationError:
                pass  # the checks below name what is wrong
        if not isinstance(prompt, (list, tuple)) or not _all_token_ids(prompt):
            raise InvalidRequestError("a prompt is a string or a list of integer token ids", "prompt")
        check_token_ids(list(prompt), self.info.vocab_size, "prompt")
        return list(prompt)

    def prepare(
        self, prompt: str | list[int], params: SamplingParams | None = None
    ) -> tuple[list[int], SamplingParams]:
        """Validate a request without queueing it: (prompt ids, params with every default filled)."""
        if self.info.task == "embed":
            raise InvalidRequestError("this model serves embeddings only (--task embed), not generation", "model")
        ids = self.encode(prompt)
        params = (params or SamplingParams()).with_defaults(self.info.generation_defaults)
        check_token_ids(params.stop_token_ids, self.info.vocab_size, "stop_token_ids")
        if params.prompt_logprobs is not None:
            check_prompt_logprobs(len(ids), params.prompt_logprobs_start, "prompt_logprobs")
        if params.logit_bias:
            check_token_ids(list(params.logit_bias), self.info.vocab_size, "logit_bias")
        if params.structured is not None:
            if self.tokenizer is None:
                raise InvalidRequestError("structured output needs the model's tokenizer.json", params.structured.field)
            info = self.info
            folder = info.tokenizer or (info.model if os.path.isdir(info.model) else os.path.dirname(info.model))
            tokenizer_json = os.path.join(folder, "tokenizer.json") if folder else None
            check_tokenizer(params.structured, tokenizer_json, info.vocab_size, info.generation_defaults.eos_token_ids)
            # A bad schema / regex / grammar is refused here (compiled in a worker process), never queued.
            check_structured(params.structured, tokenizer_json, info.vocab_size, info.generation_defaults.eos_token_ids)
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; this model has none", "stop")
        if self.info.synthetic_speculation:
            for field, value in (("seed", params.seed), ("logprobs", params.logprobs)):
                if value is not None:
                    raise InvalidRequestError(
                        f"{field}: this server runs speculative decoding with synthetic acceptance (a benchmark mode: "
                        "outputs are not the model's), so what sampling guarantees cannot be given",
                        field,
                    )
        if params.max_tokens is None:
            params = replace(params, max_tokens=max(1, self.info.max_model_len - len(ids)))
            if params.min_tokens > params.max_tokens:
                raise InvalidRequestError(
                    f"min_tokens ({params.min_tokens}) exceeds the {params.max_tokens} tokens left in the context",
                    "min_tokens",
                )
        if params.top_k >= self.info.vocab_size:
            # Keeping at least the whole vocabulary keeps every token: the same as off, and in every sampler's range.
            params = replace(params, top_k=0)
        info = self.info
        check_fits(len(ids), params.max_tokens, info.max_model_len, info.page_size, info.num_pages)
        return ids, params

    def new_request(self, prompt: str | list[int], params: SamplingParams | None = None) -> RequestTracker:
        """A validated request and its tracker, not yet sent to the engine. Raises InvalidRequestError."""
        ids, params = self.prepare(prompt, params)
        request = EngineRequest(rid=next(self._ids), prompt_ids=ids, params=params, arrival_time=time.monotonic())
        return RequestTracker(request, self.tokenizer)

    # ---- prefill-only requests (pooling.py, retrieval.py) ---------------------------------------------------

    def new_embedding_request(self, prompt: str | list[int], param: str = "input") -> RequestTracker:
        """Embed a text (tokenized with the tokenizer's own special tokens: Qwen3-Embedding's appends the
        <|endoftext|> it pools) or a list of token ids (as they are). Raises InvalidRequestError naming `param`."""
        return self._pooling_request(prompt, PoolingParams("embed"), param, add_special_tokens=True)

    def new_score_request(
        self, query: str, document: str, instruction: str | None = None, param: str = "documents"
    ) -> RequestTracker:
        """Score a document against a query with Qwen3-Reranker's prompt: the result is [P(yes), P(no)]."""
        if self.tokenizer is None:
            raise InvalidRequestError("scoring needs the model's tokenizer.json", param)
        ids = [self.tokenizer.token_id("yes"), self.tokenizer.token_id("no")]
        if None in ids:
            raise InvalidRequestError('this tokenizer has no single "yes" and "no" tokens to score with', "model")
        return self._pooling_request(rerank_prompt(query, document, instruction), PoolingParams("score", ids), param)

    def _pooling_request(
        self, prompt: str | list[int], pooling: PoolingParams, param: str, add_special_tokens: bool = False
    ) -> RequestTracker:
        try:
            ids = self.encode(prompt, add_special_tokens)
            # It fits the context and the pool as a request that generates one token would (its last position's
            # KV is written too).
            check_fits(len(ids), 1, self.info.max_model_len, self.info.page_size, self.info.num_pages)
        except InvalidRequestError as error:
            raise InvalidRequestError(str(error), param) from None
        params = SamplingParams(max_tokens=1).with_defaults(self.info.generation_defaults)
        request = EngineRequest(next(self._ids), ids, params, time.monotonic(), pooling=pooling)
        return RequestTracker(request, None)
