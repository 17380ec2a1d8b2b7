"""The engine's grammar side: compile off the step (worker threads), cache by spec, one matcher per request, and the
step's bitmasks computed in parallel (requests with one spec spread over independent compiles, so that their masks
can be)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np

from ..errors import InvalidRequestError
from ..sampling_params import StructuredOutput
from .lru import ByteBudgetLRU
from .spec import llguidance_grammar
from .validator import VALIDATOR_STACK_BYTES

log = logging.getLogger(__name__)

# The compile threads' stack: llguidance's compile recursion deepens with the grammar (bounds.py), and the frontend
# validated every spec on a quarter of this (validator.py), so no validated spec can overflow it. Only the pages a
# compile touches are ever committed.
COMPILE_STACK_BYTES = 4 * VALIDATOR_STACK_BYTES

CACHE_BYTES = 512 << 20  # default budget of the compiled grammars kept (EngineConfig.grammar_cache_mib)
# A compiled grammar's memory: llguidance reports none, so it is estimated from the spec's text, conservatively.
# Measured with Qwen3's tokenizer after the first mask (RSS growth, llguidance 1.9.1): a 630 KB regex of 70,000
# alternated words 34-46 MB (the issue saw 18 MB for its 633 KB regexes), a 480 KB regex of character classes
# 9-18 MB, a 25 KB Lark grammar of 900 rules 3.2 MB, a small schema under 0.5 MB: at most about 75 bytes a
# character, and a fixed part. (The lexer can grow further as masks are computed, up to llguidance's limit of
# 250,000 states; no static estimate foresees that.)
COMPILE_BYTES_PER_CHAR = 128
COMPILE_BYTES_FIXED = 512 << 10


def estimated_compile_bytes(structured: StructuredOutput) -> int:
    """A conservative estimate of one compile's memory (see COMPILE_BYTES_PER_CHAR)."""
    return COMPILE_BYTES_FIXED + COMPILE_BYTES_PER_CHAR * len(structured.spec)


