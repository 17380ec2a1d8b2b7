"""Prompt lookup (the `ngram` method): draft the tokens that followed the latest earlier occurrence of the sequence's
last n tokens, for n from prompt_lookup_max down to prompt_lookup_min.

Each request keeps an index from every n-gram of its tokens to where its latest occurrence ended, extended as tokens
are committed (a few dictionary writes per token), so a lookup costs the same at 100 tokens as at 100,000.
"""

from __future__ import annotations


class NgramIndex:
    """The n-grams of one token sequence, n_min <= n <= n_max: gram -> the position just after its latest occurrence,
    for every occurrence that is followed by at least one token (the sequence's own tail never matches itself)."""

    __slots__ = ("n_min", "n_max", "grams", "indexed")

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.grams: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # grams ending at positions < indexed are in

    def extend(self, tokens: list[int]) -> None:
        """Index the grams that end before the last token (followed by something) and are not in yet."""
        grams = self.grams
        for end in range(max(self.indexed, self.n_min), len(tokens)):
            for n in range(self.n_min, min(self.n_max, end) + 1):
                grams[tuple(tokens[end - n : end])] = end
        self.indexed = max(self.indexed, len(tokens))

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens following the latest earlier occurrence of the longest matching tail."""
        for n in range(min(self.n_max, len(tokens) - 1), self.n_min - 1, -1):
            end = self.grams.get(tuple(tokens[len(tokens) - n :]))
            if end is not None:
                return tokens[end : end + k]
        return []


class NgramDrafter:
    def __init__(self, num_tokens: int, n_min: int, n_max: int):
        self.num_tokens = num_tokens
        self.n_min, self.n_max = n_min, n_max
        self._indexes: dict[int, NgramIndex] = {}

    def propose(self, rid: int, tokens: list[int], num_prompt_tokens: int, limit: int) -> tuple[list[int], float]:
        """A draft of at most min(num_tokens, limit) tokens to follow `tokens`, and its score (its length)."""
        index = self._indexes.get(rid)
        if index is None:
            index = self._indexes[rid] = NgramIndex(self.n_min, self.n_max)
        index.extend(tokens)
        draft = index.lookup(tokens, min(self.num_tokens, limit))
        return draft, float(len(draft))

    def finish(self, rid: int, tokens: list[int], num_prompt_tokens: int) -> None:
        self._indexes.pop(rid, None)
