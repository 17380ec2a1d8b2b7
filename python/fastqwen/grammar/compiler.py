"""The engine's grammar side: compile off the step (worker threads), cache by spec, one matcher per request, and the
step's bitmasks computed in parallel (requests with one spec spread over independent compiles, so that their masks
can be)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait

import llguidance
import numpy as np

from ..errors import InvalidRequestError
from ..sampling_params import StructuredOutput
from .forced_text import repair_forced_mask
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
    (scheduler.request.TokenConstraint) and decodes the request only while its mask is `ready`; the sampler copies
    the mask (`copy_mask`) into its row before each draw.

    With `ahead` (the engine's matchers), the mask of each state is computed on a worker thread (mask_pool; llguidance
    releases the GIL) as soon as the state is reached: at creation and after each token `advance` takes, so that a
    slow mask delays its own request and not the step. `version` counts the tokens taken; the mask is stamped with the
    version it was computed for, and `copy_mask` refuses one of another state. Without `ahead`, copy_mask computes
    the mask when asked (tests, tools).

    tokenizer: the one the grammar was compiled for, to repair a mask that offers only a token the grammar refuses
    (forced_text.py); None leaves llguidance's masks as they are.
    """

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        mask_words: int,
        ahead: bool = False,
        tokenizer: llguidance.LLTokenizer | None = None,
    ):
        self.matcher = matcher
        self.tokenizer = tokenizer
        self.error: str | None = None  # why the grammar gave up, once it has: the request then ends with an error
        self.version = 0  # tokens taken: the state the next mask belongs to
        self._ahead = ahead
        self._mask = np.zeros(mask_words, dtype=np.int32)
        self._mask_version = -1  # the state self._mask was computed for
        self._job: Future | None = None  # the computation of the current state's mask (None: not started)
        if ahead:
            self._start_mask()

    def advance(self, token: int) -> bool:
        """Take a committed token; False once nothing more can follow: the output is complete, or the grammar gave
        up (`error` says why). It gives up when no continuation can satisfy it (a schema whose instances are all
        infinite: its mask errs and lets through only EOS) or when a token outside it was committed (the masks
        make that impossible)."""
        self._settle()  # the matcher is never moved while a mask is computed from it
        self._job = None
        self.version += 1
        if not self.matcher.consume_token(token) or self.matcher.is_error():
            reason = self.matcher.get_error().strip().splitlines()
            self.error = "the output cannot satisfy the grammar" + (f" ({reason[0][:300]})" if reason else "")
            log.info("a grammar gave up: %s", self.error)
            return False
        if self.matcher.is_stopped():
            return False
        if self._ahead:
            self._start_mask()
        return True

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()

    @property
    def ready(self) -> bool:
        """Whether the current state's mask can be copied without waiting (always, without `ahead`: it is computed
        when copied)."""
        return self._job is None or self._job.done()

    @property
    def pending(self) -> Future | None:
        """The computation of the current state's mask while it runs, for waits on several requests at once."""
        return self._job if self._job is not None and not self._job.done() else None

    def copy_mask(self, out: np.ndarray) -> None:
        """Write the current state's allowed-token bitmask into out [ceil(vocab / 32)] int32 (waits for it if it is
        still being computed; raises the computation's error)."""
        if self._job is None:
            self._start_mask()
        self._job.result()
        if self._mask_version != self.version:  # a mask of another state would let through what this one forbids
            raise RuntimeError(
                f"stale grammar mask: computed after {self._mask_version} tokens, the grammar has taken {self.version}"
            )
        out[:] = self._mask

    # ---- speculative decoding: drafts checked against the grammar, masks of the positions after them ------------

    def draftable(self, draft: list[int]) -> int:
        """How many leading draft tokens the grammar allows without completing: a verify step samples the position
        after each, so the state after each must still take a token. The matcher is left where it was."""
        self._settle()
        allowed = self.matcher.validate_tokens(list(draft))
        consumed = kept = 0
        try:
            for token in draft[:allowed]:
                if not self.matcher.consume_token(token):
                    break
                consumed += 1
                if self.matcher.is_stopped() or self.matcher.is_error():
                    break
                kept += 1
        finally:
            if consumed:
                self.matcher.rollback(consumed)
        return kept

    def copy_draft_mask(self, draft: tuple[int, ...], out: np.ndarray) -> None:
        """The mask of the state after the draft's tokens (all allowed: see draftable) into out, the matcher left
        where it was."""
        self._settle()
        if draft and self.matcher.try_consume_tokens(list(draft)) != len(draft):
            raise RuntimeError("a draft token the grammar does not allow reached a verify step")
        try:
            self.matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
            self._repair(out)
        finally:
            if draft:
                self.matcher.rollback(len(draft))

    def _start_mask(self) -> None:
        self._job = _mask_pool().submit(self._compute_mask, self.version)

    def _compute_mask(self, version: int) -> None:
        """On a mask thread: llguidance fills the request's own buffer (outside the GIL)."""
        self.matcher.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        self._repair(self._mask)
        self._mask_version = version

    def _repair(self, mask: np.ndarray) -> None:
        if self.tokenizer is not None:
            repair_forced_mask(self.matcher, self.tokenizer, mask)

    def _settle(self) -> None:
        """Wait for a mask in flight (before the matcher is used from another thread)."""
        if self._job is not None:
            wait([self._job])