def default_lexer_groups() -> int:
    """As many independent compiles of a spec as llguidance's mask executor has threads (80% of the CPUs), at most 16.

    llguidance's copies of one compiled matcher share its lexer behind one lock (LLMatcher.deep_copy is a shallow
    clone of the parser), so the masks of requests copied from one compile are computed one after the other, however
    many threads the executor has. Requests with the same spec are spread over this many independent compiles, whose
    masks are computed in parallel."""
    return max(1, min(16, (os.cpu_count() or 1) * 80 // 100))


class GrammarMatcher:
    """One request's position in its grammar. The scheduler calls `advance` with each token it commits
    (scheduler.request.TokenConstraint); the sampler reads the matcher's mask before each draw."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher
        self.error: str | None = None  # why the grammar gave up, once it has: the request then ends with an error

    def advance(self, token: int) -> bool:
        """Take a committed token; False once nothing more can follow: the output is complete, or the grammar gave
        up (`error` says why). It gives up when no continuation can satisfy it (a schema whose instances are all
        infinite: its mask errs and lets through only EOS) or when a token outside it was committed (the masks
        make that impossible)."""
        if not self.matcher.consume_token(token) or self.matcher.is_error():
            reason = self.matcher.get_error().strip().splitlines()
            self.error = "the output cannot satisfy the grammar" + (f" ({reason[0][:300]})" if reason else "")
            log.info("a grammar gave up: %s", self.error)
            return False
        return not self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()


def fill_bitmasks(rows: list[tuple[GrammarMatcher, int]], out: np.ndarray) -> None:
    """Write each matcher's allowed-token bitmask into row `index` of out [R, ceil(vocab / 32)] int32 (C-contiguous,
    e.g. a pinned buffer's numpy view), all rows in parallel outside the GIL."""
    if not rows:
        return
    if out.dtype != np.int32 or out.ndim != 2 or not out.flags["C_CONTIGUOUS"]:
        raise ValueError("fill_bitmasks: out must be a C-contiguous int32 [rows, words] array")
    if any(not 0 <= i < out.shape[0] for _, i in rows):
        raise ValueError("fill_bitmasks: a row index is outside out")
    _executor().unsafe_compute_mask_ptr([(m.matcher, i) for m, i in rows], out.ctypes.data, out.shape[1] * 4, out.shape[0])


@contextlib.contextmanager
def _thread_stack(size: int):
    """Threads started inside get `size` bytes of stack. (Python's setting is process-wide: a thread another part
    of the process starts meanwhile gets it too, which costs only address space.)"""
    previous = threading.stack_size(size)
    try:
        yield
    finally:
        threading.stack_size(previous)


_mask_executor: llguidance.LLExecutor | None = None
_executor_lock = threading.Lock()


def _executor() -> llguidance.LLExecutor:
    global _mask_executor
    with _executor_lock:
        if _mask_executor is None:
            _mask_executor = llguidance.LLExecutor()
        return _mask_executor


class GrammarCompiler:
    """Compiles StructuredOutputs against the model's tokenizer on worker threads and caches the results.

    tokenizer_json: the checkpoint's tokenizer.json path (None: structured output unavailable); vocab_size: the
    model's (masks have a bit per logit, tokens past the tokenizer's vocabulary are never allowed); eos_token_ids: the
    tokens allowed once the output is complete; cache_bytes: the estimated memory the cached compiles may take
    (estimated_compile_bytes each; least recently used specs dropped). A spec's extra compiles (lexer_groups) are
    made only while its own compiles stay within a quarter of that.
    """

    def __init__(
        self,
        tokenizer_json: str | None,
        vocab_size: int,
        eos_token_ids: list[int],
        threads: int = 2,
        lexer_groups: int | None = None,
        cache_bytes: int = CACHE_BYTES,
    ):
        self.tokenizer_json = tokenizer_json if tokenizer_json and os.path.isfile(tokenizer_json) else None
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.mask_words = (vocab_size + 31) // 32
        self.lexer_groups = lexer_groups or default_lexer_groups()
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        # Per spec: (the spec, the futures of its independent compiles (up to lexer_groups, made as requests come),
        # the number of requests handed out, which picks the next one round robin), sized by its compiles.
        self._cache: ByteBudgetLRU[tuple[StructuredOutput, list[Future], list[int]]] = ByteBudgetLRU(
            cache_bytes, lambda _, entry: len(entry[1]) * estimated_compile_bytes(entry[0])
        )

    @property
    def available(self) -> bool:
        return self.tokenizer_json is not None

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:  # built once (about a second for a 150k vocabulary), on the first compile
            if self._tokenizer is None:
                with open(self.tokenizer_json, encoding="utf-8") as f:
                    text = f.read()
                self._tokenizer = llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
            return self._tokenizer

    def _compile(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), llguidance_grammar(structured, tuple(self.eos_token_ids)), log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"invalid {structured.kind.replace('_', ' ')}: {matcher.get_error()}", structured.field)
        return matcher

    def submit(self, structured: StructuredOutput) -> Future:
        """A future of a compiled grammar for one request (`matcher` makes the request's own from it): the spec's
        compiles are shared round robin by the requests with that spec (see default_lexer_groups). Compiles on a
        worker thread unless that compile is cached."""
        if not self.available:
            raise InvalidRequestError("structured output needs the checkpoint's tokenizer.json", structured.field)
        key = structured.key
        with self._lock:
            entry = self._cache.get(key)
            if entry is None:
                entry = (structured, [], [0])
            _, futures, handed = entry
            group = handed[0] % self.lexer_groups
            handed[0] += 1
            room = self._cache.budget_bytes // 4 >= (len(futures) + 1) * estimated_compile_bytes(structured)
            if group >= len(futures) and (room or not futures):  # (> only when lexer_groups grew since the spec came)
                group = len(futures)
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="fastqwen-grammar")
                with _thread_stack(COMPILE_STACK_BYTES):  # (the pool starts its threads inside submit)
                    futures.append(self._pool.submit(self._compile, structured))
                self._cache.put(key, entry)  # (re)sized by its compiles; may drop least recently used specs
            chosen = futures[group % len(futures)]
            if not chosen.done():  # while it compiles, a finished compile serves (the request need not wait)
                chosen = next((f for f in futures if f.done() and f.exception() is None), chosen)
            return chosen

    def compiles_of(self, structured: StructuredOutput) -> list[Future]:
        """The cached compiles of a spec (none once it was dropped from the cache), for tests and diagnostics."""
        entry = self._cache.get(structured.key)
        return list(entry[1]) if entry is not None else []

    @property
    def cached_bytes(self) -> int:
        """The estimated memory of the compiles the cache holds (within cache_bytes)."""
        return self._cache.total_bytes

    @staticmethod
    def matcher(compiled: Future) -> GrammarMatcher:
        """A fresh matcher of a finished compile (raises its error if it failed)."""
        return GrammarMatcher(compiled.result().deep_copy())

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
