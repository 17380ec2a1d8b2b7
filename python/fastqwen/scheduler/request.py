"""A request's state: its tokens, how many of them have valid KV, its pages, and why it stopped."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol

from ..pooling import PoolingParams
from ..sampling_params import SamplingParams


class RequestState(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and queued again for recompute
    RUNNING = "running"  # holds pages; prefilling in chunks or decoding
    FINISHED = "finished"


@dataclass
class SamplerState:
    """What the engine's sampler keeps for a request between steps (engine/sampler.py); the scheduler never reads it."""

    seed: int | None = None  # the seed drawn once for a request that gave none
    slot: int | None = None  # its row of the penalty counts table
    counted: int = -1  # how many of its output tokens that row has counted (the one in flight included)
    row: object | None = None  # its packed sampler row (numpy, step 0, no slot, no bans), packed once
    # After a verify step, until the sampler's next step settles it: (output tokens before that step, the counts row
    # of each verified position), the row of position i counting the draft's first i tokens and that position's draw.
    verified: tuple[int, tuple[int, ...]] | None = None


class TokenConstraint(Protocol):
    """A request's grammar (grammar.GrammarMatcher): the sampler masks what it forbids; the scheduler feeds it each
    committed token and stops the request once the grammar has ended (with an error if it gave up). The mask of each
    state is computed off the step, on a worker thread, while the next step's forward runs; a row whose mask is not
    `ready` by the time its step samples is dropped from that step (`mask_missed`), and the scheduler leaves the
    request out (keeping its pages) until the mask is ready, so the rest of the batch goes on."""

    error: str | None  # set when the grammar gave up: the request ends with FinishReason.ERROR

    @property
    def ready(self) -> bool:
        """Whether the mask for the next token is computed."""
        ...

    def advance(self, token: int) -> bool:
        """Take a committed token; False once nothing more can follow."""
        ...


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an EOS or stop token
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"
    ERROR = "error"  # a step it was in failed, or its grammar gave up


@dataclass
class Request:
    rid: int
    prompt_ids: list[int]
    params: SamplingParams  # already resolved against the checkpoint's defaults
    arrival: int  # admission order; preemption takes the newest first
    token_ids: list[int] = field(default_factory=list)  # prompt then outputs
    state: RequestState = RequestState.WAITING
    cached_len: int = 0  # token_ids[:cached_len] have valid KV in this request's pages
    pages: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None  # the EOS or stop token id that ended it
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache at first admission
    cache_node: object | None = None  # the prefix-cache node this request has locked (its path is kept)
    cached_in_tree: int = 0  # tokens of this request's prefix already inserted in the cache
    # Tokens whose KV pages stay held past a trim: a chained verify step in flight writes that far at most
    # (Scheduler.reserve_ahead).
    reserved_len: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None  # when it was first admitted: queue time = this - arrival_time
    sampler: SamplerState = field(default_factory=SamplerState)
    # Prompt logprobs (params.prompt_logprobs): the next prompt position whose logprob is still to be computed, and
    # those computed but not yet sent (they go out with the request's first token). The model runner fills them.
    prompt_logprob_next: int = 0
    pending_prompt_logprobs: list = field(default_factory=list)
    grammar: TokenConstraint | None = None  # structured output: set (compiled) before the request is scheduled
    mask_missed: bool = False  # a step dropped its row for want of its grammar's mask (cleared with its next token)
    # A prefill-only request (pooling.py): it finishes at the step that computes its last prompt token, whose result
    # the model runner puts in `pooled`; it is never sampled.
    pooling: PoolingParams | None = None
    pooled: list[float] | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprob_next = max(self.params.prompt_logprobs_start, 1)  # the first token has none
        else:
            self.prompt_logprob_next = len(self.prompt_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Some prompt positions still need their logits computed."""
        return self.prompt_logprob_next < len(self.prompt_ids)

    @property
    def reusable_prefix(self) -> int:
        """How many leading tokens may come from the prefix cache: all but the last, and none whose logits a prompt
        logprob still needs (the logprob of position p comes from the logits at p - 1)."""
        limit = len(self.token_ids) - 1
        if self.wants_prompt_logprobs:
            limit = min(limit, self.prompt_logprob_next - 1)
        return limit

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def mask_ready(self) -> bool:
        """Whether a step may sample this request's next token now: it has no grammar, or its mask is computed."""
        return self.grammar is None or self.grammar.ready

    @property
    def waits_for_mask(self) -> bool:
        """Its grammar's mask missed a step (the step dropped the row) and is still not ready: the scheduler leaves
        the request's sampling chunk out until it is."""
        return self.mask_missed and not self.mask_ready

    @property
    def uncomputed(self) -> int:
        """Tokens whose KV is still to be computed; the last of them is the one that samples the next token."""
        return len(self.token_ids) - self.cached_len

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED
