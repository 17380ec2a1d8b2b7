"""The radix prefix cache: KV pages of computed token prefixes, shared across requests.

A tree over token ids at page granularity: every node holds a run of whole pages (its key is their tokens) and a
child per distinct next page. Ownership is by reference count in the page allocator and nothing else: the tree
holds one reference on each page in it, and each request holds one on each page in its own page list. Each owner
releases only its own references, so no page can be freed while someone still maps it, and no page is released
twice. A request that computed a prefix the tree already has keeps its own copy until it finishes; nothing is ever
remapped under a running request.

Nodes on the path of a running request are locked (lock_ref > 0) and never evicted: their pages are mapped anyway,
so evicting them would free nothing. Eviction takes unlocked leaves, least recently used first.

With record_events, the cache also logs each page it takes and lets go of, under chained page hashes (kvcache/
events.py), for the KV-cache event publisher; the engine takes the log after each step (take_events).
"""

from __future__ import annotations

import heapq
import itertools

from .events import CacheCleared, CacheEvent, PagesRemoved, PagesStored, chain_hashes


class _Node:
    __slots__ = ("key", "pages", "hashes", "children", "parent", "lock_ref", "last_access")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: _Node | None, hashes: list[int] = ()):
        self.key = key  # tokens, a whole number of pages
        self.pages = pages
        self.hashes = hashes  # each page's chained hash (kvcache/events.py), when the cache records events
        self.children: dict[tuple[int, ...], _Node] = {}  # by the tokens of the child's first page
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0


class RadixCache:
    def __init__(self, allocator, page_size: int, record_events: bool = False):
        self.allocator = allocator
        self.page_size = page_size
        self.events: list[CacheEvent] | None = [] if record_events else None
        self.root = _Node((), [], None)
        self.root.lock_ref = 1  # never evicted
        self._clock = itertools.count(1)
        self.num_pages = 0  # pages the tree holds
        self.num_locked_pages = 0  # of those, pages of locked nodes (kept, as running requests map them)

    # ---- lookup -------------------------------------------------------------------------------------------

    def match_prefix(self, tokens: list[int]) -> tuple[list[int], _Node]:
        """Pages of the longest cached whole-page prefix of tokens, and the node where the match ends.

        The caller passes at most len(prompt) - 1 tokens, so a fully cached prompt still computes its last token.
        A match that ends inside a node splits it, so the returned node covers exactly the matched pages.
        """
        ps = self.page_size
        node, pages, at = self.root, [], 0
        now = next(self._clock)
        node.last_access = now
        while len(tokens) - at >= ps:
            child = node.children.get(tuple(tokens[at : at + ps]))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, at)
            if n < len(child.pages):
                child = self._split(child, n)
            pages.extend(child.pages)
            at += len(child.key)
            node = child
            node.last_access = now
        return pages, node

    def _common_pages(self, key: tuple[int, ...], tokens: list[int], at: int) -> int:
        """Whole pages of key that tokens[at:] repeats."""
        ps, n = self.page_size, 0
        while (n + 1) * ps <= len(key) and at + (n + 1) * ps <= len(tokens):
            if key[n * ps : (n + 1) * ps] != tuple(tokens[at + n * ps : at + (n + 1) * ps]):
                break
            n += 1
        return n

    def _split(self, node: _Node, num_pages: int) -> _Node:
        """Cut node after num_pages pages; returns the new upper part (the lower part keeps node's children)."""
        ps = self.page_size
        # The pages stay in the tree (only the node they hang in changes): nothing to report to event subscribers.
        upper = _Node(node.key[: num_pages * ps], node.pages[:num_pages], node.parent, node.hashes[:num_pages])
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        node.parent.children[node.key[:ps]] = upper
        node.key = node.key[num_pages * ps :]
        node.pages = node.pages[num_pages:]
        node.hashes = node.hashes[num_pages:]
        node.parent = upper
        upper.children[node.key[:ps]] = node
        return upper

    # ---- insert -------------------------------------------------------------------------------------------

    def insert(self, tokens: list[int], pages: list[int]) -> _Node:
        """Cache a computed prefix: tokens (whole pages) whose KV is in pages. Returns the node where it ends.

        Pages of parts the tree already has stay with their current owner; the tree takes a reference only on the
        pages it adds.
        """
        ps = self.page_size
        assert len(tokens) == len(pages) * ps, "insert takes whole pages"
        node, at = self.root, 0
        now = next(self._clock)
        while at < len(tokens):
            first = tuple(tokens[at : at + ps])
            child = node.children.get(first)
            if child is None:
                new_pages = pages[at // ps :]
                self.allocator.incref(new_pages)
                child = _Node(tuple(tokens[at:]), list(new_pages), node)
                if self.events is not None:
                    parent_hash = node.hashes[-1] if node.hashes else None  # (the root has none)
                    child.hashes = chain_hashes(parent_hash, child.key, ps)
                    self.events.append(PagesStored(child.hashes, parent_hash, list(child.key)))
                node.children[first] = child
                self.num_pages += len(new_pages)
                child.last_access = now
                return child
            n = self._common_pages(child.key, tokens, at)
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_access = now
            at += len(child.key)
            node = child
        return node

    # ---- locks --------------------------------------------------------------------------------------------

    def lock(self, node: _Node) -> None:
        while node is not None:
            if node.lock_ref == 0:
                self.num_locked_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: _Node) -> None:
        while node is not None:
            node.lock_ref -= 1
            assert node.lock_ref >= 0, "unlock without lock"
            if node.lock_ref == 0:
                self.num_locked_pages -= len(node.pages)
            node = node.parent

    # ---- eviction -----------------------------------------------------------------------------------------

    def evictable_pages(self) -> int:
        """Pages that evict() could free now: those of unlocked nodes (a locked node's ancestors are locked)."""
        return self.num_pages - self.num_locked_pages

    def evict(self, num_pages: int) -> int:
        """Free at least num_pages pages if possible, least recently used unlocked leaves first. Returns pages freed."""
        leaves = [(n.last_access, id(n), n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_pages and leaves:
            _, _, node = heapq.heappop(leaves)
            self.allocator.decref(node.pages)
            if self.events is not None:
                self.events.append(PagesRemoved(node.hashes))
            freed += len(node.pages)
            self.num_pages -= len(node.pages)
            parent = node.parent
            del parent.children[node.key[: self.page_size]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        return freed

    def reset(self) -> None:
        """Drop every unlocked node (all of them when no request runs: reported as one CacheCleared)."""
        if self.events is None or self.num_locked_pages:
            self.evict(self.num_pages)
            return
        for node in self._nodes():
            self.allocator.decref(node.pages)
        self.root.children.clear()
        self.num_pages = 0
        self.events.append(CacheCleared())

    def take_events(self) -> list[CacheEvent]:
        """The events recorded since the last call (and none from now on are in it)."""
        events, self.events = self.events, []
        return events

    # ---- inspection ---------------------------------------------------------------------------------------

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def pages(self) -> list[int]:
        return [p for node in self._nodes() for p in node.pages]
