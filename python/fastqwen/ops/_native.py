"""Safe, lazy access to the native extension ``fastqwen._C``.

``native()`` returns the module, or None when it cannot be imported (for example a
source checkout that was never built); ``has_cuda_kernels()`` says whether the
module was built with the CUDA kernels. Ops use these to choose between the CUDA
kernel and the PyTorch reference path.

Setting the environment variable ``FASTQWEN_DISABLE_CUDA_KERNELS=1`` makes
``has_cuda_kernels()`` return False, forcing the reference path (for debugging).
"""

from __future__ import annotations

import os
import threading
from types import ModuleType

_lock = threading.Lock()
_tried = False
_module: ModuleType | None = None
_import_error: BaseException | None = None


def native() -> ModuleType | None:
    """The ``fastqwen._C`` module, or None if it cannot be imported."""
    global _tried, _module, _import_error
    if not _tried:
        with _lock:
            if not _tried:
                try:
                    from fastqwen import _C  # type: ignore[attr-defined]

                    _module = _C
                except Exception as e:  # ImportError, or a broken/ABI-mismatched .so
                    _module = None
                    _import_error = e
                _tried = True
    return _module


def import_error() -> BaseException | None:
    """Why ``native()`` returned None (None if it imported, or was not tried yet)."""
    native()
    return _import_error


def has_cuda_kernels() -> bool:
    """True when the extension imported and was built with the CUDA kernels."""
    if os.environ.get("FASTQWEN_DISABLE_CUDA_KERNELS", "") not in ("", "0"):
        return False
    m = native()
    return bool(m is not None and getattr(m, "built_with_cuda", False))
