"""The speculator: the engine's one object for speculative decoding. It asks the drafter for each decoding request's
draft, decides from the target's tokens how much of it is accepted, steps aside for requests whose drafts keep
failing, and counts what vLLM's spec_decode metrics count.

Acceptance (`accepted`): the target samples a token at every verified position (position i sees the draft's first i
tokens as if committed: its seed, bans, penalty counts and grammar state are those of that position), and draft
token i is accepted while every token before it was and the target drew exactly it. Each emitted token is then a
draw from the target's own distribution given the tokens before it, so the output has the target's distribution
whatever the drafter proposes (this is the rule for drafters that give no probabilities); greedy requests get
exactly the tokens they would get without speculation.

It sees token ids and a request's `rid`, `token_ids`, `prompt_ids`, `grammar` and `cached_len` only (and, for the
eagle3 drafter, the target's hidden states: `observe`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .config import SpeculativeConfig
from .ngram import NgramDrafter
from .suffix import SuffixDrafter

# A request whose last drafts were accepted at less than min_acceptance_rate (over at least this many drafted
# tokens) gets no drafts for PAUSE_STEPS steps, then is tried again.
ACCEPTANCE_WINDOW = 16
PAUSE_STEPS = 32


@dataclass
class SpecDecodeStats:
    """Cumulative counts, as vLLM's spec_decode counters."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per verify step of one request: 1 + accepted drafts on average (0 before any draft)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class _RequestState:
    drafted: int = 0  # in the current window
    accepted: int = 0
    paused: int = 0  # steps left without drafts
    synthetic_credit: float = 0.0


def make_drafter(config: SpeculativeConfig):
    k = config.num_speculative_tokens
    if config.method == "eagle3":
        raise ValueError(
            "the eagle3 drafter needs the target's weights: the engine builds it (engine/eagle3_drafter.py)"
        )
    if config.method == "ngram":
        return NgramDrafter(k, config.prompt_lookup_min, config.prompt_lookup_max)
    return SuffixDrafter(
        k,
        config.suffix_decoding_max_tree_depth,
        config.suffix_decoding_max_cached_requests,
        config.suffix_decoding_max_spec_factor,
        config.suffix_decoding_min_token_prob,
    )


class Speculator:
    def __init__(self, config: SpeculativeConfig, drafter=None):
        """drafter: the eagle3 method's (engine/eagle3_drafter.py), which the engine builds around the target's weights;
        the other methods' are made here."""
        self.config = config
        self.num_tokens = config.num_speculative_tokens
        self.drafter = drafter if drafter is not None else make_drafter(config)
        self.synthetic = config.synthetic_acceptance_length
        self.stats = SpecDecodeStats(accepted_per_position=[0] * self.num_tokens)
        self._states: dict[int, _RequestState] = {}
        # The engine sets it when verify steps replay CUDA graphs, which take drafts of one length: a shorter draft is
        # filled up with the last token (any token is a valid guess; a wrong one is rejected like any other).
        self.pad_drafts = False

    def active(self, num_decoding: int) -> bool:
        """Whether a step with this many running requests verifies drafts (above max_batch_size it never does)."""
        return num_decoding <= self.config.max_batch_size

    def may_draft(self, request) -> bool:
        """Whether the request's next step may carry a draft: any request may (penalties, grammars and seeds are
        honoured at every verified position, engine/verify.py), unless paused for low acceptance (a paused request
        counts the step). Asked by propose, and by the scheduler's overlap schedule, which launches the next step
        before this one's tokens are known only when no request may draft."""
        state = self._states.get(request.rid)
        if state is not None and state.paused and self.synthetic is None:
            state.paused -= 1
            return False
        return True

    def drafts_next(self, request) -> bool:
        """Whether the request's next step would carry a draft as far as acceptance goes (not paused for low
        acceptance); unlike may_draft, it counts nothing. Asked before a chained verify step is launched."""
        state = self._states.get(request.rid)
        return state is None or not state.paused or self.synthetic is not None

    def synthetic_credit(self, request) -> float:
        """The request's forced-acceptance credit (accepted's arithmetic): a chained verify step continues it on the
        device."""
        state = self._states.get(request.rid)
        return state.synthetic_credit if state is not None else 0.0

    def propose(self, request, limit: int) -> tuple[int, ...]:
        """The draft for a decoding request's next step: at most `limit` tokens (what max_tokens and the context leave
        after the token the step samples anyway). (The scheduler fills a draft that verify graphs need longer with
        tokens that are never accepted: ScheduledChunk.filled_from.)"""
        limit = min(limit, self.num_tokens)
        if limit <= 0 or not self.may_draft(request):
            return ()
        self._states.setdefault(request.rid, _RequestState())
        tokens = request.token_ids
        # (A drafter indexes the tokens it has not seen at its next call: nothing is lost while a request is paused.)
        draft, _ = self.drafter.propose(request.rid, tokens, len(request.prompt_ids), limit)
        draft = draft[:limit]
        if self.synthetic is not None or self.pad_drafts:  # (a benchmark's drafts are always full)
            draft = draft + [tokens[-1]] * (limit - len(draft))
        if request.grammar is not None:  # only tokens the grammar allows, none that completes it
            draft = draft[: request.grammar.draftable(draft)]
        return tuple(draft)

    def accepted(self, request, draft: tuple[int, ...], targets: list[int]) -> int:
        """How many leading draft tokens are accepted, given the target's token at each of the 1 + len(draft)
        verified positions; counts them."""
        k = len(draft)
        if self.synthetic is not None:
            state = self._states.setdefault(request.rid, _RequestState())
            state.synthetic_credit += self.synthetic - 1
            n = min(k, int(state.synthetic_credit))
            state.synthetic_credit -= n
        else:
            n = 0
            while n < k and draft[n] == targets[n]:
                n += 1
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += k
        stats.num_accepted_tokens += n
        for i in range(n):
            stats.accepted_per_position[i] += 1
        state = self._states.get(request.rid)
        if state is not None and self.synthetic is None:
            state.drafted += k
            state.accepted += n
            if state.drafted >= ACCEPTANCE_WINDOW:
                if state.accepted < self.config.min_acceptance_rate * state.drafted:
                    state.paused = PAUSE_STEPS
                state.drafted = state.accepted = 0
        return n

    def observe(self, chunks_and_rows, aux_hidden) -> None:
        """A drafter that reads the target's hidden states (eagle3) advances over what a step computed and kept:
        chunks_and_rows gives each chunk of the step with its first token row in aux_hidden [T, ...]. Each request's
        kept positions run from its chunk's start to its cached_len (Scheduler.update has recorded the step); the
        drafter takes them all at once."""
        advance = getattr(self.drafter, "advance_batch", None)
        if advance is None or aux_hidden is None:
            return
        items = []
        for chunk, row in chunks_and_rows:
            request = chunk.request
            kept = request.cached_len - chunk.start
            if request.finished or kept <= 0:
                continue
            items.append((request, chunk.start, aux_hidden[row : row + kept]))
        advance(items)

    def preempt(self, request) -> None:
        """A request was preempted: a drafter that keeps KV of it (eagle3) gives it back, as the target does."""
        release = getattr(self.drafter, "release", None)
        if release is not None:
            release(request.rid)

    def finish(self, request) -> None:
        """A request is done (finished, aborted or failed): drop its state; the drafter may learn from its tokens."""
        self._states.pop(request.rid, None)
        self.drafter.finish(request.rid, request.token_ids, len(request.prompt_ids))
