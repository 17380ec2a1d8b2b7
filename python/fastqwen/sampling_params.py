"""Per-request sampling parameters, validated when they are made (InvalidRequestError names the field)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .config import GenerationDefaults
from .errors import InvalidRequestError

MAX_LOGPROBS = 20
_INT64_MAX = 2**63 - 1
# Bounds that keep every accepted value finite and meaningful in the samplers' float32 arithmetic (reference and
# CUDA alike): a temperature or penalty outside them overflows a logit to inf (and a softmax to NaN).
MAX_TEMPERATURE = 100.0
GREEDY_BELOW = 1e-5  # temperatures under this sample greedily: dividing by them overflows float32 logits
MIN_TOP_P = 1e-6  # under 1 / vocab for any vocabulary below a million: keeps the same single token as anything smaller
REPETITION_PENALTY_RANGE = (1e-3, 1e3)
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 1024
MAX_TOKEN_ID_DIGITS = 20  # a logit_bias key as text: "-" and the 19 digits of a 64-bit integer
MAX_LOGIT_BIAS = 1024  # entries of logit_bias; OpenAI's values are in [-100, 100]
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_STRUCTURED_CHARS = 1 << 20  # a schema, regex or grammar of at most 1 MiB of text
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutput:
    """A constraint on the output, compiled to a grammar by fastqwen.grammar (llguidance) and enforced token by
    token: the request can only sample tokens that keep its output a prefix of the language, and ends (finish
    reason "stop") once the output is complete and nothing can follow, or on EOS, which is allowed only then.

    kind: "json_schema" (spec: the schema as JSON text), "json_object" (any JSON object; spec ignored), "regex",
      "choice" (spec: a JSON list of strings: exactly one of them), "grammar" (a Lark grammar as llguidance reads it,
      with %json{...} schemas inside allowed, or a GBNF / EBNF grammar with `root ::= ...`).
    strict: for json_schema, refuse schema keywords the compiler does not implement (False: ignore them).
    field: the request field it came from, named in errors (e.g. "response_format").
    thinking: (open id, close id) of a reasoning model's <think> / </think> tokens: the constrained output may then
      follow a thinking block, which the grammar leaves free (as vLLM applies structured output after the reasoning).
    thinking_open: the prompt already opened the block: the output starts inside it and must close it first.
    JSON is generated compactly, with ", " and ": " separators and no other whitespace.
    """

    kind: str
    spec: str = ""
    strict: bool = True
    field: str = "structured"
    thinking: tuple[int, int] | None = None
    thinking_open: bool = False

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidRequestError(
                f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, not {_show(self.kind)}",
                self.field,
            )
        if not isinstance(self.spec, str):
            raise InvalidRequestError(f"the {self.kind} must be given as text", self.field)
        if len(self.spec) > MAX_STRUCTURED_CHARS:
            raise InvalidRequestError(f"the {self.kind} is longer than {MAX_STRUCTURED_CHARS} characters", self.field)
        if self.kind == "json_object":
            self.spec = ""
        elif not self.spec:
            raise InvalidRequestError(f"the {self.kind} is empty", self.field)

    @property
    def key(self) -> tuple:
        """What its compiled grammar is cached by."""
        return (self.kind, self.spec, self.strict, self.thinking, self.thinking_open)


@dataclass
class SamplingParams:
    """How one request generates. A field left as None takes the checkpoint's generation_config.json value, and
    the neutral value (in brackets) where the checkpoint has none.

    temperature: in [0, 100]; 0 (and anything below 1e-5) = greedy [1.0].
    top_k: keep the k most likely tokens; 0 or -1 = off; any k up to 2**63 - 1 is accepted, and a k at least the
      vocabulary size keeps every token, so the engine runs it as off [off].
    top_p: keep the smallest set of most likely tokens whose probability reaches top_p, in (0, 1]; values under
      1e-6 act as 1e-6 (both keep only the most likely token) [1.0].
    min_p: drop tokens less likely than min_p times the most likely one, in [0, 1] [0.0].
    repetition_penalty: in [0.001, 1000]; logits of tokens already in the prompt or output are divided by it when
      positive and multiplied by it when negative [1.0].
    presence_penalty / frequency_penalty: in [-2, 2]; subtracted from the logit of every token already generated,
      once / once per occurrence [0.0].
    seed: the same seed and prompt give the same tokens whatever else is in the batch [unseeded].
    logprobs: None = none; N >= 0 = the logprob of each sampled token and its N most likely alternatives, from the
      model's raw distribution (before penalties and temperature), N <= 20.
    prompt_logprobs: None = none; N >= 0 = the logprob of each prompt token given the tokens before it, and the N
      most likely tokens at that position (raw distribution), N <= 20. The first prompt token has none (None).
      Prompt positions whose logits are needed are recomputed even when the prefix cache holds them.
    prompt_logprobs_start: the first prompt position whose logprob is returned (SGLang's logprob_start_len) [0].
    max_tokens: new tokens at most; None = up to the context length [16].
    min_tokens: EOS and stop tokens are blocked, and stop strings not checked, before this many new tokens.
    ignore_eos: keep going past the model's EOS tokens.
    stop: up to 32 strings of up to 1024 characters that end generation; the text from the stop string on is not
      returned.
    stop_token_ids: token ids that end generation (kept in token_ids, not in the text if special); duplicates are
      dropped, so the list is never longer than the vocabulary.
    skip_special_tokens: leave special tokens out of the text.
    include_stop_str_in_output: keep the matched stop string at the end of the text.
    logit_bias: {token id: value in [-100, 100]}, at most 1024 entries, added to the logits (after penalties)
      before sampling; token ids may be given as strings (OpenAI's JSON keys). Logprobs stay those of the raw model.
    structured: a StructuredOutput the output must follow (JSON schema, regex, choice, grammar).
    """

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 0
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        self.temperature = _optional_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        if self.temperature is not None and self.temperature < GREEDY_BELOW:
            self.temperature = 0.0
        if self.top_k is not None:
            self.top_k = _int("top_k", self.top_k)
            if not -1 <= self.top_k <= _INT64_MAX:
                raise InvalidRequestError(
                    f"top_k must be -1, 0 (off) or a positive 64-bit integer, not {_show(self.top_k)}", "top_k"
                )
        self.top_p = _optional_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if self.top_p is not None:
            self.top_p = max(self.top_p, MIN_TOP_P)
        self.min_p = _optional_float("min_p", self.min_p, 0.0, 1.0)
        self.repetition_penalty = _optional_float(
            "repetition_penalty", self.repetition_penalty, *REPETITION_PENALTY_RANGE
        )
        self.presence_penalty = _optional_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.frequency_penalty = _optional_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None:
            self.seed = _int("seed", self.seed)
            if not -_INT64_MAX - 1 <= self.seed <= _INT64_MAX:
                raise InvalidRequestError("seed must fit in a signed 64-bit integer", "seed")
        if self.logprobs is not None:
            self.logprobs = _int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise InvalidRequestError(
                    f"logprobs must be in [0, {MAX_LOGPROBS}], not {_show(self.logprobs)}", "logprobs"
                )
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _int("prompt_logprobs", self.prompt_logprobs)
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise InvalidRequestError(
                    f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], not {_show(self.prompt_logprobs)}",
                    "prompt_logprobs",
                )
        self.prompt_logprobs_start = _int("prompt_logprobs_start", self.prompt_logprobs_start)
        if not 0 <= self.prompt_logprobs_start <= _INT64_MAX:
            raise InvalidRequestError(
                f"prompt_logprobs_start must be >= 0, not {_show(self.prompt_logprobs_start)}", "prompt_logprobs_start"
            )
        if self.max_tokens is not None:
            self.max_tokens = _int("max_tokens", self.max_tokens)
            if not 1 <= self.max_tokens <= _INT64_MAX:
                raise InvalidRequestError(
                    f"max_tokens must be at least 1 and fit in 64 bits, not {_show(self.max_tokens)}", "max_tokens"
                )
        self.min_tokens = _int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= _INT64_MAX:
            raise InvalidRequestError(
                f"min_tokens must be >= 0 and fit in 64 bits, not {_show(self.min_tokens)}", "min_tokens"
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})", "min_tokens"
            )
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError("stop must be a string or a list of non-empty strings", "stop")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError(f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters", "stop")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings, not {len(self.stop)}", "stop")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise InvalidRequestError("stop_token_ids must be a list of integers", "stop_token_ids")
        # dict.fromkeys: duplicates dropped, order kept (the ban list of min_tokens is never wider than the vocabulary)
        self.stop_token_ids = list(dict.fromkeys(_int("stop_token_ids", t) for t in (self.stop_token_ids or [])))
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise InvalidRequestError("structured must be a StructuredOutput", "structured")

    def with_defaults(self, defaults: GenerationDefaults) -> SamplingParams:
        """A copy with every unset field filled: from generation_config.json, else the neutral value."""

        def pick(value, default, neutral):
            if value is not None:
                return value
            return default if default is not None else neutral

        temperature = self.temperature
        if temperature is None:
            temperature = 0.0 if defaults.do_sample is False else pick(None, defaults.temperature, 1.0)
        return replace(
            self,
            temperature=float(temperature),
            top_k=int(pick(self.top_k, defaults.top_k, 0)),
            top_p=float(pick(self.top_p, defaults.top_p, 1.0)),
            min_p=float(pick(self.min_p, defaults.min_p, 0.0)),
            repetition_penalty=float(pick(self.repetition_penalty, defaults.repetition_penalty, 1.0)),
            stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids),
            logit_bias=dict(self.logit_bias) if self.logit_bias else None,
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _logit_bias(bias) -> dict[int, float] | None:
    """{token id: bias} with int keys (strings of digits accepted, as OpenAI's JSON sends them), values in range."""
    if not bias:
        return None
    if not isinstance(bias, dict):
        raise InvalidRequestError("logit_bias must be an object mapping token ids to numbers", "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequestError(
            f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, not {len(bias)}", "logit_bias"
        )
    out: dict[int, float] = {}
    for key, value in bias.items():
        if isinstance(key, str):
            text = key.strip()
            # The length cap comes first: int() refuses strings over 4,300 digits with a ValueError, and no token id
            # has more than 19 (a 64-bit integer).
            if len(text) > MAX_TOKEN_ID_DIGITS or not (text.isascii() and text.lstrip("-").isdigit()):
                raise InvalidRequestError(f"logit_bias keys must be token ids, not {_show(key)}", "logit_bias")
            key = int(text)
        token = _int("logit_bias", key)
        if token < 0:
            raise InvalidRequestError(f"logit_bias keys must be token ids >= 0, not {token}", "logit_bias")
        if value is None:
            raise InvalidRequestError("logit_bias values must be numbers in [-100, 100], not null", "logit_bias")
        out[token] = _optional_float("logit_bias", value, *LOGIT_BIAS_RANGE)
    return out


def _int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise InvalidRequestError(f"{name} must be an integer, not {_show(value)}", name)
    return value


def _show(value) -> str:
    """A bad value for an error message, cut short: the message must not echo a megabyte back."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _optional_float(name: str, value, low: float, high: float | None, low_open: bool = False) -> float | None:
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (isinstance(value, float) and math.isnan(value))
    ):
        raise InvalidRequestError(f"{name} must be a number, not {_show(value)}", name)
    try:
        value = float(value)
    except OverflowError:  # an integer too large for a double
        value = math.inf if value > 0 else -math.inf
    too_low = value <= low if low_open else value < low
    if too_low or (high is not None and value > high) or math.isinf(value):
        bounds = f"{'(' if low_open else '['}{low:g}, {'inf)' if high is None else f'{high:g}]'}"
        raise InvalidRequestError(f"{name} must be in {bounds}, not {value:g}", name)
    return value
