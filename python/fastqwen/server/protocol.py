"""Request bodies of the HTTP API (pydantic), and their translation to SamplingParams.

Unknown fields are accepted and ignored, as OpenAI clients and benchmark tools send extras. Range checks live in
SamplingParams, so the server and the offline API reject exactly the same things with the same messages.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..errors import InvalidRequestError
from ..sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutput
from .responses_encrypted import INCLUDE_NAME as ENCRYPTED_REASONING
from .responses_logprobs import INCLUDE_NAME as OUTPUT_LOGPROBS
from .responses_tools import ToolCatalog, tool_catalog

# What a chat message looks like, for the OpenAPI document (validation is the chat template's: normalize_messages).
MESSAGE_SCHEMA = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "user", "assistant", "tool"]},
        "content": {
            "anyOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["type", "text"],
                        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                    },
                },
                {"type": "null"},
            ]
        },
    },
}


# What is refused, stated in the OpenAPI document, so that a body valid by the document is accepted (schemathesis'
# ST202). These only describe: validation stays in the code, with its own messages. openapi.py fills in a token id's
# maximum (the vocabulary size - 1) once the model is loaded, where it finds the x-token-id marker.
TOKEN_ID_SCHEMA = {"type": "integer", "minimum": 0, "x-token-id": True}
_TOKEN_IDS = {"type": "array", "minItems": 1, "items": TOKEN_ID_SCHEMA}
_TEXT = {"type": "string", "minLength": 1}
_TEXTS = {"type": "array", "minItems": 1, "items": _TEXT}
_NULL = {"type": "null"}
_PROMPT_SCHEMA = {"anyOf": [_TEXT, _TEXTS, _TOKEN_IDS, {"type": "array", "minItems": 1, "items": _TOKEN_IDS}]}
_STOP_TOKEN_IDS_SCHEMA = {"anyOf": [{"type": "array", "items": TOKEN_ID_SCHEMA}, _NULL]}


def exactly_one_of(a: str, b: str) -> dict[str, Any]:
    """A model's schema extra: one of the fields a and b is given (and not null), never both."""

    def given(name: str) -> dict[str, Any]:
        return {"required": [name], "properties": {name: {"not": {"type": "null"}}}}

    return {"oneOf": [given(a), given(b)]}


def _described(schema: dict[str, Any], **kwargs) -> Any:
    """A field whose OpenAPI schema is `schema` (replacing the one pydantic derives from its type)."""
    return Field(json_schema_extra=schema, **kwargs)


