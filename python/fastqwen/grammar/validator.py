"""Grammar validation where a crash costs one request: llguidance runs in small long-lived worker processes.

A grammar that crashes llguidance (a segfault: a stack overflow deep in its compile, which no Python code can catch)
kills the worker that validated it, never the server. The request that sent it gets a clear InvalidRequestError, the
worker is started again for the next one, and the verdict is cached with the others (spec.check_structured), so the
same spec does not kill a worker twice.

The workers validate as the engine compiles (validator_worker.py: the same grammar text, the same tokenizer, plus the
first mask), on a thread whose stack is a quarter of the engine's compile threads' (compiler.COMPILE_STACK_BYTES): the
crash seen is a stack overflow whose depth grows with the grammar, so whatever validates here compiles there.

Workers start on first use (about 0.1 s, plus about a second to read a 150k-token tokenizer once per worker), at most
MAX_WORKERS of them; a request waits for a free one. One that takes longer than VALIDATION_TIMEOUT_S is killed.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading

VALIDATOR_STACK_BYTES = 16 << 20  # see bounds.py for the depths this allows
MAX_WORKERS = 2  # validations at once (each a process holding llguidance and the tokenizer: 170 MB with Qwen3's)
# llguidance's own fuel limits end a normal compile in well under a second; this catches anything else.
VALIDATION_TIMEOUT_S = 60.0

_WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "validator_worker.py")


class ValidatorCrashed(Exception):
    """The worker died validating a grammar (or did not answer in time)."""


class _Worker:
    def __init__(self):
        self.proc = subprocess.Popen(
            [sys.executable, _WORKER_SCRIPT, str(VALIDATOR_STACK_BYTES)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            encoding="utf-8",
        )
        self.replies: queue.Queue = queue.Queue()
        # A reader thread turns the pipe into a queue, so that waiting for a reply can time out.
        threading.Thread(target=self._read, daemon=True, name="fastqwen-grammar-validator").start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.replies.put(json.loads(line))
        self.replies.put(None)  # the pipe closed: the process ended

    def ask(self, grammar: str, tokenizer: tuple | None, timeout: float) -> str | None:
        try:
            self.proc.stdin.write(json.dumps({"grammar": grammar, "tokenizer": tokenizer}) + "\n")
            self.proc.stdin.flush()
            reply = self.replies.get(timeout=timeout)
        except (OSError, ValueError):  # the pipe broke: the process had died
            reply = None
        except queue.Empty:
            self.kill()
            raise ValidatorCrashed(f"validating it took longer than {timeout:g} s") from None
        if reply is None:
            self.kill()
            raise ValidatorCrashed("it crashed the grammar validator")
        return reply["error"]

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


class GrammarValidator:
    """A pool of up to `workers` validator processes, started as needed; one that dies is replaced in the background
    (with the last tokenizer read again), so the request after a crash does not wait for the restart."""

    def __init__(self, workers: int = MAX_WORKERS, timeout: float = VALIDATION_TIMEOUT_S):
        self.timeout = timeout
        self.workers = workers
        # Last in, first out: a live worker (its tokenizer read) is reused before an empty slot starts another.
        self._idle: queue.LifoQueue[_Worker | None] = queue.LifoQueue()
        for _ in range(workers):
            self._idle.put(None)  # a slot whose worker starts when first taken
        self._last_tokenizer: list | None = None
        self.num_crashes = 0

    def validate(self, grammar: str, tokenizer: tuple | None = None) -> str | None:
        """Why llguidance cannot use the grammar (None: it can); tokenizer: (tokenizer.json path, vocab size, eos ids)
        to compile it as the engine will. Raises ValidatorCrashed if the grammar crashed or stalled the worker."""
        tokenizer = list(tokenizer) if tokenizer is not None else None
        if tokenizer is not None:
            self._last_tokenizer = tokenizer
        worker = self._idle.get()
        try:
            if worker is None or not worker.alive:
                if worker is not None:
                    worker.kill()  # (reaps it and closes its pipes)
                worker = _Worker()
            reply = worker.ask(grammar, tokenizer, self.timeout)
        except ValidatorCrashed:
            self.num_crashes += 1
            threading.Thread(target=self._replace, daemon=True).start()
            raise
        except BaseException:
            self._idle.put(None)
            raise
        self._idle.put(worker)
        return reply

    def warm(self, tokenizer: tuple | None) -> None:
        """Start the workers not started yet and have them read the tokenizer, in the background (so that neither
        the first request nor the one after a crash waits for that)."""
        tokenizer = list(tokenizer) if tokenizer is not None else None
        if tokenizer is not None:
            self._last_tokenizer = tokenizer
        for _ in range(self.workers):
            threading.Thread(target=self._replace, args=(True,), daemon=True).start()

    def _replace(self, only_if_empty: bool = False) -> None:
        tokenizer = self._last_tokenizer
        if only_if_empty:
            worker = self._idle.get()
            if worker is not None:
                self._idle.put(worker)
                return
        try:
            worker = _Worker()
            if tokenizer is not None:
                worker.ask(None, tokenizer, self.timeout)  # reads the tokenizer, validates nothing
        except Exception:  # noqa: BLE001 - the slot stays empty: the next request starts its worker itself
            worker = None
        self._idle.put(worker)

    def close(self) -> None:
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                return
            if worker is not None:
                worker.kill()


_default: GrammarValidator | None = None
_default_lock = threading.Lock()


def default_validator() -> GrammarValidator:
    global _default
    with _default_lock:
        if _default is None:
            _default = GrammarValidator()
        return _default
