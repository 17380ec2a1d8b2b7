from .allocator import PageAllocator
from .pool import KVPool

__all__ = ["KVPool", "PageAllocator"]
