"""What one request may ask of the engine: token ids inside the vocabulary, and tokens that fit the context and the KV
pool. Checked by the frontend before a request is sent, and again by the engine that admits it (the core trusts no
one)."""

from __future__ import annotations

from .errors import InvalidRequestError
from .sampling_params import MAX_LOGPROBS

# Prompt logprobs are kept per prompt token (with up to 20 alternatives each) until the request's first token goes
# out, in the engine and again in the response: longer prompts are refused rather than held in memory.
MAX_PROMPT_LOGPROB_TOKENS = 32768


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    """Raise InvalidRequestError naming `param` if any id is outside [0, vocab_size)."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {vocab_size})", param)


def check_fits(num_prompt_tokens: int, max_tokens: int, max_model_len: int, page_size: int, num_pages: int) -> None:
    """Raise InvalidRequestError for a request that could never run: empty, too long, or more pages than the pool has."""
    if num_prompt_tokens < 1:
        raise InvalidRequestError("the prompt is empty", "prompt")
    total = num_prompt_tokens + max_tokens
    if total > max_model_len:
        raise InvalidRequestError(
            f"this model's maximum context length is {max_model_len} tokens, but {total} were requested "
            f"({num_prompt_tokens} in the prompt, {max_tokens} in the completion): shorten the prompt or lower "
            "max_tokens",
            "max_tokens" if num_prompt_tokens < max_model_len else "prompt",
        )
    # The last generated token needs no KV, so a full sequence holds total - 1 cached tokens.
    pages = -(-(total - 1) // page_size)
    if pages > num_pages:
        raise InvalidRequestError(
            f"the request needs up to {total} tokens of KV ({pages} pages) but the KV pool has only {num_pages} "
            "pages: lower max_tokens or give the pool more memory",
            "max_tokens",
        )


def check_prompt_logprobs(num_prompt_tokens: int, start: int, param: str) -> None:
    """Raise InvalidRequestError naming `param` for prompt logprobs the server will not hold: too many of them, or a
    start past the prompt."""
    if start >= num_prompt_tokens:
        raise InvalidRequestError(
            f"prompt logprobs start at position {start}, but the prompt has only {num_prompt_tokens} tokens", param
        )
    if num_prompt_tokens - start > MAX_PROMPT_LOGPROB_TOKENS:
        raise InvalidRequestError(
            f"prompt logprobs are limited to {MAX_PROMPT_LOGPROB_TOKENS} prompt tokens per request; this one asks "
            f"for {num_prompt_tokens - start}",
            param,
        )


# Prompt logprob entries (a position's prompt token and each of its alternatives) one HTTP request may return, over
# all its prompts and the choices that repeat them. The limit is what one sequence at the limits above may carry
# (32,768 positions x 21 tokens: a response of about 30 MB), so no single-sequence request allowed before is refused;
# lm-eval's loglikelihood requests (echo, logprobs 1 to 5, n 1, a few prompts of a few thousand tokens) use a few
# percent of it. The echo request of issue 40 (2,000 positions x 21 x n = 128: 5.4 million entries, a 158 MB response
# built in 117 s) does not fit.
MAX_PROMPT_LOGPROB_ENTRIES = MAX_PROMPT_LOGPROB_TOKENS * (MAX_LOGPROBS + 1)  # the top-k and the prompt token


def check_prompt_logprob_entries(positions: int, top: int, copies: int, param: str) -> None:
    """Raise InvalidRequestError naming `param` when `positions` prompt positions (over every prompt), each with the
    prompt token and `top` alternatives, returned `copies` times (once per choice), exceed the limit."""
    total = positions * (top + 1) * copies
    if total > MAX_PROMPT_LOGPROB_ENTRIES:
        raise InvalidRequestError(
            f"this request asks for {total} prompt logprob entries ({positions} prompt positions x {top + 1} tokens x "
            f"{copies} choices); at most {MAX_PROMPT_LOGPROB_ENTRIES} are returned per request: lower n, {param} or "
            "the prompt's length",
            param,
        )
