"""Structured output: StructuredOutput specs (sampling_params.py) compiled by llguidance into matchers over the
model's tokenizer, and the per-step token bitmasks the samplers apply.

- `spec.py`: a spec to llguidance's grammar text, and `check_structured` (the frontend's validation: a bad schema,
  regex or grammar is an InvalidRequestError naming the request field, before anything reaches the engine).
- `bounds.py`: the limits a spec must keep before llguidance sees it (size, rules, nesting, `$ref`s), under the
  depths at which its recursive compile overflows the stack.
- `validator.py` + `validator_worker.py`: the frontend's validation runs in worker processes, so that a spec that
  crashes llguidance costs one request; `lru.py`: the byte-bounded LRU map the grammar caches use.
- `compiler.py`: `GrammarCompiler`, the engine's: compiles on worker threads (never inside a step), caches the
  compiled grammar by (kind, spec, strict), hands each request its own `GrammarMatcher`, which computes the mask of
  each state ahead on a worker thread (outside the GIL) for the samplers to copy; `fill_bitmasks` computes several
  matchers' masks at once (llguidance's executor), for tests and benchmarks.
- `forced_text.py`: text a grammar forces that spells an added token (`</think>`) comes out as ordinary tokens, where
  llguidance would offer the added token and then refuse it.
- `tool_calls.py`: the spec that forces Qwen3's <tool_call> blocks for tool_choice "required" or a named function.

Token ids only: no text of requests, no tensors (masks are filled into caller-owned int32 host memory).
"""

from .compiler import GrammarCompiler, GrammarMatcher, copy_masks, fill_bitmasks
from .spec import check_structured, check_tokenizer, llguidance_grammar
from .tool_calls import tool_call_structured

__all__ = [
    "GrammarCompiler",
    "GrammarMatcher",
    "check_structured",
    "check_tokenizer",
    "copy_masks",
    "fill_bitmasks",
    "llguidance_grammar",
    "tool_call_structured",
]
