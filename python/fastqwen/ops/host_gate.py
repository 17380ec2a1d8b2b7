"""The host gate (csrc/host_gate.cu): work queued on the GPU before the host has written its inputs.

A verify step's drafts come from the tokens of the step still running, so the host cannot launch it until those are
back; launching it then (uploads, two graph replays, the read-back: tens of microseconds of CUDA calls each) leaves
the GPU idle. Instead the step is armed while the step before it runs: the gate kernel, then the step's graphs and
read-back, queued behind it. Once the host has the tokens it writes the inputs into the pinned buffers the gate
copies from and opens the gate with one store to pinned memory.

A gate that is cancelled (the step the host armed for is not the one it runs next) or left closed past its timeout
copies device-resident padding inputs instead, so its step computes nothing anyone reads; `opened` then says no.
"""

from __future__ import annotations

import numpy as np
import torch

from ._native import native

__all__ = ["HostGate", "host_gate_applies"]


def host_gate_applies(device: torch.device) -> bool:
    """Whether the gate's kernel can run for this device (a CUDA build and a CUDA device)."""
    m = native()
    return device.type == "cuda" and m is not None and getattr(m, "built_with_cuda", False) and hasattr(m, "host_gate")


class HostGate:
    """One gate at a time on the current stream: arm, then open or cancel; `opened` once the gated work is done."""

    def __init__(self, device: torch.device, timeout_s: float = 0.05):
        if not host_gate_applies(device):
            raise RuntimeError("HostGate: needs the CUDA build of fastqwen._C and a CUDA device")
        self.device = device
        self.timeout_ns = int(timeout_s * 1e9)
        self._flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self._status = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self._waited = torch.zeros(1, dtype=torch.int64, pin_memory=True)  # the GPU's wait for the host, ns
        self._flag_word = self._flag.numpy().view(np.uint32)
        self._status_word = self._status.numpy().view(np.uint32)
        self._waited_word = self._waited.numpy()
        self._cancel = int(native().HOST_GATE_CANCEL)
        self._seq = 0
        self.armed: int = 0  # the sequence number of the gate armed and not yet opened or cancelled, else 0

    def arm(self, *copies: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> int:
        """Queue the gate with one or two (pinned host source, device destination, device fallback) copies of the same
        number of bytes each; returns its sequence number. Work queued after this waits for open() or cancel()."""
        if self.armed:
            raise RuntimeError("HostGate: a gate is armed already (open or cancel it first)")
        if not 1 <= len(copies) <= 2:
            raise ValueError("HostGate.arm: one or two copies")
        args = []
        for src, dst, fallback in copies:
            if not src.is_pinned() or not dst.is_cuda or not fallback.is_cuda:
                raise ValueError("HostGate.arm: (pinned host source, device destination, device fallback)")
            nbytes = src.numel() * src.element_size()
            for t in (dst, fallback):
                if t.numel() * t.element_size() != nbytes or not t.is_contiguous():
                    raise ValueError("HostGate.arm: destination and fallback must be contiguous, of the source's size")
            args.append((src.data_ptr(), dst.data_ptr(), fallback.data_ptr(), nbytes))
        while len(args) < 2:
            args.append((0, 0, 0, 0))
        # Sequence numbers differ from gate to gate, so the flag is never reset: the gate before may still have to
        # read the value that opened it (an open follows the collection of a step queued after the gate before).
        self._seq = self._seq % (self._cancel - 1) + 1
        native().host_gate(
            self._flag.data_ptr(),
            self._status.data_ptr(),
            self._seq,
            args[0],
            args[1],
            self.timeout_ns,
            torch.cuda.current_stream(self.device).cuda_stream,
            self._waited.data_ptr(),
        )
        self.armed = self._seq
        return self._seq

    def open(self) -> int:
        """Let the armed gate copy the host's buffers (written before this call) and its work run."""
        seq, self.armed = self.armed, 0
        self._flag_word[0] = seq
        return seq

    def cancel(self) -> None:
        """Let the armed gate's work run on the fallbacks (no-op when none is armed)."""
        if self.armed:
            self._flag_word[0] = self.armed | self._cancel
            self.armed = 0

    def waited_ns(self) -> int:
        """After the gated work finished: how long the last gate kept the GPU waiting for the host (its kernel's start,
        right after the work queued before it, to its opening or cancel), on the GPU's clock."""
        return int(self._waited_word[0])

    def opened(self, seq: int) -> bool:
        """After the gated work finished (an event after it fired): whether gate `seq` copied the host's buffers."""
        return int(self._status_word[0]) == seq
