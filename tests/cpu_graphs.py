"""The engine's CUDA-graph decode path, run on the CPU: what the GPU takes and the CPU tests otherwise never do.

`graph_llm` builds an LLM on the CPU whose model runner has decode "graphs" (StandInGraphs: DecodeGraphs' interface,
each replay computing eagerly what the captured graph would) and the CUDA sampler's engine side (GpuSampler, whose
kernel falls back to the reference on the CPU), with CUDA events standing in as done at once. So the runner takes the
GPU's branches (_launch_graph with the sampler's graph, steps launched ahead, deferred samplers, the eager sampler
after a forward graph) and the tokens can be checked against the plain CPU engine's.
"""

from __future__ import annotations

import fastqwen.engine.llm_engine as llm_engine_module
import fastqwen.engine.model_runner as model_runner_module
import torch
from fastqwen import LLM
from fastqwen.engine.cuda_graph import DecodeGraphs
from fastqwen.engine.sampler import GpuSampler
from fastqwen.model import ForwardBatch


class DoneEvent:
    """torch.cuda.Event on the CPU: the work before it is done when it is recorded."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class StandInHostGate:
    """ops.host_gate.HostGate on the CPU: what the runner queues after arm() (the stand-in graphs' replays, the
    read-back's copy) is held until open() (the copies from the host buffers first) or cancel() (from the fallbacks),
    then run in order, as the GPU would. `time_out_next`: the next open() comes too late, as past the timeout (the held
    work runs on the fallbacks and opened() says no)."""

    def __init__(self, device=None, timeout_s: float = 0.05):
        self.armed = 0
        self._seq = 0
        self._copies = ()
        self.held: list | None = None  # the work queued behind the armed gate
        self._opened: set[int] = set()
        self.time_out_next = False
        self.opens = self.cancels = self.timeouts = 0

    def arm(self, *copies) -> int:
        assert not self.armed and self.held is None, "armed twice"
        self._seq += 1
        self.armed, self._copies, self.held = self._seq, copies, []
        return self._seq

    def _release(self, from_host: bool) -> None:
        for src, dst, fallback in self._copies:
            dst.copy_(src if from_host else fallback)
        held, self.held = self.held, None
        for work in held:
            work()

    def open(self) -> int:
        seq, self.armed = self.armed, 0
        if self.time_out_next:
            self.time_out_next = False
            self.timeouts += 1
            self._release(False)
        else:
            self.opens += 1
            self._opened.add(seq)
            self._release(True)
        return seq

    def cancel(self) -> None:
        if self.armed:
            self.armed = 0
            self.cancels += 1
            self._release(False)

    def opened(self, seq: int) -> bool:
        return seq in self._opened


class StandInGraphs(DecodeGraphs):
    """Replays that compute eagerly: the forward on the batch's sequences that are not padding (padding writes no KV:
    out_slots -1; its rows get zero logits), the sampler graph by calling the post-logits hook. Counts both kinds of
    replay. Verify graphs (query_len > 1) too: each sequence computes query_len tokens."""

    def capture(self) -> StandInGraphs:
        self.logits = torch.zeros(self.max_bs * self.query_len, self.model.cfg.vocab_size)
        self.aux = torch.zeros(self.max_bs * self.query_len, self.aux_width) if self.aux_width else None
        self.forwards: list[int] = []
        self.sampler_replays: list[int] = []
        return self

    def replay_forward(self, size: int) -> torch.Tensor:
        self.forwards.append(size)
        b, q = self.batch(size), self.query_len
        n = int((b.out_slots.view(size, q)[:, 0] >= 0).sum())  # (the padding sequences come last)
        if n == 0:  # (a cancelled gate's step: padding only)
            self.logits[: size * q] = 0.0
            return self.logits[: size * q]
        rows = ForwardBatch(
            input_ids=b.input_ids[: n * q],
            positions=b.positions[: n * q],
            out_slots=b.out_slots[: n * q],
            query_start=b.query_start[: n + 1],
            kv_lens=b.kv_lens[:n],
            page_table=b.page_table[:n],
            logits_indices=b.logits_indices[: n * q],
            is_decode=q == 1,
            max_query_len=q,
        )
        self.logits[: size * q] = 0.0
        aux = None
        if self.aux is not None:  # (an EAGLE-3 drafter's hidden states: padding rows left zero)
            self.aux[: size * q] = 0.0
            aux = self.aux[: n * q]
        self.logits[: n * q] = self.model.forward(rows, self.kv, aux_out=aux)
        return self.logits[: size * q]

    def replay_sampler(self, size: int) -> None:
        self.sampler_replays.append(size)
        q = self.query_len
        self.post_logits(self.logits[: size * q], size * q)

    gate: StandInHostGate | None = None  # (graph_llm's host_gate=True: replays queued behind it are held)

    def replay(self, size: int) -> torch.Tensor:
        gate = self.gate
        if gate is not None and gate.held is not None:
            gate.held.append(lambda: StandInGraphs.replay(self, size))
            return self.logits[: size * self.query_len]
        self.replay_forward(size)
        self.replay_sampler(size)
        return self.logits[: size * self.query_len]


def graph_llm(monkeypatch, folder: str, host_gate: bool = False, **kwargs) -> LLM:
    """An LLM on the CPU taking the CUDA-graph decode path (graphs up to cuda_graph_max_bs, 8 unless given).
    host_gate: verify steps may be queued behind a StandInHostGate (ModelRunner.arm_verify), as on a GPU."""
    monkeypatch.setattr(llm_engine_module, "unsupported_reason", lambda model: None)
    if host_gate:
        monkeypatch.setattr(model_runner_module, "host_gate_applies", lambda device: True)
        monkeypatch.setattr(model_runner_module, "HostGate", StandInHostGate)
    monkeypatch.setattr(
        llm_engine_module,
        "make_sampler",
        lambda vocab, rows, device, eos, seed: GpuSampler(vocab, rows, device, eos, seed),
    )
    monkeypatch.setattr(model_runner_module, "DecodeGraphs", StandInGraphs)
    monkeypatch.setattr(torch.cuda, "Event", DoneEvent)
    kwargs.setdefault("cuda_graph_max_bs", 8)
    llm = LLM(folder, dtype="float32", device="cpu", **kwargs)
    runner = llm.engine.runner
    assert isinstance(runner.graphs, StandInGraphs) and runner.sampler.graph_hook is not None
    runner._tokens_ready = [DoneEvent(), DoneEvent()]  # (None on the CPU: the read-back of a graph step records one)
    if host_gate:
        gate = runner._gate
        assert isinstance(gate, StandInHostGate), "no host gate: verify graphs (a speculative config) needed"
        monkeypatch.setattr(StandInGraphs, "gate", gate)
        start_read_back = runner._start_read_back

        def held_read_back(tokens):  # the copy waits behind an armed gate, as on the stream
            if gate.held is None:
                return start_read_back(tokens)
            flip = runner._flip
            runner._flip ^= 1
            host = runner._tokens_host[flip][: tokens.shape[0]]
            gate.held.append(lambda: host.copy_(tokens))
            return host, runner._tokens_ready[flip]

        runner._start_read_back = held_read_back
    return llm


def plain_llm(monkeypatch, folder: str, **kwargs) -> LLM:
    """The same engine without graphs (and the same sampler), for reference tokens."""
    monkeypatch.setattr(
        llm_engine_module,
        "make_sampler",
        lambda vocab, rows, device, eos, seed: GpuSampler(vocab, rows, device, eos, seed),
    )
    return LLM(folder, dtype="float32", device="cpu", disable_cuda_graph=True, **kwargs)
