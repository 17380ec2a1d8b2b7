"""Safe, lazy access to the native extension ``fastqwen._C``.

``native()`` returns the module, or None when it cannot be imported (for example a
source checkout that was never built); ``has_cuda_kernels()`` says whether the
module was built with the CUDA kernels. Ops use these to choose between the CUDA
kernel and the PyTorch reference path.

Setting the environment variable ``FASTQWEN_DISABLE_CUDA_KERNELS=1`` makes
``has_cuda_kernels()`` return False, forcing the reference path (for debugging).
"""

from __future__ import annotations

import threading
from types import ModuleType

from .. import env

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


_has_cuda: bool | None = None


def has_cuda_kernels() -> bool:
    """True when the extension imported and was built with the CUDA kernels (decided once: it is on the hot path)."""
    global _has_cuda
    if _has_cuda is None:
        disabled = env.disable_cuda_kernels()
        m = native()
        _has_cuda = not disabled and bool(m is not None and getattr(m, "built_with_cuda", False))
    return _has_cuda


def half_dtype_code(dtype) -> int | None:
    """The extension's code for float16 / bfloat16, None for any other dtype (those take the reference path)."""
    import torch

    if dtype == torch.bfloat16:
        return 2
    if dtype == torch.float16:
        return 1
    return None


def check_tensors(op: str, device, dtype, **tensors) -> None:
    """Every tensor on `device`, contiguous, and (where dtype is given as the value's pair) of that dtype.

    tensors: name -> tensor, or name -> (tensor, required dtype). Raises ValueError naming the first bad one.
    """
    for name, value in tensors.items():
        tensor, want = value if isinstance(value, tuple) else (value, dtype)
        if tensor.device != device:
            raise ValueError(f"{op}: {name} is on {tensor.device}, expected {device}")
        if want is not None and tensor.dtype != want:
            raise ValueError(f"{op}: {name} has dtype {tensor.dtype}, expected {want}")
        if not tensor.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous")


def stream_of(tensor) -> int:
    import torch

    return torch.cuda.current_stream(tensor.device).cuda_stream