def _prompts(value: Any, field: str) -> list:
    """A prompt (a string or a list of token ids) or a list of prompts, as a list of prompts. Only the shape is checked
    here: this runs on the event loop, and a body may hold millions of ids."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise InvalidRequestError(f"{field} must be a string, a list of token ids, or a list of those", field)
    if not value:
        raise InvalidRequestError("the prompt is empty", field)
    if type(value[0]) is int:  # one prompt of token ids (the frontend refuses it unless every item is one)
        return [value]
    return list(value)


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")

    # Fields other servers accept that would change the result here and are not implemented: a request that sets
    # one (to anything but its neutral value) gets a 400 naming it, never a result that ignored it.
    # name -> (is it set?, why it is refused)
    _REFUSED: dict = {}

    def check_refused(self) -> None:
        extra = self.model_extra or {}
        for name, (is_set, why) in self._REFUSED.items():
            value = extra.get(name, getattr(self, name, None))
            if value is not None and is_set(value):
                raise InvalidRequestError(f"{name} is not supported: {why}", name)


def _truthy(value) -> bool:
    return bool(value)


def _not_one(value) -> bool:
    return value != 1


_NOT_IMPLEMENTED = "this server does not implement it"
# Refused by every OpenAI-style endpoint.
_REFUSED_SAMPLING = {
    "use_beam_search": (_truthy, "beam search is not implemented"),
    "length_penalty": (_not_one, "it only applies to beam search, which is not implemented"),
    "truncate_prompt_tokens": (_truthy, "prompts are never truncated; shorten the prompt"),
    "allowed_token_ids": (_truthy, _NOT_IMPLEMENTED),
    "bad_words": (_truthy, _NOT_IMPLEMENTED),
    "stop_regex": (_truthy, _NOT_IMPLEMENTED),
    "lora_request": (_truthy, "LoRA adapters are not supported"),
    "priority": (_truthy, "requests are served in arrival order"),
}


class StreamOptions(_Lenient):
    include_usage: bool = False  # a last chunk with the usage of the whole request
    continuous_usage_stats: bool = False  # vLLM's (guidellm always sends it): each chunk has its choice's usage so far


def _schema_text(value: Any, field: str) -> str:
    """A JSON schema given as an object or as JSON text, as text."""
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, bool)):
        return json.dumps(value, ensure_ascii=False)
    raise InvalidRequestError("a JSON schema must be an object or a JSON string", field)


def _choices_text(value: Any, field: str) -> str:
    if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
        raise InvalidRequestError("the choices must be a list of strings", field)
    return json.dumps(value, ensure_ascii=False)


def _response_format(value: dict[str, Any]) -> StructuredOutput | None:
    """OpenAI's response_format: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema":
    {"name": ..., "schema": {...}, "strict": bool}} (strict false: schema keywords the compiler lacks are ignored)."""
    kind = value.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutput("json_object", field="response_format")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise InvalidRequestError(
                'response_format.json_schema must be {"name": ..., "schema": {...}}', "response_format"
            )
        return StructuredOutput(
            "json_schema",
            _schema_text(spec["schema"], "response_format"),
            strict=bool(spec.get("strict") or False),
            field="response_format",
        )
    raise InvalidRequestError(
        f'response_format.type must be "text", "json_object" or "json_schema", not {kind!r}', "response_format"
    )


# vLLM's structured_outputs object: key -> kind of StructuredOutput.
_STRUCTURED_OUTPUTS_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def _structured_outputs(value: dict[str, Any]) -> StructuredOutput | None:
    given = [
        k for k in (*_STRUCTURED_OUTPUTS_KEYS, "json_object", "structural_tag") if value.get(k) not in (None, False)
    ]
    if not given:
        return None
    if len(given) > 1:
        raise InvalidRequestError(
            f"structured_outputs takes one constraint, not {', '.join(given)}", "structured_outputs"
        )
    key = given[0]
    if key == "structural_tag":
        raise InvalidRequestError("structured_outputs.structural_tag is not supported", "structured_outputs")
    if key == "json_object":
        return StructuredOutput("json_object", field="structured_outputs")
    v = value[key]
    text = (
        _schema_text(v, "structured_outputs")
        if key == "json"
        else _choices_text(v, "structured_outputs")
        if key == "choice"
        else v
    )
    if not isinstance(text, str):
        raise InvalidRequestError(f"structured_outputs.{key} must be a string", "structured_outputs")
    return StructuredOutput(_STRUCTURED_OUTPUTS_KEYS[key], text, field="structured_outputs")


def only_one(candidates: list[StructuredOutput | None]) -> StructuredOutput | None:
    given = [c for c in candidates if c is not None]
    if len(given) > 1:
        raise InvalidRequestError(
            f"give one output constraint, not several ({', '.join(c.field for c in given)})", given[1].field
        )
    return given[0] if given else None


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
    stop_token_ids: list[int] | None = _described(_STOP_TOKEN_IDS_SCHEMA, default=None)
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    # Structured output: OpenAI's response_format, vLLM's guided_* extras and its newer structured_outputs object.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = _described({"anyOf": [_TEXTS, _NULL]}, default=None)
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    def structured(self) -> StructuredOutput | None:
        """The request's output constraint, from whichever field gave it (more than one is refused)."""
        return only_one(
            [
                _response_format(self.response_format) if self.response_format else None,
                StructuredOutput("json_schema", _schema_text(self.guided_json, "guided_json"), field="guided_json")
                if self.guided_json is not None
                else None,
                StructuredOutput("regex", self.guided_regex, field="guided_regex")
                if self.guided_regex is not None
                else None,
                StructuredOutput("choice", _choices_text(self.guided_choice, "guided_choice"), field="guided_choice")
                if self.guided_choice is not None
                else None,
                StructuredOutput("grammar", self.guided_grammar, field="guided_grammar")
                if self.guided_grammar is not None
                else None,
                _structured_outputs(self.structured_outputs) if self.structured_outputs else None,
            ]
        )

    prompt_logprobs: int | None = None  # vLLM's: logprobs of the prompt tokens, with this many alternatives
    return_tokens_as_token_ids: bool = False  # vLLM's: tokens in logprobs as "token_id:N"

    def check_common(self) -> None:
        if self.n < 1 or self.n > 128:
            raise InvalidRequestError(f"n must be in [1, 128], not {self.n}", "n")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", "stream_options")
        if self.stream_options is not None:
            self.stream_options.check_refused()
        self.check_refused()
        best_of = (self.model_extra or {}).get("best_of")
        if best_of is not None and best_of != 1:
            raise InvalidRequestError(
                "best_of is not supported (vLLM's current engine dropped it too): ask for n choices and pick", "best_of"
            )
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequestError("prompt_logprobs cannot be streamed: ask without stream", "prompt_logprobs")

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, choice: int, prompt_logprobs: int | None = None
    ) -> SamplingParams:
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
            prompt_logprobs=prompt_logprobs if prompt_logprobs is not None else self.prompt_logprobs,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self.logit_bias,
            structured=self.structured(),
        )


