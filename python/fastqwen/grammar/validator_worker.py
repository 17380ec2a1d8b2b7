"""The grammar validator's worker process (started by validator.py as a script: it imports llguidance, not fastqwen).

Reads one JSON request a line on stdin: {"grammar": llguidance grammar text (null: only read the tokenizer),
"tokenizer": [tokenizer.json path, vocab size, [eos ids]] or null}; writes one JSON line back: {"error": null} when
the grammar compiles (against the tokenizer, as the engine will compile it, and its first mask leaves something to
generate), else {"error": why}.
A grammar that crashes llguidance kills only this process; the parent sees the pipe close and starts another.

argv[1]: the stack size (bytes) of the thread that runs llguidance, which is what decides how deep a grammar can
recurse before it crashes; the engine compiles on a larger one, so what passes here cannot crash it that way.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading

import llguidance

_tokenizers: dict[tuple, llguidance.LLTokenizer] = {}


def _tokenizer(path: str, vocab_size: int, eos: list[int]) -> llguidance.LLTokenizer:
    key = (path, vocab_size, tuple(eos))
    if key not in _tokenizers:
        with open(path, encoding="utf-8") as f:
            _tokenizers[key] = llguidance.LLTokenizer(f.read(), n_vocab=vocab_size, eos_token=list(eos))
    return _tokenizers[key]


def validate(grammar: str, tokenizer: list | None) -> str | None:
    """Why the grammar cannot be used (None: it can). No grammar: only read the tokenizer (a warm-up)."""
    if grammar is None:
        if tokenizer is not None:
            _tokenizer(*tokenizer)
        return None
    if tokenizer is None:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        return (messages[0] if messages else "it does not compile") if is_error else None
    path, vocab_size, eos = tokenizer
    matcher = llguidance.LLMatcher(_tokenizer(path, vocab_size, eos), grammar, log_level=0)
    if matcher.is_error():
        return matcher.get_error()
    # The first mask: a grammar whose language is empty (an unsatisfiable $ref cycle, `[^\s\S]`) compiles but
    # errs here, before any token; the engine would otherwise end the request with an empty "successful" output.
    matcher.compute_bitmask()
    if matcher.is_error():
        return "no output satisfies it (" + matcher.get_error().splitlines()[0] + ")"
    return None


def _serve(requests: queue.Queue, replies: queue.Queue) -> None:
    while True:
        grammar, tokenizer = requests.get()
        try:
            replies.put({"error": validate(grammar, tokenizer)})
        except Exception as e:  # noqa: BLE001 - any failure is the grammar's (or tokenizer's) error, reported back
            replies.put({"error": f"{type(e).__name__}: {e}"})


def main() -> None:
    threading.stack_size(int(sys.argv[1]))
    requests: queue.Queue = queue.Queue()
    replies: queue.Queue = queue.Queue()
    threading.Thread(target=_serve, args=(requests, replies), daemon=True).start()
    parent = os.getppid()
    for line in sys.stdin:
        request = json.loads(line)
        requests.put((request["grammar"], request["tokenizer"]))
        while True:  # wait for the answer, ending with the parent if it goes first (stdin alone says so only later)
            try:
                reply = replies.get(timeout=1.0)
                break
            except queue.Empty:
                if os.getppid() != parent:
                    os._exit(0)
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
