"""What crosses the engine's boundary, and nothing else: requests go in as token ids plus sampling parameters, and
each step comes out as one StepOutput holding every advanced request's new token ids (and logprobs).

The engine never sees text and the frontend (server, offline LLM) never sees tensors, the scheduler's Request or the
KV pool. These are plain dataclasses of ints, floats, strings and lists, so the engine-core process can send them as
they are (encoded, never pickled).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..config import GenerationDefaults
from ..pooling import PoolingParams
from ..sampling_params import SamplingParams


@dataclass
class EngineRequest:
    """Add a request: validated by the frontend (EngineInfo.check_request) before it is sent."""

    rid: int
    prompt_ids: list[int]
    params: SamplingParams  # every default filled, max_tokens set
    arrival_time: float  # time.monotonic() when the frontend received it
    # A prefill-only request (pooling.py): its result comes back in RequestDelta.pooled, and no token is generated.
    pooling: PoolingParams | None = None


@dataclass
class TokenLogprobs:
    """The logprob of a sampled token and the most likely alternatives at that step, from the raw logits."""

    token: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None  # 1-based rank of `token` in its distribution, where computed (prompt logprobs)


@dataclass
class RequestDelta:
    """What one step did for one request."""

    rid: int
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None  # one per new token when the request asked for logprobs
    finish_reason: str | None = None  # "stop", "length", "abort" or "error" once the engine has finished it
    stop_reason: int | None = None  # the EOS or stop token id, for finish_reason "stop"
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache at admission
    first_scheduled_time: float | None = None  # time.monotonic() when it was first admitted
    error: str | None = None  # for finish_reason "error": what went wrong
    # With the first token of a request that asked for prompt logprobs: one per prompt position from
    # max(params.prompt_logprobs_start, 1) on (the first prompt token has none).
    prompt_logprobs: list[TokenLogprobs] | None = None
    # A pooling request's result, in its finishing delta: the normalized embedding, or the score's probabilities.
    pooled: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepOutput:
    """One engine step: a delta for every request that advanced or finished."""

    deltas: list[RequestDelta]
    time: float  # time.monotonic() when the step ended
    num_tokens: int = 0  # tokens the step computed (prefill chunks and decodes)


@dataclass
class EngineStats:
    """Counters and gauges of the engine, read by metrics and health checks."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV pages held by requests (cache-only pages count as free)
    num_preemptions: int = 0
    num_computed_tokens: int = 0  # tokens of every step that ran: prefill work actually done, plus decodes
    num_ahead_steps: int = 0  # decode steps launched ahead by the overlap schedule
    # Speculative decoding (vLLM's spec_decode counters): verify steps of one request, draft tokens proposed and
    # accepted, and the accepted count at each draft position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    num_cached_pages: int = 0  # pages the prefix cache holds (what a KV-event subscriber's rebuilt set must count)


@dataclass
class EngineInfo:
    """What the frontend must know of the engine to validate requests and describe the model: fixed at startup."""

    model: str
    vocab_size: int
    max_model_len: int
    num_pages: int  # KV pages in the pool
    page_size: int  # tokens per page
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    prefix_caching: bool = True
    dtype: str = ""  # of weights and KV, e.g. "bfloat16"
    device: str = ""  # e.g. "cuda:0"
    kv_bytes: int = 0  # the KV pool's size in bytes
    # Benchmark-only speculative decoding (synthetic_acceptance_length): outputs are not the model's, so requests
    # that rely on what sampling guarantees (a seed's reproducibility, logprobs) are refused.
    synthetic_speculation: bool = False
    # Passed through from EngineConfig for the frontend (the engine never reads them): the tokenizer folder, when not
    # the model's, and a chat template that replaces the tokenizer's.
    tokenizer: str | None = None
    chat_template: str | None = None
    task: str = "generate"  # what the engine serves: generate, embed or score (pooling.py)
    hidden_size: int = 0  # the length of an embedding


# ---- several front ends (--api-server-count N) ------------------------------------------------------------------
# Request ids are partitioned among the front ends, so that an engine core knows from an id alone whose request it is
# (its deltas go to that front end only) and two front ends never use the same id.


@dataclass
class RoutedPrompts:
    """Data parallelism with several front ends: the page hashes (engine/replica_router.py's page_hashes, one list per
    prompt) of the prompts that front end `frontend` routed to one replica. That replica's core passes them on to the
    other front ends, so that every front end's estimate of the replica's cache covers every front end's prompts, not
    only its own share of them (prefix affinity would weaken with each front end added otherwise)."""

    frontend: int
    page_hashes: list[list[int]]


def request_ids(frontend: int, num_frontends: int) -> Iterator[int]:
    """The ids front end `frontend` of `num_frontends` gives its requests: frontend, frontend + N, ..."""
    return itertools.count(frontend, num_frontends)


def frontend_of(rid: int, num_frontends: int) -> int:
    """The front end that owns request `rid`."""
    return rid % num_frontends