class CompletionRequest(_SamplingFields):
    # Any: checked by prompts() and the frontend. Pydantic's check of the union took 1.9 s on a 17 MB list of ids.
    prompt: Any = _described(_PROMPT_SCHEMA)
    max_tokens: int | None = 16  # 0: no new tokens, the prompt only (lm-eval's loglikelihood sends it with echo)
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    _REFUSED = {**_REFUSED_SAMPLING, "suffix": (_truthy, "Qwen3 has no fill-in-the-middle format")}

    @property
    def prompt_only(self) -> bool:
        return self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a string or a list of token ids: their items are checked by the frontend, off the event
        loop (a prompt of anything else is refused there)."""
        return _prompts(self.prompt, "prompt")

    def to_sampling_params(self, choice: int = 0) -> SamplingParams:
        self.check_common()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be in [0, {MAX_LOGPROBS}], not {self.logprobs}", "logprobs")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise InvalidRequestError(f"max_tokens must be at least 0, not {self.max_tokens}", "max_tokens")
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:  # echo's logprobs cover the prompt too
            prompt_logprobs = max(self.logprobs, prompt_logprobs or 0)
        # max_tokens 0: the engine prefills (and samples one token, dropped by the endpoint).
        max_tokens = 1 if self.prompt_only else self.max_tokens
        return self.sampling_params(max_tokens, self.logprobs, choice, prompt_logprobs)


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]] = _described({"type": "array", "minItems": 1, "items": MESSAGE_SCHEMA})
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    _REFUSED = {
        **_REFUSED_SAMPLING,
        "functions": (_truthy, "the legacy functions field is not supported: pass tools"),
        "function_call": (_truthy, "the legacy function_call field is not supported: pass tool_choice"),
        "echo": (_truthy, "chat completions do not echo the prompt"),
        "continue_final_message": (_truthy, _NOT_IMPLEMENTED),
        "chat_template": (_truthy, "the checkpoint's own chat template is always used"),
        "documents": (_truthy, _NOT_IMPLEMENTED),
        "audio": (_truthy, "this model has no audio output"),
        "modalities": (lambda m: list(m) != ["text"], "this model only writes text"),
        "reasoning_effort": (_truthy, 'Qwen3 thinks or not: use chat_template_kwargs {"enable_thinking": false}'),
        "web_search_options": (_truthy, _NOT_IMPLEMENTED),
        "verbosity": (_truthy, "the length of the answer is the model's; bound it with max_completion_tokens"),
    }

    def to_sampling_params(self, choice: int = 0) -> SamplingParams:
        self.check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs set to true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            # Checked here: SamplingParams knows it as logprobs, which on chat is the boolean.
            raise InvalidRequestError(
                f"top_logprobs must be in [0, {MAX_LOGPROBS}], not {self.top_logprobs}", "top_logprobs"
            )
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
    stop_token_ids: list[int] | None = _described(_STOP_TOKEN_IDS_SCHEMA, default=None)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    logit_bias: dict[str, float] | None = None
    # Structured output, SGLang's names: a JSON schema (as JSON text), a regex, an EBNF grammar.
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None

    def structured(self) -> StructuredOutput | None:
        return only_one(
            [
                StructuredOutput("json_schema", _schema_text(self.json_schema, "json_schema"), field="json_schema")
                if self.json_schema is not None
                else None,
                StructuredOutput("regex", self.regex, field="regex") if self.regex is not None else None,
                StructuredOutput("grammar", self.ebnf, field="ebnf") if self.ebnf is not None else None,
            ]
        )

    _REFUSED = {
        "n": (_not_one, "send n copies of the prompt in a batch instead"),
        "stop_regex": (_truthy, _NOT_IMPLEMENTED),
        "custom_params": (_truthy, "custom logit processors are not supported"),
    }


class GenerateRequest(_Lenient):
    """SGLang's native /generate."""

    model_config = ConfigDict(extra="allow", json_schema_extra=exactly_one_of("text", "input_ids"))

    text: str | list[str] | None = _described({"anyOf": [_TEXT, _TEXTS, _NULL]}, default=None)
    input_ids: Any = _described(  # checked by prompts() and the frontend, as CompletionRequest.prompt is
        {"anyOf": [_TOKEN_IDS, {"type": "array", "minItems": 1, "items": _TOKEN_IDS}, _NULL]}, default=None
    )
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    stream: bool = False
    rid: str | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # the first prompt position with a logprob; -1: none of the prompt's
    return_text_in_logprobs: bool = False

    _REFUSED = {
        "image_data": (_truthy, "this model reads text only"),
        "audio_data": (_truthy, "this model reads text only"),
        "input_embeds": (_truthy, _NOT_IMPLEMENTED),
        "lora_path": (_truthy, "LoRA adapters are not supported"),
        "session_params": (_truthy, _NOT_IMPLEMENTED),
        "return_hidden_states": (_truthy, _NOT_IMPLEMENTED),
        "custom_logit_processor": (_truthy, "custom logit processors are not supported"),
    }

    def prompts(self) -> tuple[list[str | list[int]], bool]:
        """(prompts, batched)."""
        if (self.text is None) == (self.input_ids is None):
            raise InvalidRequestError("give exactly one of text and input_ids", "text")
        if self.text is not None:
            return ([self.text], False) if isinstance(self.text, str) else (list(self.text), True)
        prompts = _prompts(self.input_ids, "input_ids")
        if not all(isinstance(p, list) for p in prompts):  # (a string would be tokenized: it is text, not ids)
            raise InvalidRequestError("input_ids must be a list of token ids, or a list of such lists", "input_ids")
        return prompts, prompts[0] is not self.input_ids

    def to_sampling_params(self) -> SamplingParams:
        sp = self.sampling_params
        self.check_refused()
        sp.check_refused()
        if self.logprob_start_len < -1:
            raise InvalidRequestError(
                f"logprob_start_len must be -1 or more, not {self.logprob_start_len}", "logprob_start_len"
            )
        prompt_logprobs = None
        if self.return_logprob and self.logprob_start_len >= 0:
            prompt_logprobs = self.top_logprobs_num
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
            prompt_logprobs=prompt_logprobs,
            prompt_logprobs_start=max(self.logprob_start_len, 0),
            max_tokens=sp.max_new_tokens,
            min_tokens=sp.min_new_tokens,
            ignore_eos=sp.ignore_eos,
            stop=sp.stop,
            stop_token_ids=sp.stop_token_ids,
            skip_special_tokens=sp.skip_special_tokens,
            include_stop_str_in_output=sp.no_stop_trim,
            logit_bias=sp.logit_bias,
            structured=sp.structured(),
        )


