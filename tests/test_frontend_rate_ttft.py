"""bench/frontend_rate.py --ttft-lens on the CPU: the real server before a synthetic core, one request at a time;
each length's requests must be prompts of that many tokens as the server counted them (the stream's usage), and the
median reported must be the median of the runs reported."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest
from checkpoints import qwen_tokenizer_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(qwen_tokenizer_files() is None, reason="the synthetic core streams words of Qwen3's tokenizer")
def test_ttft_by_length_measures_prompts_of_each_length(tmp_path):
    folder, out = tmp_path / "model", tmp_path / "ttft.json"
    bench = os.path.join(ROOT, "bench")
    subprocess.run(
        [sys.executable, os.path.join(bench, "make_dummy_checkpoint.py"), "--preset", "Qwen3-0.6B", "--out", folder],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    subprocess.run(
        [sys.executable, os.path.join(bench, "frontend_rate.py"), "--model", folder, "--replicas", "1",
         "--ttft-lens", "16", "300", "--ttft-repeats", "3", "--json", out],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    figures = json.loads(out.read_text())
    rows = figures["ttft_by_length"]
    assert [r["prompt_tokens"] for r in rows] == [16, 300]
    for row in rows:
        assert row["prompt_tokens_seen"] == [row["prompt_tokens"]]
        assert len(row["runs_ms"]) == 3 and all(0 < t < 5000 for t in row["runs_ms"])
        assert row["ttft_ms"] == pytest.approx(statistics.median(row["runs_ms"]), abs=1e-3)
    assert figures["settings"]["step_ms"] == 0.0  # the core answers at once unless --step-ms says otherwise
