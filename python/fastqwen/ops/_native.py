"""The ops' view of the native extension ``fastqwen._C`` (loaded by fastqwen/_native.py).

``native()`` returns the module, or None when it cannot be imported (for example a
source checkout that was never built); ``has_cuda_kernels()`` says whether the
module was built with the CUDA kernels. Ops use these to choose between the CUDA
kernel and the PyTorch reference path.

Setting the environment variable ``FASTQWEN_DISABLE_CUDA_KERNELS=1`` makes
``has_cuda_kernels()`` return False, forcing the reference path (for debugging).

The contracts between Python and the kernels (dtype codes, which dtypes each kernel takes, layouts) are defined in
csrc/ and exported by the module; ``dtype_code`` and ``kernel_reason`` read them from there.
"""

from __future__ import annotations

from .. import env
from .._native import import_error, native

__all__ = ["check_tensors", "dtype_code", "has_cuda_kernels", "import_error", "kernel_applies", "native", "stream_of"]

_has_cuda: bool | None = None


def has_cuda_kernels() -> bool:
    """True when the extension imported and was built with the CUDA kernels (decided once: it is on the hot path)."""
    global _has_cuda
    if _has_cuda is None:
        disabled = env.disable_cuda_kernels()
        m = native()
        _has_cuda = not disabled and bool(m is not None and getattr(m, "built_with_cuda", False))
    return _has_cuda


_dtype_codes: dict | None = None
_kernel_dtypes: dict | None = None


def dtype_code(dtype) -> int | None:
    """The extension's code for a torch dtype (csrc/dtype.h), None for one it has no code for (or no extension)."""
    global _dtype_codes
    if _dtype_codes is None:
        import torch

        m = native()
        _dtype_codes = {} if m is None else {getattr(torch, name): code for name, code in m.DTYPE_CODES.items()}
    return _dtype_codes.get(dtype)


def kernel_applies(kernel: str, on_gpu: bool, dtype) -> bool:
    """Whether the CUDA kernel `kernel` (a key of _C.KERNEL_DTYPES: the dtypes csrc/ says it takes) runs for tensors
    of this dtype, on the GPU (on_gpu) or not. Cheap: it is asked on every op call."""
    global _kernel_dtypes
    if not (on_gpu and has_cuda_kernels()):
        return False
    if _kernel_dtypes is None:
        dtype_code(None)  # loads the codes
        _kernel_dtypes = {
            name: frozenset(t for t, c in _dtype_codes.items() if c in codes)
            for name, codes in native().KERNEL_DTYPES.items()
        }
    return dtype in _kernel_dtypes[kernel]


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
