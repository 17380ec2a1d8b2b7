"""Request bodies of the HTTP API (pydantic), and their translation to SamplingParams.

Unknown fields are accepted and ignored, as OpenAI clients and benchmark tools send extras. Range checks live in
SamplingParams, so the server and the offline API reject exactly the same things with the same messages.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..errors import InvalidRequestError
from ..sampling_params import MAX_LOGPROBS, SamplingParams


# What a chat message looks like, for the OpenAPI document (validation is the chat template's: normalize_messages).
_MESSAGE_SCHEMA = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "user", "assistant", "tool"]},
        "content": {"anyOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": "object", "required": ["type", "text"],
                                        "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}},
            {"type": "null"},
        ]},
    },
}  # fmt: skip


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Lenient):
    include_usage: bool = False


class _SamplingFields(_Lenient):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def check_common(self) -> None:
        if self.n < 1 or self.n > 128:
            raise InvalidRequestError(f"n must be in [1, 128], not {self.n}", "n")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", "stream_options")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, choice: int) -> SamplingParams:
        seed = self.seed
        if seed is not None and choice > 0:
            # Each of the n choices draws differently, and reproducibly.
            seed = (seed ^ (choice * 0x9E3779B97F4A7C15)) & (2**63 - 1)
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            seed=seed,
            logprobs=logprobs,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)

    def to_sampling_params(self, choice: int = 0) -> SamplingParams:
        self.check_common()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be in [0, {MAX_LOGPROBS}], not {self.logprobs}", "logprobs")
        return self.sampling_params(self.max_tokens, self.logprobs, choice)


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]] = Field(json_schema_extra={"items": _MESSAGE_SCHEMA})
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    def to_sampling_params(self, choice: int = 0) -> SamplingParams:
        self.check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs set to true", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling_params(max_tokens, logprobs, choice)


class GenerateSamplingParams(_Lenient):
    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None


class GenerateRequest(_Lenient):
    """SGLang's native /generate."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    stream: bool = False
    rid: str | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0

    def prompts(self) -> tuple[list[str | list[int]], bool]:
        """(prompts, batched)."""
        if (self.text is None) == (self.input_ids is None):
            raise InvalidRequestError("give exactly one of text and input_ids", "text")
        if self.text is not None:
            return ([self.text], False) if isinstance(self.text, str) else (list(self.text), True)
        ids = self.input_ids
        if ids and all(isinstance(x, list) for x in ids):
            return list(ids), True
        return [list(ids)], False

    def to_sampling_params(self) -> SamplingParams:
        sp = self.sampling_params
        return SamplingParams(
            temperature=sp.temperature,
            top_k=sp.top_k,
            top_p=sp.top_p,
            min_p=sp.min_p,
            repetition_penalty=sp.repetition_penalty,
            presence_penalty=sp.presence_penalty,
            frequency_penalty=sp.frequency_penalty,
            seed=sp.sampling_seed,
            logprobs=self.top_logprobs_num if self.return_logprob else None,
            max_tokens=sp.max_new_tokens,
            min_tokens=sp.min_new_tokens,
            ignore_eos=sp.ignore_eos,
            stop=sp.stop,
            stop_token_ids=sp.stop_token_ids,
            skip_special_tokens=sp.skip_special_tokens,
            include_stop_str_in_output=sp.no_stop_trim,
        )

