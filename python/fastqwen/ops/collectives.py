"""The collectives of a tensor-parallel forward pass: what the model calls between its sharded matmuls.

`ParallelGroup` wraps one rank's process groups: `device` (NCCL on GPUs, gloo on the CPU) for the tensors of the
forward, `cpu` (gloo) for small host-side agreements (the KV pool size, the custom all-reduce's IPC handles). Its
all-reduce takes the custom kernel (ops/custom_all_reduce.py) for messages it accepts and the device group otherwise.
`SINGLE` is the one-rank group: every collective is the identity, so the model reads the same at any TP size.

`all_reduce_add_rms_norm` is what a decoder layer does after its row-parallel o_proj and down: the all-reduce, then
ops.fused_add_rms_norm. Its meaning is that composition, on every path; where the custom kernel takes the tensors,
the step has at most FUSED_NORM_MAX_ROWS tokens and the group fuses (env.fused_all_reduce_norm: at two ranks unless
FASTQWEN_FUSED_ALLREDUCE_NORM says otherwise), one kernel does both. `linear_to_all_reduce` is the row-parallel
projection before it: with FASTQWEN_GEMV_SENDS=1 a one-token GEMV stores its output straight into the ranks' receive
buffers, and the all-reduce that follows only sums.

The process groups are made directly from a store (not torch.distributed's global default group), so one process
can run several engines one after the other (tests do) and an engine's groups die with it.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from .. import env
from .custom_all_reduce import CustomAllReduce, custom_all_reduce_supported
from .linear import LinearWeight, QuantizedRows, gemv_kernel_applies, linear, linear_send, quantized_input_applies
from .norm import fused_add_rms_norm, fused_add_rms_norm_quantized

# The fused kernel up to this many rows (tokens of a step), the all-reduce then fused_add_rms_norm above: on two H200s
# (bench/tp_bench.py, hidden 4096 / 5120) fused is 1.03-1.32x faster up to 32 rows, even at 64, 0.66-0.92x from 128.
FUSED_NORM_MAX_ROWS = 32


_TIMEOUT = datetime.timedelta(minutes=30)  # loading a large checkpoint on one rank may keep the others waiting


class ParallelGroup:
    def __init__(
        self,
        rank: int = 0,
        size: int = 1,
        device_group=None,
        cpu_group=None,
        custom: CustomAllReduce | None = None,
        fused_norm: bool = False,
    ):
        """fused_norm: all_reduce_add_rms_norm may take the custom kernel's fused form (where it applies)."""
        self.rank, self.size = rank, size
        self.device_group, self.cpu_group = device_group, cpu_group
        self.custom = custom
        self.fused_norm = fused_norm

    @classmethod
    def connect(
        cls, rank: int, size: int, store, device: torch.device, custom_all_reduce: bool = True
    ) -> ParallelGroup:
        """Rank `rank`'s groups over `store` (a torch.distributed Store shared by the ranks). On a GPU the device
        group is NCCL and, for 2, 4 or 8 ranks and unless turned off, small all-reduces take the custom kernel."""
        cpu = dist.ProcessGroupGloo(dist.PrefixStore("cpu", store), rank, size, _TIMEOUT)
        if device.type == "cuda":
            nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size)
            group = cls(rank, size, nccl, cpu)
            warm = torch.zeros(16, device=device)
            group.device_group.allreduce([warm]).wait()  # creates the communicator before any graph capture
            torch.cuda.synchronize(device)
            if custom_all_reduce and custom_all_reduce_supported(size):
                group.custom = CustomAllReduce(rank, size, device, group.all_gather_bytes)
                group.fused_norm = env.fused_all_reduce_norm(size)
            return group
        return cls(rank, size, cpu, cpu)

    @property
    def single(self) -> bool:
        return self.size == 1

    # ---- in the forward pass (captured in CUDA graphs on the GPU) ---------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (every rank gets the same result)."""
        if self.size == 1:
            return x
        if self.custom is not None and self.custom.applies(x):
            return self.custom(x)
        self.device_group.allreduce([x]).wait()
        return x

    def linear_to_all_reduce(self, x: torch.Tensor | QuantizedRows, w: LinearWeight) -> tuple[torch.Tensor, bool]:
        """A row-parallel projection whose output all_reduce_add_rms_norm sums next: (ops.linear(x, w), False), or,
        where the GEMV sends (FASTQWEN_GEMV_SENDS=1, the custom kernel fused with the norm, one token on the one-token
        GEMV, an output that fits a receive slot), (ops.linear_send(...), True): the output went straight into the
        ranks' receive buffers, and the call that follows must pass sent=True. Every rank decides alike (the same
        shapes and environment). x may be QuantizedRows (ops.linear_silu_and_mul's): never sent (many tokens)."""
        custom = self.custom
        if (
            not isinstance(x, QuantizedRows)
            and custom is not None
            and custom.send_target is not None
            and self.fused_norm
            and x.dim() == 2
            and x.shape[0] == 1
            and gemv_kernel_applies(x, w)
            and w.out_features <= custom.send_capacity
        ):
            return linear_send(x, w, custom.send_target, custom.send_capacity), True
        return linear(x, w), False

    def all_reduce_add_rms_norm(
        self,
        partial: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        sent: bool = False,
        quantize_for: LinearWeight | None = None,
    ) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
        """In place: residual <- residual + (partial summed over the ranks); partial <- RMSNorm(residual) * weight.
        Returns (partial, residual): the normalized rows and the new residual stream. The same numbers as
        fused_add_rms_norm(all_reduce(partial), residual, weight, eps), which it is wherever the fused kernel does
        not run (one rank, the CPU, NCCL's sizes, float32, more than two ranks unless FASTQWEN_FUSED_ALLREDUCE_NORM=1,
        or =0). sent: partial came from linear_to_all_reduce's sending GEMV (its rows are in the receive buffers
        already). quantize_for (the next projection's weight): where the fused kernel does not run and linear would
        quantize the normalized rows for that weight's FP8 GEMM (ops.quantized_input_applies), they come back as
        QuantizedRows instead (ops.fused_add_rms_norm_quantized: the same GEMM inputs, bit for bit)."""
        fused = (
            self.fused_norm
            and self.custom is not None
            and partial.numel() <= FUSED_NORM_MAX_ROWS * partial.shape[-1]
            and self.custom.applies_with_norm(partial, residual, weight)
        )
        if sent and not fused:  # (linear_to_all_reduce sends only where the fused kernel takes its output)
            raise ValueError("all_reduce_add_rms_norm: a sent message needs the fused kernel, which does not take it")
        if fused:
            return self.custom.all_reduce_add_rms_norm(partial, residual, weight, eps, sent=sent)
        summed = self.all_reduce(partial)
        if quantized_input_applies(tuple(summed.shape), summed.dtype, summed.device, quantize_for):
            return fused_add_rms_norm_quantized(summed, residual, weight, eps)
        return fused_add_rms_norm(summed, residual, weight, eps)

    def embed(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows of a vocabulary-parallel embedding: this rank's slice [rank * rows, (rank + 1) * rows) of the table
        looks up the ids it holds, zeros for the others, and the all-reduce adds the ranks' rows (exact: one is
        the row, the rest are zeros). A new tensor, never a view of the table."""
        if self.size == 1:
            return table[ids]
        rows = table.shape[0]
        local = ids - self.rank * rows
        held = (local >= 0) & (local < rows)
        out = table[local.clamp(0, rows - 1)]
        out.masked_fill_(~held.unsqueeze(-1), 0)
        return self.all_reduce(out)

    def gather_vocab(self, local: torch.Tensor, vocab: int) -> torch.Tensor:
        """[S, vocab] from every rank's [S, rows] slice of a vocabulary-parallel LM head's output (the padding past
        the vocabulary dropped)."""
        if self.size == 1:
            return local
        gathered = torch.empty((self.size, *local.shape), dtype=local.dtype, device=local.device)
        self.device_group._allgather_base(gathered.view(-1), local.contiguous().view(-1)).wait()
        return gathered.permute(1, 0, 2).reshape(local.shape[0], -1)[:, :vocab]

    # ---- on the host -------------------------------------------------------------------------------------------

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value (each rank's KV pool fits its own free memory: the smallest wins)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self.cpu_group.allreduce([t], options).wait()
        return int(t.item())

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's bytes (of the same length on every rank), in rank order."""
        mine = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = torch.empty(self.size * len(data), dtype=torch.uint8)
        self.cpu_group._allgather_base(out, mine).wait()
        return [bytes(chunk.tolist()) for chunk in out.view(self.size, len(data))]

    def barrier(self) -> None:
        if self.size > 1:
            self.cpu_group.allreduce([torch.zeros(1)]).wait()

    def abort_device_group(self) -> None:
        """Abort this rank's NCCL communicator now (local: waits for no peer), once the other ranks have exited and
        the CUDA graphs that captured its collectives are destroyed (ModelRunner.release_graphs: NCCL's teardown
        waits for them). Left to the group's destructor, the teardown would be an orderly one, which needs every
        rank."""
        group = self.device_group
        if group is None or group is self.cpu_group:  # (gloo on the CPU: nothing outlives its peers)
            return
        self.device_group = None
        abort = getattr(group, "abort", None)  # (ProcessGroupNCCL.abort: PyTorch >= 2.4)
        if abort is not None:
            abort()

    def close(self) -> None:
        if self.custom is not None:
            self.barrier()  # no peer still reads this rank's buffer
            self.custom.close()
            self.custom = None


SINGLE = ParallelGroup()
