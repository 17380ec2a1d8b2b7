"""bench/leave_out.py's switches (which step_account.py uses too) on the CPU: while a graph would be captured, a
left-out kind of work is skipped where the model really calls it. The step account at batch 256 on an H100 measured
attention as -0.001 ms when the model's attention call had moved past the switched name."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from checkpoints import make_checkpoint
from fastqwen import LLM, SamplingParams
from fastqwen.ops import attention as attention_ops

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import leave_out  # noqa: E402


@pytest.fixture
def restored_ops(monkeypatch):
    """install_switches rebinds module attributes: monkeypatch puts each back after the test."""
    from fastqwen import ops

    for name in ("paged_attention_decode", "qk_norm_rope_store_kv", "rms_norm", "fused_add_rms_norm", "linear",
                 "linear_silu_and_mul", "linear_add_residual"):  # fmt: skip
        monkeypatch.setattr(ops, name, getattr(ops, name))
    monkeypatch.setattr(attention_ops, "paged_attention_decode", attention_ops.paged_attention_decode)
    return monkeypatch


def test_left_out_decode_attention_is_not_called(tmp_path, restored_ops):
    folder = str(tmp_path)
    make_checkpoint(folder, tied=False)
    llm = LLM(folder, dtype="float32", device="cpu")
    calls = []
    real = attention_ops.paged_attention_decode

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    restored_ops.setattr(attention_ops, "paged_attention_decode", spy)
    capturing = [False]  # (the CPU build of torch has no stream capture to ask about)
    restored_ops.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    left_out = {"attention"}
    leave_out.install_switches(llm.engine.runner.model, left_out)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert calls, "the decode steps call decode attention"
    calls.clear()
    capturing[0] = True  # as while a graph is captured
    llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert not calls
