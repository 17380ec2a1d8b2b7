"""A StructuredOutput as llguidance grammar text (within bounds.py's limits), and its validation in a worker process
(validator.py), cached by spec."""

from __future__ import annotations

import json
import os
from functools import lru_cache

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from ..errors import InvalidRequestError
from ..sampling_params import StructuredOutput
from .bounds import lark_problem, schema_problem, spec_bytes_problem
from .lru import ByteBudgetLRU
from .validator import ValidatorCrashed, default_validator

# Compact, bounded JSON: a model (even a random one) cannot stall in whitespace, and ", " / ": " is how models and
# json.dumps write it.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_MAX_ERROR_CHARS = 600


def _error(structured: StructuredOutput, message: str) -> InvalidRequestError:
    message = message.strip()
    if len(message) > _MAX_ERROR_CHARS:
        message = message[: _MAX_ERROR_CHARS - 3] + "..."
    return InvalidRequestError(f"invalid {structured.kind.replace('_', ' ')}: {message}", structured.field)


def _json_schema(structured: StructuredOutput, schema) -> str:
    if not isinstance(schema, (dict, bool)):
        raise _error(structured, "a JSON schema is an object (or true / false)")
    options = {**JSON_OPTIONS, "lenient": not structured.strict}
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
    except (ValueError, TypeError) as e:
        raise _error(structured, str(e)) from None


def _choice_lark(structured: StructuredOutput) -> str:
    try:
        choices = json.loads(structured.spec)
    except ValueError:
        raise _error(structured, "the choices must be a JSON list of strings") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise _error(structured, "the choices must be a non-empty list of non-empty strings")
    # Lark string literals take JSON's escapes; ensure_ascii keeps every character printable in the grammar.
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=True) for c in dict.fromkeys(choices))


def llguidance_grammar(structured: StructuredOutput, eos_token_ids: tuple[int, ...] = ()) -> str:
    """llguidance's grammar text for the spec; raises InvalidRequestError for input that is not even well formed
    (bad JSON). Whether the grammar compiles is check_structured's question. eos_token_ids: never allowed inside a
    thinking block (the answer must follow it)."""
    grammar = _constraint_grammar(structured)
    if structured.thinking is None:
        return grammar
    return _after_thinking(grammar, structured, eos_token_ids)


def _after_thinking(grammar: str, structured: StructuredOutput, eos_token_ids: tuple[int, ...]) -> str:
    """The constraint behind an optional thinking block (an opened one, which must close, with thinking_open): any
    tokens but the closing one and EOS, then it, then up to two newlines, then the constraint as a nested grammar."""
    try:
        inner = json.loads(grammar)["grammars"]
    except ValueError:  # Lark text (what llguidance's grammar_from_lark gives back), not a grammar list
        inner = [{"lark_grammar": grammar}]
    if len(inner) != 1:  # nested grammars refer to each other by index, which a wrapper in front would shift
        raise _error(structured, "this grammar cannot follow a thinking block; disable thinking for this request")
    start, end = structured.thinking
    excluded = ",".join(str(t) for t in sorted({end, *eos_token_ids}))
    block = f"<[^{excluded}]>* <[{end}]> /\\n{{0,2}}/"
    lark = (
        f"start: {block} @constraint\n" if structured.thinking_open else f"start: (<[{start}]> {block})? @constraint\n"
    )
    return json.dumps({"grammars": [{"name": "thinking", "lark_grammar": lark}, {**inner[0], "name": "constraint"}]})


def _within_bounds(structured: StructuredOutput, problem: str | None) -> None:
    if problem is not None:
        raise _error(structured, problem)


def _constraint_grammar(structured: StructuredOutput) -> str:
    kind = structured.kind
    if kind == "json_object":
        return _json_schema(structured, {"type": "object"})
    _within_bounds(structured, spec_bytes_problem(structured.spec))
    if kind == "json_schema":
        try:
            schema = json.loads(structured.spec)
        except ValueError as e:
            raise _error(structured, f"the schema is not valid JSON ({e})") from None
        except RecursionError:  # Python's parser gives up long before llguidance would, but not with a ValueError
            raise _error(structured, "the schema nests too deep to parse") from None
        _within_bounds(structured, schema_problem(schema))
        return _json_schema(structured, schema)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(structured.spec)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(_choice_lark(structured))
    try:  # "grammar": Lark as llguidance reads it, or GBNF / EBNF (`root ::= ...`) converted to it
        lark = any_to_lark(structured.spec)
    except Exception as e:  # the converter raises its own error types for bad GBNF (RecursionError included)
        raise _error(structured, f"not a Lark or GBNF grammar ({e})") from None
    _within_bounds(structured, lark_problem(lark))
    return llguidance.LLMatcher.grammar_from_lark(lark)


# Verdicts by (spec key, tokenizer): None (it compiles) or why not. Bounded by the bytes of the specs held (up to
# 1 MiB each), plus a little for the entry itself.
VERDICT_CACHE_BYTES = 64 << 20
_verdicts: ByteBudgetLRU[str | None] = ByteBudgetLRU(
    VERDICT_CACHE_BYTES, lambda key, verdict: 256 + len(key[0][1]) + len(verdict or "")
)


def check_structured(
    structured: StructuredOutput, tokenizer_json: str | None = None, vocab_size: int = 0, eos_token_ids=()
) -> None:
    """Raise InvalidRequestError (naming structured.field) unless the spec compiles (against the tokenizer, as the
    engine will compile it, when tokenizer_json is given: then also unless its language is empty). llguidance runs
    in a worker process (validator.py), so a spec that crashes it costs this request only. Verdicts are cached."""
    eos = tuple(eos_token_ids)
    tokenizer = (tokenizer_json, vocab_size, eos) if tokenizer_json else None
    key = (structured.key, tokenizer)
    verdict = _verdicts.get(key, default=key)  # (key itself: not cached; None is a cached "it compiles")
    if verdict is key:
        grammar = llguidance_grammar(structured, eos)  # bounds and bad JSON raise here, in this process, uncached
        try:
            verdict = default_validator().validate(grammar, tokenizer)
        except ValidatorCrashed as e:
            verdict = str(e)
        _verdicts.put(key, verdict)
    if verdict is not None:
        raise _error(structured, verdict)


@lru_cache(maxsize=8)
def tokenizer_problem(tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]) -> str | None:
    """Why llguidance cannot work with this tokenizer.json (None: it can). Builds the grammar engine's tokenizer
    once per model, as the engine will: a model whose tokenizer it cannot read gets 400s, not failed requests."""
    default_validator().warm((tokenizer_json, vocab_size, eos_token_ids))  # meanwhile, a worker reads it too
    try:
        with open(tokenizer_json, encoding="utf-8") as f:
            llguidance.LLTokenizer(f.read(), n_vocab=vocab_size, eos_token=list(eos_token_ids))
    except Exception as e:  # noqa: BLE001 - any failure means the same thing here
        return str(e) or type(e).__name__
    return None


def check_tokenizer(structured: StructuredOutput, tokenizer_json: str | None, vocab_size: int, eos_token_ids) -> None:
    """Raise InvalidRequestError (naming structured.field) when the model's tokenizer cannot drive a grammar."""
    problem = (
        "the model has no tokenizer.json"
        if not tokenizer_json or not os.path.isfile(tokenizer_json)
        else (tokenizer_problem(tokenizer_json, vocab_size, tuple(eos_token_ids)))
    )
    if problem is not None:
        raise InvalidRequestError(f"structured output is not available for this model: {problem}", structured.field)
