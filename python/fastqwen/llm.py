"""The offline API: LLM(model=...).generate(prompts, sampling_params)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from .config import ConfigError, EngineConfig
from .errors import InvalidRequestError
from .frontend import Frontend, RequestOutput, RequestTracker, RequestUpdate
from .sampling_params import SamplingParams
from .tokenizer import Tokenizer

Prompt = str | list[int]


class LLM:
    """A Qwen3 model with its own scheduler and KV cache, for batch generation driven from this process (the engine
    runs here; with tensor_parallel_size > 1, ranks 1..N-1 in child processes).

    model: a checkpoint folder (config.json, safetensors, tokenizer.json), a Hugging Face hub id (the local cache
    first, downloaded when missing; model_source.py), a config.json path, or a preset name (Qwen3-0.6B ... Qwen3-32B)
    with load_format="dummy" for random weights of the real shapes. Or a whole EngineConfig.
    """

    def __init__(self, model: str | EngineConfig, **knobs):
        """knobs: any field of config.EngineConfig, by keyword (the list below is generated from it).

        tensor_parallel_size=N: the model split across N GPUs (or N CPU processes), this process being rank 0;
        close() stops the other ranks (they also end with this process). data_parallel_size above 1 is refused
        (ConfigError): data parallelism is the server's (`fastqwen serve --dp N`); here one engine runs. So is
        api_server_count above 1 (the server's HTTP front-end processes).

        Knobs:
        """
        from .engine.factory import make_engine  # here: `import fastqwen` must not load the engine and torch

        config = EngineConfig.build(model, **knobs)
        # (api_server_count defaults to data_parallel_size: a data_parallel_size above 1 is refused as such, below)
        if config.api_server_count > 1 and config.data_parallel_size == 1:
            raise ConfigError(
                f"api_server_count={config.api_server_count}: HTTP front-end processes are the server's "
                "(python -m fastqwen.serve --api-server-count N); LLM has none",
                "api_server_count",
            )
        self.engine = make_engine(config)
        self.frontend = Frontend.for_engine(self.engine.info)
        self._trackers: dict[int, RequestTracker] = {}  # requests queued and not finished

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.frontend.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string or a list of token ids); outputs come back in prompt order.

        All prompts are validated before any is queued, so a bad one raises InvalidRequestError and nothing runs.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise InvalidRequestError(
                    f"{len(params_list)} sampling_params for {len(prompts)} prompts", "sampling_params"
                )
        trackers = [self.frontend.new_request(p, sp) for p, sp in zip(prompts, params_list)]  # all validated first
        for tracker in trackers:
            self._add(tracker)
        bar = tqdm(total=len(trackers), desc="generate", unit="req", disable=not use_tqdm or len(trackers) < 2)
        progress = _Throughput(bar, {t.rid: t.num_prompt_tokens for t in trackers})
        try:
            while self.engine.has_unfinished():
                progress.update(self.step())
        except BaseException:
            for tracker in trackers:
                self.abort(tracker.rid)
            raise
        finally:
            bar.close()
        return [t.output() for t in trackers]

    # ---- prefill-only requests: Qwen3-Embedding and Qwen3-Reranker (pooling.py) ----------------------------

    def embed(self, prompts: Prompt | Sequence[Prompt], dimensions: int | None = None) -> list[list[float]]:
        """The embedding of every prompt (a text, tokenized with the tokenizer's special tokens, or a list of token
        ids), in prompt order: the last position's final hidden state, L2-normalized; `dimensions` keeps the first
        that many values, normalized again. Needs an engine of task embed."""
        from .retrieval import check_dimensions, truncate_embedding

        check_dimensions(dimensions, self.frontend.info.hidden_size)
        prompts = self._prompt_list(prompts)
        outputs = self._run_all([self.frontend.new_embedding_request(p, "prompts") for p in prompts])
        return [truncate_embedding(o.pooled, dimensions) for o in outputs]

    def score(self, query: str, documents: str | Sequence[str], instruction: str | None = None) -> list[float]:
        """Qwen3-Reranker's relevance of each document to the query (P("yes") with Qwen's prompt), in document
        order. Needs an engine of task score."""
        documents = [documents] if isinstance(documents, str) else list(documents)
        trackers = [self.frontend.new_score_request(query, d, instruction) for d in documents]
        return [o.pooled[0] for o in self._run_all(trackers)]

    @staticmethod
    def _prompt_list(prompts) -> list:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            return [prompts]
        return list(prompts)

    def _run_all(self, trackers: list[RequestTracker]) -> list[RequestOutput]:
        """Queue validated requests, step until they are done, and raise for one that failed."""
        for tracker in trackers:
            self._add(tracker)
        try:
            while any(not t.finished for t in trackers) and self.engine.has_unfinished():
                self.step()
        except BaseException:
            for tracker in trackers:
                self.abort(tracker.rid)
            raise
        outputs = [t.output() for t in trackers]
        failed = next((o for o in outputs if o.pooled is None), None)
        if failed is not None:
            raise RuntimeError(f"a request ended with {failed.finish_reason}: {failed.error}")
        return outputs

    # ---- step by step, for streaming ----------------------------------------------------------------------

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> int:
        """Validate and queue one request; returns its id. step() then reports its progress."""
        tracker = self.frontend.new_request(prompt, params)
        self._add(tracker)
        return tracker.rid

    def step(self) -> list[RequestUpdate]:
        """One engine step: an update (new tokens and text) for every request that advanced or finished."""
        updates = []
        for delta in self.engine.step().deltas:
            tracker = self._trackers.get(delta.rid)
            update = tracker.apply(delta) if tracker is not None else None
            if update is None:
                continue
            if update.finished:
                del self._trackers[delta.rid]
                if not delta.finished:  # a stop string matched: the engine is still running it
                    self.engine.abort(delta.rid)
            updates.append(update)
        return updates

    def abort(self, rid: int) -> bool:
        """Stop a request; its pages are released at once. False if it is unknown or finished."""
        tracker = self._trackers.pop(rid, None)
        if tracker is not None:
            tracker.abort()
        return self.engine.abort(rid)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def close(self) -> None:
        """Stop the engine's other processes (tensor parallelism); the LLM cannot generate afterwards."""
        self.engine.close()

    def _add(self, tracker: RequestTracker) -> None:
        self.engine.add(tracker.request)
        self._trackers[tracker.rid] = tracker

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or to several.

        The prompt is the chat template (the tokenizer's, or EngineConfig.chat_template) with the generation prompt
        added; chat_template_kwargs go to the template (for Qwen3, {"enable_thinking": False} turns thinking off).
        """
        tokenizer = self.frontend.tokenizer
        if tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer.json, so it cannot chat", "messages")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            tokenizer.apply_chat_template(conv, add_generation_prompt=True, **(chat_template_kwargs or {}))
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


# LLM(...)'s knob list, generated from EngineConfig's fields: a knob added there is documented here (not under -OO).
if LLM.__init__.__doc__:
    LLM.__init__.__doc__ = LLM.__init__.__doc__.rstrip() + "\n" + EngineConfig.knob_docs(indent=8) + "\n"


class _Throughput:
    """The progress bar's postfix: prompt and output tokens per second of the requests finished so far (prompt
    tokens count once their request has produced its first update)."""

    _EVERY_S = 0.5  # how often the postfix is rewritten

    def __init__(self, bar: tqdm, prompt_lengths: dict[int, int]):
        self.bar = bar
        self.started = time.monotonic()
        self.shown = self.started
        self.prompt_tokens = 0
        self.output_tokens = 0
        self._unstarted = dict(prompt_lengths)  # request id -> prompt tokens, until its first token

    def update(self, updates: list[RequestUpdate]) -> None:
        finished = 0
        for update in updates:
            self.output_tokens += len(update.new_token_ids)
            self.prompt_tokens += self._unstarted.pop(update.request_id, 0)
            finished += update.finished
        if self.bar.disable:
            return
        now = time.monotonic()
        if now - self.shown >= self._EVERY_S or finished:
            self.shown = now
            elapsed = max(now - self.started, 1e-9)
            self.bar.set_postfix_str(
                f"in: {self.prompt_tokens / elapsed:,.0f} tok/s, out: {self.output_tokens / elapsed:,.0f} tok/s",
                refresh=False,
            )
        self.bar.update(finished)
