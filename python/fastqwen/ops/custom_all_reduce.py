"""The custom all-reduce (csrc/custom_all_reduce.cu): a one-shot sum across the GPUs of one host, for messages up to
a threshold (decode's hidden states); NCCL takes the larger ones.

Each rank allocates one buffer (a signal area and a data area), shares its CUDA IPC handle with the others through
the CPU process group, and opens theirs. A call copies the input into the rank's own buffer (alternate calls into
alternate halves of it, so that no second barrier is needed before the next call), waits for every peer at a
barrier, and sums every rank's buffer in rank order (so every rank gets bitwise the same result) back into the input.
It never allocates and keeps its round counters on the device, so decode CUDA graphs capture it. Messages of up to
LAMPORT_MAX_BYTES wait at no barrier (unless FASTQWEN_ALLREDUCE_LAMPORT=0, env.py): each rank stores its input into
the other ranks' receive buffers and sums what arrives there (csrc/custom_all_reduce.cu). Every rank must
make the same calls in the same order (the engine's ranks run the same steps).

`all_reduce_add_rms_norm` is the same sum fused with what follows it in a decoder layer: the residual add and the
RMSNorm of ops.fused_add_rms_norm, per row, in the same kernel (the rows' sums never leave it). Its numbers are those
of `__call__` followed by fused_add_rms_norm; ParallelGroup.all_reduce_add_rms_norm decides when it runs. With
FASTQWEN_GEMV_SENDS=1 the one-token GEMV before it may store its output into the receive buffers itself
(`send_target`, ops.linear_send), and `all_reduce_add_rms_norm(..., sent=True)` then only waits and sums.
"""

from __future__ import annotations

import torch

from .. import env
from ._native import check_tensors, dtype_code, has_cuda_kernels, kernel_applies, native, stream_of

# Above this many bytes NCCL is used. One-shot reads world x the message on every rank; past a few MB the ring's
# bandwidth wins. Decode of 256 sequences of Qwen3-32B is 2.5 MiB of bf16.
DEFAULT_MAX_BYTES = 4 * 2**20
# The barrier-free kernels take messages up to this size (decode steps of up to 32 tokens of hidden 8192 in bf16, the
# steps the fused norm takes); their receive buffers hold 3 x world x this on every rank.
LAMPORT_MAX_BYTES = 512 * 2**10
_BLOCKS = 36


def custom_all_reduce_supported(world: int) -> bool:
    """Whether the kernel exists for this many ranks (built with CUDA; 2, 4 or 8 ranks)."""
    return has_cuda_kernels() and world in (2, 4, 8)