# ---- retrieval: /v1/embeddings, /v1/rerank, /score (server/retrieval_api.py) ----------------------------------------

_REFUSED_POOLING = {
    "truncate_prompt_tokens": (_truthy, "inputs are never truncated; shorten the input"),
    "priority": (_truthy, "requests are served in arrival order"),
}


def _texts(value: Any, field: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise InvalidRequestError(f"{field} must be a string or a non-empty list of strings", field)
    return value


class EmbeddingRequest(_Lenient):
    """OpenAI's embeddings body (`user` is metadata, accepted as OpenAI does)."""

    input: Any = _described(_PROMPT_SCHEMA)
    model: str | None = None
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None

    _REFUSED = _REFUSED_POOLING

    def inputs(self) -> list[str | list[int]]:
        if self.encoding_format not in ("float", "base64"):
            raise InvalidRequestError(
                f'encoding_format must be "float" or "base64", not {self.encoding_format!r}', "encoding_format"
            )
        inputs = _prompts(self.input, "input")
        for item in inputs:
            if isinstance(item, str):
                if not item:
                    raise InvalidRequestError("an input is an empty string", "input")
            elif not isinstance(item, list) or not item or not all(type(t) is int for t in item):
                raise InvalidRequestError(
                    "input must be a string, a list of strings, a list of token ids, or a list of those", "input"
                )
        return inputs


class _ScoreFields(_Lenient):
    model: str | None = None
    # Qwen3-Reranker's task instruction (its model card's "Instruct"; SGLang calls it `instruct`): by default the
    # card's web-search one.
    instruction: str | None = None

    _REFUSED = _REFUSED_POOLING

    def instruction_text(self) -> str | None:
        value = self.instruction if self.instruction is not None else (self.model_extra or {}).get("instruct")
        if value is not None and not isinstance(value, str):
            raise InvalidRequestError("instruction must be a string", "instruction")
        return value


class RerankRequest(_ScoreFields):
    """vLLM's (Cohere's and Jina's) rerank body; SGLang's has the same fields."""

    query: str
    documents: list[Any] = _described({"type": "array", "minItems": 1, "items": {"anyOf": [_TEXT, {"type": "object"}]}})
    top_n: int | None = None
    return_documents: bool = True

    def document_texts(self) -> list[str]:
        """Each document as text: a string, or an object with a "text" string (Cohere's)."""
        texts = []
        for d in self.documents:
            text = d.get("text") if isinstance(d, dict) else d
            if not isinstance(text, str):
                raise InvalidRequestError('each document is a string or an object with a "text" string', "documents")
            texts.append(text)
        if not texts:
            raise InvalidRequestError("documents is empty", "documents")
        return texts

    def checked_top_n(self, count: int) -> int:
        """How many results to return: top_n, or every document (top_n 0 means all, as in vLLM)."""
        if self.top_n is None or self.top_n == 0:
            return count
        if self.top_n < 0:
            raise InvalidRequestError(f"top_n must be at least 1, not {self.top_n}", "top_n")
        return min(self.top_n, count)


class ScoreRequest(_ScoreFields):
    """vLLM's /score body: text_1 against each of text_2 (one text_1 for all, or as many as text_2, pairwise)."""

    text_1: Any = None
    text_2: Any = None

    def pairs(self) -> list[tuple[str, str]]:
        first, second = _texts(self.text_1, "text_1"), _texts(self.text_2, "text_2")
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second):
            raise InvalidRequestError(
                f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or one per text_2", "text_1"
            )
        return list(zip(first, second))


