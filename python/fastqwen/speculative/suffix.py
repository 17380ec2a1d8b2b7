"""Suffix decoding (the `suffix` method, after Arctic Inference's): drafts from suffix trees of token sequences.

Two trees, each a trie of every substring of its sequences up to a depth D, with a count on each node (how many
times that substring occurs):
- a tree per request over its own prompt (the last PROMPT_TOKENS_INDEXED of it) and its output so far, extended
  as tokens are committed (O(D) per token: the open suffixes each take one step);
- one global tree over the last `max_cached_requests` finished requests (the tail of each prompt and the whole
  output), for the repetition across requests that agents and replays produce.

To draft, the longest tail of the sequence that is a path of the tree is found (at most D - k tokens, leaving the
draft room below it) and followed
down the most frequent children while the path's probability (the product of count(child) / count(parent)) stays at
least min_token_prob, for at most factor x (match length) tokens: a long match earns a long draft. Of the two trees'
drafts the one with the larger score (the sum of its tokens' path probabilities) is used.
"""

from __future__ import annotations

import collections
import math

# A request's own tree indexes this much of its prompt: enough for the repetition inside an agent turn, at a bounded
# cost for 100k-token prompts (the ngram method looks up the whole prompt).
PROMPT_TOKENS_INDEXED = 4096


class _Node:
    __slots__ = ("count", "children")

    def __init__(self):
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTree:
    """Every substring of length <= depth of the sequences added, with occurrence counts."""

    def __init__(self, depth: int):
        self.depth = depth
        self.root = _Node()

    def add(self, tokens: list[int], sign: int = 1) -> None:
        """Insert (sign 1) or remove (sign -1, for a sequence inserted before) every substring."""
        depth = self.depth
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start : start + depth]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                child.count += sign
                if child.count <= 0:
                    del node.children[token]
                    break
                node = child

    def match(self, tokens: list[int], room: int = 1) -> tuple[_Node | None, int]:
        """The node of the longest tail of tokens that is a path with a continuation, and its length: at most
        depth - room tokens, so that paths below it can be `room` tokens long. (In a request's own tree the whole
        tail is always a path, often with nothing after it.)"""
        for length in range(min(self.depth - room, len(tokens)), 0, -1):
            node = self.root
            for token in tokens[len(tokens) - length :]:
                node = node.children.get(token)
                if node is None:
                    break
            else:
                if node.children:
                    return node, length
        return None, 0

    def draft(self, tokens: list[int], max_tokens: int, factor: float, min_prob: float) -> tuple[list[int], float]:
        node, length = self.match(tokens, room=max(1, min(max_tokens, self.depth // 2)))
        if node is None:
            return [], 0.0
        budget = min(max_tokens, math.floor(factor * length))
        out: list[int] = []
        prob, score = 1.0, 0.0
        while len(out) < budget and node.children:
            total = sum(c.count for c in node.children.values())
            token, child = max(node.children.items(), key=lambda item: item[1].count)
            prob *= child.count / total
            if prob < min_prob:
                break
            out.append(token)
            score += prob
            node = child
        return out, score


class _RequestTree:
    """A request's own tree, extended token by token: `open` holds the nodes of the suffixes that end at the last
    indexed token and are shorter than the depth."""

    __slots__ = ("tree", "open", "indexed")

    def __init__(self, depth: int):
        self.tree = SuffixTree(depth)
        self.open: list[tuple[_Node, int]] = []
        self.indexed = 0

    def extend(self, tokens: list[int], num_prompt_tokens: int) -> None:
        if self.indexed == 0:
            self.indexed = max(0, num_prompt_tokens - PROMPT_TOKENS_INDEXED)
        depth = self.tree.depth
        for token in tokens[self.indexed :]:
            grown = []
            for node, length in [(self.tree.root, 0), *self.open]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                child.count += 1
                if length + 1 < depth:
                    grown.append((child, length + 1))
            self.open = grown
        self.indexed = len(tokens)


class SuffixDrafter:
    def __init__(self, num_tokens: int, depth: int, max_cached_requests: int, factor: float, min_prob: float):
        self.num_tokens = num_tokens
        self.depth = depth
        self.factor, self.min_prob = factor, min_prob
        self.max_cached_requests = max_cached_requests
        self.global_tree = SuffixTree(depth)
        self._cached: collections.deque[list[int]] = collections.deque()
        self._requests: dict[int, _RequestTree] = {}

    def propose(self, rid: int, tokens: list[int], num_prompt_tokens: int, limit: int) -> tuple[list[int], float]:
        own = self._requests.get(rid)
        if own is None:
            own = self._requests[rid] = _RequestTree(self.depth)
        own.extend(tokens, num_prompt_tokens)
        k = min(self.num_tokens, limit)
        mine = own.tree.draft(tokens, k, self.factor, self.min_prob)
        shared = self.global_tree.draft(tokens, k, self.factor, self.min_prob)
        return max(mine, shared, key=lambda d: d[1])

    def finish(self, rid: int, tokens: list[int], num_prompt_tokens: int) -> None:
        """Drop the request's own tree; its output (after the tail of its prompt) joins the global tree."""
        self._requests.pop(rid, None)
        if self.max_cached_requests == 0 or len(tokens) <= num_prompt_tokens:
            return
        kept = tokens[max(0, num_prompt_tokens - self.depth) :]
        self.global_tree.add(kept)
        self._cached.append(kept)
        while len(self._cached) > self.max_cached_requests:
            self.global_tree.add(self._cached.popleft(), sign=-1)
