"""bench/throughput.py's account of a run's steps on the CPU: decode-only steps against steps with prefill work, by
hand on made-up steps, and on a real engine's run, whose recorded output tokens must add up to its results'."""

from __future__ import annotations

import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)
from checkpoints import make_checkpoint  # noqa: E402
from throughput import recording_steps, step_breakdown  # noqa: E402


def test_steps_are_charged_the_time_since_the_step_before():
    # A first step of prompts only, two decodes of 64, a step of decodes and a prefill chunk, then a decode of 128.
    steps = [(10.5, 512, 0), (10.52, 64, 64), (10.54, 64, 64), (10.64, 8256, 128), (10.66, 128, 128)]
    got = step_breakdown(10.0, steps)
    assert got["decode_only"]["steps"] == 3 and got["with_prefill"]["steps"] == 2
    assert got["decode_only"]["seconds"] == pytest.approx(0.06, abs=1e-9)  # 20 ms each
    assert got["with_prefill"]["seconds"] == pytest.approx(0.5 + 0.1, abs=1e-9)
    assert got["decode_only"]["output_tokens"] == 256 and got["with_prefill"]["output_tokens"] == 128
    assert got["decode_step_median_ms"] == pytest.approx(20.0)
    assert step_breakdown(0.0, [])["decode_step_median_ms"] is None


def test_a_real_runs_steps_add_up_to_its_outputs(tmp_path):
    from fastqwen import LLM, SamplingParams

    make_checkpoint(str(tmp_path), tied=True, seed=5, max_positions=512, layers=1)
    llm = LLM(model=str(tmp_path), max_num_batched_tokens=64)
    steps = recording_steps(llm.engine)
    prompts = [list(range(10, 10 + n)) for n in (100, 30, 7)]  # 100 tokens: two chunks of 64
    results = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    got = step_breakdown(steps[0][0] - 0.001, steps)
    assert sum(r.num_completion_tokens for r in results) == 15
    assert got["decode_only"]["output_tokens"] + got["with_prefill"]["output_tokens"] == 15
    assert got["with_prefill"]["steps"] >= 2  # the first chunk, at least, outputs nothing yet
    assert got["decode_only"]["steps"] >= 4  # the last tokens of the three, decoded together
    assert got["decode_only"]["steps"] + got["with_prefill"]["steps"] == len(steps)
