"""The engine's grammar side: compile off the step (worker threads), cache by spec, one matcher per request, and the
step's bitmasks computed in parallel."""

from __future__ import annotations

import collections
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np

from ..errors import InvalidRequestError
from ..sampling_params import StructuredOutput
from .spec import llguidance_grammar

log = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped)


class GrammarMatcher:
    """One request's position in its grammar. The scheduler calls `advance` with each token it commits
    (scheduler.request.TokenConstraint); the sampler reads the matcher's mask before each draw."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def advance(self, token: int) -> bool:
        """Take a committed token; False once nothing more can follow (the output is complete) or the token broke
        the grammar (the masks make that impossible; logged if it happens)."""
        if not self.matcher.consume_token(token):
            log.warning("a token outside the grammar was committed: %s", self.matcher.get_error())
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
    tokens allowed once the output is complete.
    """

    def __init__(self, tokenizer_json: str | None, vocab_size: int, eos_token_ids: list[int], threads: int = 2):
        self.tokenizer_json = tokenizer_json if tokenizer_json and os.path.isfile(tokenizer_json) else None
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.mask_words = (vocab_size + 31) // 32
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple, Future] = collections.OrderedDict()

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
        """A future of the compiled grammar (shared by every request with the same spec; `matcher` makes a request's
        own). Compiles on a worker thread unless it is cached."""
        if not self.available:
            raise InvalidRequestError("structured output needs the checkpoint's tokenizer.json", structured.field)
        key = structured.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="fastqwen-grammar")
            future = self._pool.submit(self._compile, structured)
            self._cache[key] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return future

    @staticmethod
    def matcher(compiled: Future) -> GrammarMatcher:
        """A fresh matcher of a finished compile (raises its error if it failed)."""
        return GrammarMatcher(compiled.result().deep_copy())

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
