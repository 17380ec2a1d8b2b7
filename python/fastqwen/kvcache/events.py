"""What the radix cache tells the outside about its pages: which pages it stored and removed, under stable hashes.

A gateway that routes by cached prefix (engine/kv_events.py publishes these as vLLM's KV-cache events) rebuilds the
set of pages a server holds from this record alone, so the record is exact: every page the tree takes is reported
stored once, every page it lets go reported removed once, and nothing else. A node split moves pages between nodes
without taking or releasing any, so it reports nothing.

A page's hash is chained: blake2b over its parent page's hash and its own token ids, 64 bits. So it names the whole
prefix up to and including the page (the same prefix gives the same hash on every replica and every restart), and a
subscriber can tell from hashes alone whether two servers hold the same prefix.

Recording is a list append on the step's thread; turning records into messages and sending them is the publisher's
work on its own thread. With events off, the cache holds no log and computes no hash.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

_ROOT_SEED = b"fastqwen"  # hashed in place of a parent hash for a page at the start of a prompt


def page_hash(parent: int | None, tokens) -> int:
    """The 64-bit hash of a page: blake2b over its parent page's hash (little-endian; the bytes b"fastqwen" at the
    root) and its token ids (each 4 bytes, little-endian)."""
    return chain_hashes(parent, tokens, len(tokens))[0]


def chain_hashes(parent: int | None, tokens, page_size: int) -> list[int]:
    """Hashes of consecutive whole pages of tokens, the first one's parent being `parent`."""
    data = struct.pack(f"<{len(tokens)}I", *tokens)  # once for every page
    step, hashes = 4 * page_size, []
    previous = _ROOT_SEED if parent is None else parent.to_bytes(8, "little")
    for at in range(0, len(data), step):
        previous = hashlib.blake2b(previous + data[at : at + step], digest_size=8).digest()
        hashes.append(int.from_bytes(previous, "little"))
    return hashes


@dataclass(slots=True)
class PagesStored:
    """Pages the tree took, in prefix order: each page's parent is the one before it, the first one's is parent_hash
    (None: they start a prompt). token_ids holds the tokens of all of them, page after page."""

    hashes: list[int]
    parent_hash: int | None
    token_ids: list[int]


@dataclass(slots=True)
class PagesRemoved:
    hashes: list[int]


@dataclass(slots=True)
class CacheCleared:
    """The tree let go of every page."""


CacheEvent = PagesStored | PagesRemoved | CacheCleared