def copy_masks(rows: list[tuple[GrammarMatcher, int]], out: np.ndarray) -> None:
    """The samplers' one way to take the step's masks: each matcher's mask, computed ahead, into row `index` of out
    [R, ceil(vocab / 32)] int32 (waiting for any still being computed)."""
    for matcher, index in rows:
        matcher.copy_mask(out[index])


def fill_bitmasks(rows: list[tuple[GrammarMatcher, int]], out: np.ndarray) -> None:
    """Write each matcher's allowed-token bitmask into row `index` of out [R, ceil(vocab / 32)] int32 (C-contiguous,
    e.g. a pinned buffer's numpy view), all rows in parallel outside the GIL. (The engine's samplers copy the masks
    each matcher computed ahead instead: GrammarMatcher.copy_mask.)"""
    if not rows:
        return
    if out.dtype != np.int32 or out.ndim != 2 or not out.flags["C_CONTIGUOUS"]:
        raise ValueError("fill_bitmasks: out must be a C-contiguous int32 [rows, words] array")
    if any(not 0 <= i < out.shape[0] for _, i in rows):
        raise ValueError("fill_bitmasks: a row index is outside out")
    for m, _ in rows:
        m._settle()
    _executor().unsafe_compute_mask_ptr(
        [(m.matcher, i) for m, i in rows], out.ctypes.data, out.shape[1] * 4, out.shape[0]
    )
    for m, i in rows:
        m._repair(out[i])


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
_mask_threads: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def _mask_pool() -> ThreadPoolExecutor:
    """The threads that compute masks ahead, one mask per job (as many as llguidance's executor would use)."""
    global _mask_threads
    with _executor_lock:
        if _mask_threads is None:
            _mask_threads = ThreadPoolExecutor(default_lexer_groups(), thread_name_prefix="fastqwen-mask")
        return _mask_threads


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
        matcher = llguidance.LLMatcher(
            self._llg_tokenizer(), llguidance_grammar(structured, tuple(self.eos_token_ids)), log_level=0
        )
        if matcher.is_error():
            raise InvalidRequestError(
                f"invalid {structured.kind.replace('_', ' ')}: {matcher.get_error()}", structured.field
            )
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

    def matcher(self, compiled: Future, ahead: bool = False) -> GrammarMatcher:
        """A fresh matcher of a finished compile (raises its error if it failed); `ahead`: it computes each mask as
        soon as its state is reached (GrammarMatcher), starting with the first."""
        return GrammarMatcher(compiled.result().deep_copy(), self.mask_words, ahead, self._llg_tokenizer())

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