# ---- /v1/responses ---------------------------------------------------------------------------------------------------

# Reasoning efforts: Qwen3 thinks or not (its thinking has no budget), so "none" and "minimal" turn the thinking block
# off (enable_thinking false) and every other effort leaves it on.
_EFFORTS_WITHOUT_THINKING = ("none", "minimal")
_EFFORTS_WITH_THINKING = ("low", "medium", "high", "xhigh", "max")
_CHAT_ONLY = "it belongs to /v1/chat/completions"


class ResponsesRequest(_Lenient):
    """OpenAI's Responses API, translated to a chat request (to_chat_request) so that one path renders, constrains and
    parses. Its fields are those OpenAI documents; vLLM's sampling extras (seed, top_k, logit_bias, ...) pass through."""

    model: str | None = None
    input: Any = _described(
        {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "object"}}]}, default=None
    )
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None  # identifiers: echoed, they change nothing
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # the prefix cache is automatic: nothing to key
    truncation: str | None = None
    service_tier: str | None = None
    top_logprobs: int | None = None  # alternatives per token, with include message.output_text.logprobs
    include: Any = None  # reasoning.encrypted_content (what Codex asks for with store false), output text logprobs
    # vLLM's extras, honoured as on chat completions.
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    _REFUSED = {
        **_REFUSED_SAMPLING,
        "background": (_truthy, "responses are answered in the request that makes them"),
        "conversation": (_truthy, "conversations are not stored: pass previous_response_id"),
        "prompt": (_truthy, "prompt templates are not stored: pass input"),
        "max_tool_calls": (_truthy, _NOT_IMPLEMENTED),
        "context_management": (_truthy, _NOT_IMPLEMENTED),
        "moderation": (_truthy, "there is no moderation model"),
        "prompt_cache_options": (_truthy, "the prefix cache is automatic"),
        "prompt_cache_retention": (lambda v: v != "in_memory", "the prefix cache is in memory only"),
        "background_options": (_truthy, "responses are answered in the request that makes them"),
        "access_programs": (_truthy, _NOT_IMPLEMENTED),
        "image": (_truthy, "this model reads and writes text only"),
        "stream_options": (lambda v: bool(v and v.get("include_obfuscation")), "events are never padded"),
        "truncation": (lambda v: v != "disabled", "prompts are never truncated; shorten the input"),
        "service_tier": (lambda v: v not in ("auto", "default"), "there is one service tier"),
        # Chat completions' names, which would be ignored here.
        "messages": (_truthy, "pass input"),
        "response_format": (_truthy, "pass text.format"),
        "max_tokens": (_truthy, "pass max_output_tokens"),
        "max_completion_tokens": (_truthy, "pass max_output_tokens"),
        "n": (_not_one, "a response has one output"),
        "logprobs": (_truthy, _CHAT_ONLY),
        "reasoning_effort": (_truthy, "pass reasoning.effort"),
        "functions": (_truthy, "pass tools"),
        "function_call": (_truthy, "pass tool_choice"),
        "add_generation_prompt": (lambda v: v is not True, _CHAT_ONLY),
    }

    def check(self) -> None:
        self.check_refused()
        if self.input is None:
            raise InvalidRequestError("input is required: a string or a list of input items", "input")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise InvalidRequestError(
                f"max_output_tokens must be at least 1, not {self.max_output_tokens}", "max_output_tokens"
            )
        if self.previous_response_id is not None and not isinstance(self.previous_response_id, str):
            raise InvalidRequestError("previous_response_id must be a string", "previous_response_id")
        if self.include is not None and not isinstance(self.include, list):
            raise InvalidRequestError("include must be a list of strings", "include")
        for value in self.include or []:
            if value not in (ENCRYPTED_REASONING, OUTPUT_LOGPROBS):
                raise InvalidRequestError(
                    f"include {value!r} is not supported: only {ENCRYPTED_REASONING!r} and {OUTPUT_LOGPROBS!r} are "
                    "available",
                    "include",
                )
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(
                f"top_logprobs must be in [0, {MAX_LOGPROBS}], not {self.top_logprobs}", "top_logprobs"
            )

    def includes_encrypted_reasoning(self) -> bool:
        return ENCRYPTED_REASONING in (self.include or [])

    def includes_output_logprobs(self) -> bool:
        """Output text logprobs, as OpenAI gives them: only with this include (top_logprobs alone gives none)."""
        return OUTPUT_LOGPROBS in (self.include or [])

    def tool_catalog(self) -> ToolCatalog:
        """The request's tools (function, custom and namespace tools) as chat's function tools (responses_tools)."""
        return tool_catalog(self.tools or [])

    def chat_tools(self) -> list[dict[str, Any]] | None:
        return None if self.tools is None else self.tool_catalog().chat_tools

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if choice == "auto" and not self.tools:
            return None  # (Codex CLI sends "auto" with its tools, an empty list included: no tools, nothing to choose)
        if choice is None or isinstance(choice, str):
            return choice
        if choice.get("type") in ("function", "custom") and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        raise InvalidRequestError(
            'tool_choice must be "none", "auto", "required" or {"type": "function" or "custom", "name": ...}',
            "tool_choice",
        )

    def chat_response_format(self) -> dict[str, Any] | None:
        """text.format in chat's response_format shape; text.verbosity other than medium is refused."""
        text = self.text or {}
        unknown = sorted(set(text) - {"format", "verbosity"})
        if unknown:
            raise InvalidRequestError(f"text.{unknown[0]} is not supported", "text")
        if text.get("verbosity") not in (None, "medium"):
            raise InvalidRequestError(
                "text.verbosity is not supported: the length of the answer is the model's; bound it with "
                "max_output_tokens",
                "text",
            )
        fmt = text.get("format")
        if fmt is None:
            return None
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind in ("text", "json_object"):
            return {"type": kind}
        if kind == "json_schema":
            if "schema" not in fmt:
                raise InvalidRequestError(
                    'text.format json_schema is {"type": "json_schema", "name": ..., "schema": {...}}', "text"
                )
            spec = {"name": fmt.get("name", "output"), "schema": fmt["schema"], "strict": fmt.get("strict")}
            return {"type": "json_schema", "json_schema": spec}
        raise InvalidRequestError(
            f'text.format.type must be "text", "json_object" or "json_schema", not {kind!r}', "text"
        )

    def template_kwargs(self) -> dict[str, Any]:
        """chat_template_kwargs with reasoning.effort applied (enable_thinking)."""
        kwargs = dict(self.chat_template_kwargs or {})
        reasoning = self.reasoning or {}
        unknown = sorted(set(reasoning) - {"effort", "summary", "generate_summary", "context"})
        if unknown:
            raise InvalidRequestError(f"reasoning.{unknown[0]} is not supported", "reasoning")
        summary = reasoning.get("summary") or reasoning.get("generate_summary")
        if summary not in (None, "auto"):
            # "auto" (Codex CLI's default) lets the server choose, and it gives none: there is no summarizer, the
            # reasoning item carries the whole reasoning text as reasoning_text content (as vLLM's do).
            raise InvalidRequestError(
                f"reasoning.summary {summary!r} is not supported: reasoning items carry the reasoning text itself",
                "reasoning",
            )
        if reasoning.get("context") not in (None, "auto", "current_turn"):
            # Qwen3's template keeps the reasoning of the turn in progress (its tool loop) and drops earlier turns'.
            raise InvalidRequestError(
                "reasoning.context must be auto or current_turn: Qwen3's chat template renders only the current "
                "turn's reasoning",
                "reasoning",
            )
        effort = reasoning.get("effort")
        if effort is None:
            return kwargs
        if effort not in _EFFORTS_WITHOUT_THINKING + _EFFORTS_WITH_THINKING:
            raise InvalidRequestError(f"reasoning.effort {effort!r} is not one of OpenAI's efforts", "reasoning")
        thinking = effort not in _EFFORTS_WITHOUT_THINKING
        if kwargs.get("enable_thinking", thinking) != thinking:
            raise InvalidRequestError("reasoning.effort and chat_template_kwargs.enable_thinking disagree", "reasoning")
        kwargs["enable_thinking"] = thinking
        return kwargs

    def to_chat_request(self, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request this response is made by: messages are the conversation (instructions, previous turns and
        input, as chat messages)."""
        fields = dict(
            model=self.model,
            messages=messages,
            tools=self.chat_tools(),
            tool_choice=self.chat_tool_choice(),
            parallel_tool_calls=self.parallel_tool_calls,
            response_format=self.chat_response_format(),
            max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            stream=self.stream,
            seed=self.seed,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias,
            stop=self.stop,
            chat_template_kwargs=self.template_kwargs(),
        )
        if self.includes_output_logprobs():
            fields.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        return ChatCompletionRequest(**fields)
