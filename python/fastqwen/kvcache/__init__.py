from .allocator import PageAllocator
from .invariants import InvariantError, check_kv_invariants
from .pool import KVPool
from .radix_cache import RadixCache

__all__ = ["InvariantError", "KVPool", "PageAllocator", "RadixCache", "check_kv_invariants"]