class CustomAllReduce:
    """One rank's side. `exchange(handle: bytes) -> list[bytes]` gathers every rank's handle in rank order (the
    engine passes an all-gather over its CPU process group)."""

    def __init__(self, rank: int, world: int, device: torch.device, exchange, max_bytes: int = DEFAULT_MAX_BYTES):
        if not custom_all_reduce_supported(world):
            raise ValueError(f"the custom all-reduce needs the CUDA kernels and 2, 4 or 8 ranks, not {world}")
        m = native()
        align = m.ALL_REDUCE_ALIGN
        self.max_bytes = max_bytes - max_bytes % align
        self.rank, self.world, self.device = rank, world, device
        self.lamport_bytes = min(LAMPORT_MAX_BYTES, self.max_bytes) if env.all_reduce_lamport() else 0
        with torch.cuda.device(device):
            self._own = m.all_reduce_buffer_alloc(self.max_bytes, self.lamport_bytes, world)
            handles = exchange(m.all_reduce_ipc_handle(self._own))
            self._opened = [m.all_reduce_ipc_open(h) for r, h in enumerate(handles) if r != rank]
        peers = iter(self._opened)
        self._args = m.AllReduceArgs()
        self._args.buffers = [self._own if r == rank else next(peers) for r in range(world)]
        self._args.rank, self._args.world = rank, world
        self._args.capacity_bytes = self.max_bytes
        self._args.lamport_bytes = self.lamport_bytes
        self._args.max_blocks = _BLOCKS
        # Where a sending GEMV stores its output (made here, before any CUDA graph is captured); None: no GEMV sends.
        self.send_target: int | None = None
        self._send_target_memory = None
        if self.lamport_bytes and env.gemv_sends() and not env.all_reduce_end_barrier():
            self._send_target_memory = torch.empty(m.ALL_REDUCE_SEND_TARGET_BYTES, dtype=torch.uint8, device=device)
            m.all_reduce_send_target(self._args, self._send_target_memory.data_ptr())
            self.send_target = self._send_target_memory.data_ptr()

    @property
    def send_capacity(self) -> int:
        """The 16-bit elements a sending GEMV's output may have (a receive slot)."""
        return self.lamport_bytes // 2

    def applies(self, x: torch.Tensor) -> bool:
        """Whether the kernel takes this tensor (else the caller uses NCCL)."""
        nbytes = x.numel() * x.element_size()
        return (
            self._own is not None
            and x.is_cuda
            and x.device == self.device
            and x.is_contiguous()
            and dtype_code(x.dtype) is not None
            and 0 < nbytes <= self.max_bytes
            and nbytes % native().ALL_REDUCE_ALIGN == 0
            and x.data_ptr() % native().ALL_REDUCE_ALIGN == 0
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x across the ranks, in place; returns x."""
        if not self.applies(x):
            raise ValueError(f"custom_all_reduce: does not take a {tuple(x.shape)} {x.dtype} tensor on {x.device}")
        check_tensors("custom_all_reduce", self.device, None, x=x)
        args = self._args
        args.data, args.numel, args.dtype, args.stream = x.data_ptr(), x.numel(), dtype_code(x.dtype), stream_of(x)
        args.sent = False
        native().custom_all_reduce(args)
        return x

    def applies_with_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether all_reduce_add_rms_norm takes these tensors: what the all-reduce takes, float16 or bfloat16 rows
        [..., hidden] of at most ALL_REDUCE_NORM_MAX_HIDDEN, a residual of x's shape and a weight [hidden], all of
        x's dtype on x's device, contiguous and 16-byte aligned (else the caller composes the two ops)."""
        if not (self.applies(x) and kernel_applies("all_reduce_add_rms_norm", x.is_cuda, x.dtype)):
            return False
        hidden, align = x.shape[-1], native().ALL_REDUCE_ALIGN
        return (
            x.dim() >= 1
            and hidden <= native().ALL_REDUCE_NORM_MAX_HIDDEN
            and (hidden * x.element_size()) % align == 0
            and residual.shape == x.shape
            and weight.shape == (hidden,)
            and all(
                t.dtype == x.dtype and t.device == x.device and t.is_contiguous() and t.data_ptr() % align == 0
                for t in (residual, weight)
            )
            and residual.data_ptr() != x.data_ptr()
        )

    def all_reduce_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, sent: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """In place, in one kernel: residual <- residual + (x summed across the ranks), x <- RMSNorm(residual) *
        weight (ops.fused_add_rms_norm's roundings). Returns (x, residual). sent: every rank's message was stored
        into the receive buffers by the GEMV that computed it (ops.linear_send to send_target), and x is only where
        the normalized rows go."""
        if sent and self.send_target is None:
            raise ValueError("custom_all_reduce_add_rms_norm: sent=True, but no GEMV sends (FASTQWEN_GEMV_SENDS)")
        if not self.applies_with_norm(x, residual, weight):
            raise ValueError(
                f"custom_all_reduce_add_rms_norm: does not take a {tuple(x.shape)} {x.dtype} tensor on {x.device} "
                f"with a {tuple(residual.shape)} {residual.dtype} residual and a {tuple(weight.shape)} weight"
            )
        args = self._args
        args.data, args.numel, args.dtype, args.stream = x.data_ptr(), x.numel(), dtype_code(x.dtype), stream_of(x)
        args.residual, args.weight, args.hidden, args.eps = residual.data_ptr(), weight.data_ptr(), x.shape[-1], eps
        args.sent = sent
        native().custom_all_reduce_add_rms_norm(args)
        return x, residual

    def close(self) -> None:
        """Unmap the peers' buffers and free this rank's (after the device is done with them)."""
        if self._own is None:
            return
        m = native()
        with torch.cuda.device(self.device):
            torch.cuda.synchronize(self.device)
            for ptr in self._opened:
                m.all_reduce_ipc_close(ptr)
            m.all_reduce_buffer_free(self._own)
        self._own, self._opened = None, []
        self.send_target, self._send_target_memory = None, None
