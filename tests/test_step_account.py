"""bench/step_account.py on the CPU: its arguments, and the bytes and FLOPs its bounds are made of, against Qwen3-8B's
figures worked out by hand (issue 47: the projections' 3.6 TFLOP at batch 256, the KV of 256 sequences at 640 tokens
24 GB). Its timings need a GPU."""

from __future__ import annotations

import json
import os
import sys

import pytest
from fastqwen.config import ModelConfig

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)
from step_account import bound_ms, main, parse_args, step_work  # noqa: E402

# Qwen3-8B per layer: qkv 4096 -> 4096 + 2 x 1024, o 4096 -> 4096, gate and up 4096 -> 2 x 12,288, down 12,288 -> 4096.
PARAMS_8B = 36 * (4096 * 6144 + 4096 * 4096 + 4096 * 24576 + 12288 * 4096)  # 6.95 billion
LM_HEAD_8B = 151936 * 4096


def test_arguments_default_to_the_issues_account():
    args = parse_args([])
    assert (args.model, args.load_format, args.batches, args.context) == ("Qwen3-8B", "dummy", [64, 256, 512], 640)
    assert args.max_num_seqs == args.cuda_graph_max_bs == 512  # every batch asked for runs, whatever the pool
    args = parse_args(["--batches", "32", "--max-num-seqs", "40", "--quantization", "fp8"])
    assert (args.max_num_seqs, args.cuda_graph_max_bs, args.quantization) == (40, 32, "fp8")


def test_the_work_of_a_qwen3_8b_step_by_hand():
    cfg = ModelConfig.from_preset("Qwen3-8B")
    work = step_work(cfg, 256, 640, weight_bytes=2, kv_bytes=2)
    assert work["projections"]["flops"] == 2 * 256 * PARAMS_8B == pytest.approx(3.556e12, rel=1e-3)
    activations = 36 * 256 * 2 * (4096 + 6144 + 4096 + 4096 + 4096 + 24576 + 12288 + 4096 + 3 * 12288)
    assert work["projections"]["bytes"] == 2 * PARAMS_8B + activations
    kv = 256 * 640 * 36 * 2 * 8 * 128 * 2  # K and V of 8 heads of 128, 2 bytes each
    assert kv == pytest.approx(24.2e9, rel=1e-2)
    assert work["attention"]["bytes"] == kv + 36 * 256 * 2 * 4096 * 2  # + q read and the output written
    assert work["lm_head"]["flops"] == 2 * 256 * LM_HEAD_8B
    assert work["lm_head"]["bytes"] == 2 * LM_HEAD_8B + 256 * 4096 * 2 + 256 * 151936 * (2 + 2 + 4)
    assert work["sampler"]["bytes"] == 256 * 151936 * 4
    norms = 36 * 2 * 4 * 256 * 4096 * 2
    rope = 36 * 256 * 2 * (6144 + 4096) + 36 * 256 * 2 * 1024 * 2
    assert work["norms_rope"]["bytes"] == norms + rope
    fp8 = step_work(cfg, 256, 640, weight_bytes=1, kv_bytes=1)
    assert work["projections"]["bytes"] - fp8["projections"]["bytes"] == PARAMS_8B  # one byte a weight fewer
    assert work["attention"]["bytes"] - fp8["attention"]["bytes"] == kv // 2
    # At 3,350 GB/s and 990 TFLOP/s (an H100's data sheet) the projections at 256 are bound by their weight reads.
    assert bound_ms(work["projections"], 3350, 990) == pytest.approx(work["projections"]["bytes"] / 3.35e9)


def test_work_only_runs_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "work.json"
    assert main(["--work-only", "--batches", "64", "512", "--kv-cache-dtype", "fp8_e4m3", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["kv_len"] == 640 + 64 - 1 and set(result["work"]) == {"64", "512"}
    cfg = ModelConfig.from_preset("Qwen3-8B")
    assert result["work"]["512"] == step_work(cfg, 512, 703, weight_bytes=2, kv_bytes=1)


def test_the_timed_steps_keep_their_overlap(tmp_path, monkeypatch):
    """decode_step_ms on a tiny CPU engine, with torch told a GPU is there: it syncs the device once (to copy one full
    step's inputs), not at every step that decodes every prompt (a sync per step serialized the host with the GPU and
    read 24 ms a step at batch 256 on an H100 against an 18 ms replay); the inputs and KV length are that step's."""
    import torch
    from checkpoints import make_checkpoint
    from fastqwen import LLM
    from step_account import decode_step_ms

    make_checkpoint(str(tmp_path), tied=False)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", max_num_batched_tokens=256, num_pages=512, page_size=16)
    syncs = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(1))
    prompts = [[(7 * i + 13 * b + 1) % 200 + 3 for i in range(100)] for b in range(8)]
    ms, inputs, kv_len = decode_step_ms(llm, prompts, 24)
    assert len(syncs) == 1
    assert ms > 0 and inputs.numel() > 0
    assert 101 <= kv_len < 100 + 24  # the first full step: after every prompt was admitted, before any finished
