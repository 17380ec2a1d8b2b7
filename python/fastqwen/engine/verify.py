"""Verifying drafts: the sampling rows of a step whose chunks carry drafts, and the tokens each chunk emits.

A chunk with a draft of k tokens has 1 + k sampling rows: row 0 at the request's last token, row i after the draft's
first i tokens. The sampler sees row i as the request with those i tokens committed (`DraftRow`): its step (the seed
of each draw), its min_tokens bans, its output so far (what its penalties count) and its grammar's mask are those of
position i, so each row is drawn exactly as plain decoding would draw that position. The speculator then keeps the
run of draft tokens the target agrees with.
"""

from __future__ import annotations

from ..scheduler import Request, ScheduledBatch


class DraftMask:
    """The grammar mask of a verified position: the request's matcher's state after the draft's tokens, computed when
    the sampler copies it (GrammarMatcher.copy_draft_mask; the matcher is left where it was)."""

    __slots__ = ("matcher", "draft")
    error = None
    ready = True
    pending = None

    def __init__(self, matcher, draft: tuple[int, ...]):
        self.matcher, self.draft = matcher, draft

    def copy_mask(self, out) -> None:
        self.matcher.copy_draft_mask(self.draft, out)


class DraftRow:
    """A request seen `len(draft)` tokens later, with the draft's tokens committed: what the sampler reads of a
    verified position (parameters, step, output so far, grammar mask)."""

    __slots__ = ("request", "draft", "grammar")

    def __init__(self, request: Request, draft: tuple[int, ...], mask_draft: tuple[int, ...] | None = None):
        """mask_draft: the draft tokens its grammar mask follows (all of `draft` unless the rest is filler)."""
        self.request = request
        self.draft = draft
        # The scheduler drafts only tokens the grammar allows (Speculator.propose): this state takes a token.
        mask_draft = draft if mask_draft is None else mask_draft
        self.grammar = DraftMask(request.grammar, mask_draft) if request.grammar is not None else None

    @property
    def params(self):
        return self.request.params

    @property
    def sampler(self):
        return self.request.sampler  # seed and packed row are the request's

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_ids

    @property
    def output_ids(self) -> list[int]:
        return self.request.output_ids + list(self.draft)

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + len(self.draft)

    @property
    def finished(self) -> bool:
        return self.request.finished

    @property
    def mask_ready(self) -> bool:
        return True


def sampling_rows(scheduled: ScheduledBatch) -> list:
    """The step's sampling rows in order: each sampling chunk's request, then its draft positions."""
    rows: list = []
    for chunk in scheduled.chunks:
        if chunk.samples:
            rows.append(chunk.request)
            real = len(chunk.real_draft)  # (a filler position draws under the last real one's mask)
            rows += [
                DraftRow(chunk.request, chunk.draft[:i], chunk.draft[: min(i, real)])
                for i in range(1, len(chunk.draft) + 1)
            ]
    return rows


def emitted_tokens(scheduled: ScheduledBatch, tokens: list[int], speculator) -> list[int | list[int]]:
    """Per sampling chunk: its token, or for a chunk with a draft the accepted draft tokens then the target's token
    after them (Scheduler.update's `sampled`). `tokens`: one per sampling row."""
    out: list[int | list[int]] = []
    row = 0
    for chunk in scheduled.chunks:
        if not chunk.samples:
            continue
        if not chunk.draft:
            out.append(tokens[row])
            row += 1
            continue
        targets = tokens[row : row + chunk.num_rows]
        # A request aborted while its step ran (a stop string) gets nothing (Scheduler.update) and counts nothing; a
        # draft's filler (ScheduledChunk.filled_from) is never accepted nor counted.
        real = chunk.real_draft
        n = 0 if chunk.request.finished or not real else speculator.accepted(chunk.request, real, targets)
        out.append([*chunk.draft[:n], targets[n]])
        row += chunk.num_rows
    return out
