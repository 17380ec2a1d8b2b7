"""bench/bench_gemv.py's projection shapes per tensor-parallel rank (issue 46: the GEMVs at the shard shapes), worked
out by hand from the models' configs: heads, KV heads (split, or one replicated past their count), intermediate
features and the padded vocabulary slice. Its timings need a GPU."""

from __future__ import annotations

import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)
from bench_gemv import shapes  # noqa: E402


def test_qwen3_8b_whole_and_at_tp2():
    # 32 query heads, 8 KV heads, head dim 128, hidden 4,096, intermediate 12,288, vocabulary 151,936.
    assert shapes("Qwen3-8B") == {
        "qkv": (32 * 128 + 2 * 8 * 128, 4096),
        "o_proj": (4096, 4096),
        "gate_up": (2 * 12288, 4096),
        "down": (4096, 12288),
        "lm_head": (151936, 4096),
    }
    assert shapes("Qwen3-8B", 2) == {
        "qkv": (16 * 128 + 2 * 4 * 128, 4096),
        "o_proj": (4096, 2048),
        "gate_up": (2 * 6144, 4096),
        "down": (4096, 6144),
        "lm_head": (75968, 4096),
    }


def test_qwen3_32b_at_tp2_and_with_replicated_kv_heads():
    # 64 query heads, 8 KV heads, hidden 5,120, intermediate 25,600. At TP=16 each rank has 4 query heads and one
    # KV head (replicated on two ranks); the vocabulary slice is ceil(151,936 / 16) rows.
    assert shapes("Qwen3-32B", 2)["qkv"] == (32 * 128 + 2 * 4 * 128, 5120)
    assert shapes("Qwen3-32B", 2)["down"] == (5120, 12800)
    at16 = shapes("Qwen3-32B", 16)
    assert at16["qkv"] == (4 * 128 + 2 * 128, 5120)
    assert at16["o_proj"] == (5120, 512)
    assert at16["lm_head"] == (9496, 5120)


def test_a_size_that_does_not_divide_the_model_is_refused():
    with pytest.raises(ValueError, match="tensor parallel size 3"):
        shapes("Qwen3-8B", 3)
