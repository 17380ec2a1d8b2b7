"""The KV page allocator: the C++ free list with a reference count per page, from fastqwen._C."""

from __future__ import annotations

from .._native import import_error, native


def PageAllocator(num_pages: int):
    """The native allocator; see csrc/page_allocator.h for its contract."""
    module = native()
    if module is None:
        raise ImportError(f"fastqwen._C is not importable ({import_error()}): reinstall with `pip install .`")
    return module.PageAllocator(num_pages)
