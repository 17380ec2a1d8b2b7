"""Loading the native extension ``fastqwen._C``, once, at the bottom of the package: the ops (kernels) and the KV
page allocator (kvcache/allocator.py) both get the module here, so neither reaches into the other for it.

``native()`` returns the module, or None when it cannot be imported (for example a source checkout that was never
built); ``import_error()`` says why. On load, the launch switches read from the environment (env.py) are handed to
the module, so that every user sees the same settings.
"""

from __future__ import annotations

import threading
from types import ModuleType

from . import env

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
                fp8_variant = env.gemv_tc_fp8_variant()  # (a bad value is the caller's error, not a missing build)
                try:
                    from fastqwen import _C  # type: ignore[attr-defined]

                    _module = _C
                    if hasattr(_C, "set_programmatic_launch"):  # (a build with the CUDA kernels)
                        _C.set_programmatic_launch(env.programmatic_launch())
                        _C.set_gemv_tensor_cores(env.gemv_tensor_cores())
                        _C.set_gemv_five_rows(env.gemv_five_rows())
                        if hasattr(_C, "set_all_reduce_end_barrier"):  # (built with the custom all-reduce)
                            _C.set_all_reduce_end_barrier(env.all_reduce_end_barrier())
                except Exception as e:  # ImportError, or a broken/ABI-mismatched .so
                    _module = None
                    _import_error = e
                if fp8_variant is not None and hasattr(_module, "set_gemv_tc_fp8_variant"):
                    try:  # (outside the import's try: a bad value is not a missing build; the kernel checks the range)
                        _module.set_gemv_tc_fp8_variant(fp8_variant)
                    except ValueError as e:
                        raise ValueError(f"FASTQWEN_GEMV_TC_FP8_VARIANT={fp8_variant}: {e}") from None
                _tried = True
    return _module


def import_error() -> BaseException | None:
    """Why ``native()`` returned None (None if it imported, or was not tried yet)."""
    native()
    return _import_error
