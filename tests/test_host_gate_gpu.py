"""The host gate on the GPU (csrc/host_gate.cu, ops/host_gate.py): work queued behind it waits for the host and reads
what the host wrote after queuing it; a cancelled gate and one left closed past its timeout copy the fallbacks; and
greedy speculation with verify steps queued behind the gate gives the tokens of the same engine without it, bit for
bit (the same kernels on the same inputs)."""

from __future__ import annotations

import time

import pytest
import torch
from fastqwen import SamplingParams
from fastqwen.ops.host_gate import HostGate
from test_speculative_gpu import folder, make_llm  # noqa: F401  (folder: the checkpoint fixture)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def buffers(n: int):
    """Pinned sources, device destinations and fallbacks of n int32 each (two copies), distinct contents."""
    device = torch.device("cuda")
    src = [torch.zeros(n, dtype=torch.int32, pin_memory=True) for _ in range(2)]
    dst = [torch.full((n,), -1, dtype=torch.int32, device=device) for _ in range(2)]
    fallback = [torch.arange(n, dtype=torch.int32, device=device) + 1000 * (i + 1) for i in range(2)]
    return src, dst, fallback


@pytest.mark.parametrize("n", [4, 1028])  # one 16-byte piece; many per thread
def test_work_behind_an_open_gate_reads_what_the_host_wrote_after(n):
    gate = HostGate(torch.device("cuda"))
    src, dst, fallback = buffers(n)
    seq = gate.arm(*zip(src, dst, fallback))
    seen = [d.clone() for d in dst]  # queued behind the gate
    time.sleep(0.005)  # the GPU waits meanwhile (a gate that did not wait would copy the zeros)
    written = [torch.randint(0, 2**31 - 1, (n,), dtype=torch.int32) for _ in range(2)]
    for s, w in zip(src, written):
        s.copy_(w)
    gate.open()
    torch.cuda.synchronize()
    assert gate.opened(seq)
    for got, w in zip(seen, written):
        assert torch.equal(got.cpu(), w)


def test_the_gate_measures_how_long_the_gpu_waited():
    """waited_ns: the gate kernel's own clock from its start to the host's opening. The host holds the gate 20 ms
    after the GPU reached it (a synchronize on an event queued before the gate says it has), then 0 ms: the first
    reading sits between 20 ms and the whole span, the second far below 20 ms."""
    gate = HostGate(torch.device("cuda"))
    src, dst, fallback = buffers(4)
    torch.cuda.synchronize()
    readings = []
    for hold_s in (0.02, 0.0):
        reached = torch.cuda.Event()
        reached.record()  # (the stream's work before the gate)
        start = time.perf_counter()
        gate.arm(*zip(src, dst, fallback))
        reached.synchronize()
        time.sleep(hold_s)
        gate.open()
        torch.cuda.synchronize()
        readings.append((gate.waited_ns() / 1e9, time.perf_counter() - start))
    (held, span), (free, _) = readings
    assert 0.02 <= held <= span, readings
    assert free < 0.005, readings


def test_cancelled_and_timed_out_gates_copy_the_fallbacks():
    gate = HostGate(torch.device("cuda"), timeout_s=0.002)
    src, dst, fallback = buffers(64)
    for s in src:
        s.fill_(7)
    seq = gate.arm(*zip(src, dst, fallback))
    seen = [d.clone() for d in dst]
    gate.cancel()
    torch.cuda.synchronize()
    assert not gate.opened(seq) and all(torch.equal(a, b) for a, b in zip(seen, fallback))
    for d in dst:
        d.fill_(-1)
    seq = gate.arm(*zip(src, dst, fallback))
    seen = [d.clone() for d in dst]
    start = time.perf_counter()
    torch.cuda.synchronize()  # never opened: it gives up after 2 ms
    waited = time.perf_counter() - start
    gate.open()  # too late: nothing reads it (the next gate has another number)
    assert not gate.opened(seq) and all(torch.equal(a, b) for a, b in zip(seen, fallback))
    assert waited < 1.0
    # A later gate still opens normally.
    seq = gate.arm(*zip(src, dst, fallback))
    seen = [d.clone() for d in dst]
    gate.open()
    torch.cuda.synchronize()
    assert gate.opened(seq) and all(torch.equal(a.cpu(), s) for a, s in zip(seen, src))


def test_bad_arguments_raise():
    gate = HostGate(torch.device("cuda"))
    src, dst, fallback = buffers(8)
    with pytest.raises(ValueError):  # a source that is not pinned
        gate.arm((torch.zeros(8, dtype=torch.int32), dst[0], fallback[0]))
    with pytest.raises(ValueError):  # sizes differ
        gate.arm((src[0], dst[0][:4], fallback[0]))
    with pytest.raises(ValueError):  # (bytes not a multiple of 16 reach the extension's check)
        gate.arm((src[0][:3], dst[0][:3], fallback[0][:3]))
    assert not gate.armed


def test_gated_verify_steps_give_the_ungated_tokens(folder, monkeypatch):  # noqa: F811 (the fixture)
    """Synthetic-acceptance speculation (k = 3, greedy) over three requests ending at different steps, with and
    without the gate (FASTQWEN_VERIFY_GATE=0): the same tokens, bit for bit, and most verify steps gated."""
    prompts = [[(7 * i + 13 * b) % 200 + 3 for i in range(24 + 5 * b)] for b in range(3)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "synthetic_acceptance_length": 2.0}
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (48, 64, 80)]

    def run(gated: bool):
        monkeypatch.setenv("FASTQWEN_VERIFY_GATE", "1" if gated else "0")
        monkeypatch.setenv("FASTQWEN_VERIFY_CHAIN", "0")  # (prompt lookup's steps would be chained instead)
        llm = make_llm(folder, spec)  # (graphs up to 32: the verify graphs' max_batch_size)
        assert llm.engine.runner.verify_graphs is not None
        out = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        return llm, out

    plain_llm, reference = run(False)
    assert plain_llm.engine.runner._gate is None
    del plain_llm
    llm, out = run(True)
    runner = llm.engine.runner
    assert out == reference
    assert runner.num_gated_launches > 20 and runner.num_gate_timeouts == 0
    assert runner.num_gate_cancels <= 4  # (when a request ends and the batch's padded size changes)
    llm.engine.check_invariants()
