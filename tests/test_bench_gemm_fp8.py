"""bench/bench_gemm_fp8.py on the CPU: the bytes and FLOPs its rows are measured against, worked out by hand for
Qwen3-8B's projections, and its variants' arithmetic (the per-tensor and bf16 GEMMs and the engine's call) against an
independent product. Its timings need a GPU."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)
from bench_gemm_fp8 import bound_us, checked, gemm_work, main, parse_args, variants_at, weight_copies  # noqa: E402


def test_the_bytes_and_flops_of_qwen3_8b_projections_by_hand():
    # qkv at M = 64: N = 4096 + 2 x 1024 = 6144, K = 4096. FP8 weight 25,165,824 bytes, its 48 x 32 float32 block
    # scales 6,144, x in bf16 524,288, out in bf16 786,432.
    assert gemm_work("engine", 64, 6144, 4096) == {"bytes": 26_482_688, "flops": 3_221_225_472}
    # ... cuBLAS's per-tensor GEMM reads x as e4m3 (262,144) and no scales.
    assert gemm_work("fp8_tensor", 64, 6144, 4096) == {"bytes": 26_214_400, "flops": 3_221_225_472}
    assert gemm_work("fp8_tensor_fast", 64, 6144, 4096) == gemm_work("fp8_tensor", 64, 6144, 4096)
    # down at M = 512: N = 4096, K = 12,288: weight 50,331,648 + 32 x 96 scales 12,288 + x e4m3 6,291,456 + its
    # 512 x 96 scales 196,608 + out 4,194,304.
    assert gemm_work("fp8_block", 512, 4096, 12288) == {"bytes": 61_026_304, "flops": 51_539_607_552}
    # gate_up at M = 16 in bf16: N = 24,576: weight 201,326,592 + x 131,072 + out 786,432.
    assert gemm_work("bf16", 16, 24576, 4096) == {"bytes": 202_244_096, "flops": 3_221_225_472}
    # The quantizer on o_proj's input at M = 256: reads 2,097,152, writes 1,048,576 e4m3 and 256 x 32 scales 32,768.
    assert gemm_work("quantize", 256, 4096, 4096) == {"bytes": 3_178_496, "flops": 0}
    # ... the row-scaled one adds a float32 scale per token (64) and per output row (6,144): 26,214,400 + 24,832.
    assert gemm_work("fp8_rowwise", 64, 6144, 4096) == {"bytes": 26_239_232, "flops": 3_221_225_472}
    with pytest.raises(ValueError, match="unknown variant"):
        gemm_work("fp8_channel", 16, 4096, 4096)
    # Bound of qkv at M = 64 at 3,000 GB/s and 1,000 TFLOP/s: the bytes' 8.83 us, not the FLOPs' 3.22 us.
    assert bound_us(gemm_work("engine", 64, 6144, 4096), 3000, 1000) == pytest.approx(8.8276, abs=1e-4)
    assert bound_us({"bytes": 1_000_000, "flops": 10**13}, 3000, 1000) == pytest.approx(10_000)


def test_work_only_takes_the_shapes_from_the_model_config(tmp_path):
    out = tmp_path / "work.json"
    assert main(["--work-only", "--batches", "16", "512", "--json", str(out)]) == 0
    work = json.loads(out.read_text())["work"]
    want = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
    assert set(work) == {f"Qwen3-8B/{name}" for name in want}
    for name, (n, k) in want.items():
        assert set(work[f"Qwen3-8B/{name}"]) == {"16", "512"}
        assert work[f"Qwen3-8B/{name}"]["512"]["bf16"] == gemm_work("bf16", 512, n, k)
        assert work[f"Qwen3-8B/{name}"]["16"]["engine"]["flops"] == 2 * 16 * n * k
        assert work[f"Qwen3-8B/{name}"]["16"]["quantize"]["bytes"] == 16 * k * 3 + 16 * (k // 128) * 4  # K, not N
    assert parse_args([]).batches == [16, 32, 64, 128, 256, 512]
    with pytest.raises(SystemExit):
        parse_args(["--shapes", "lm_head"])  # the LM head stays bf16 in the engine


def _cpu_takes_row_scales() -> bool:
    """Whether this PyTorch's CPU torch._scaled_mm takes a scale per row of x and per column of W^T (2.13's does; the
    GPU machines' 2.11 failed this test on the rowwise variant, and only the CUDA path times it)."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def test_the_variants_compute_x_times_w():
    torch.manual_seed(0)
    bf16, fp8 = weight_copies(256, 384, 2, "cpu")
    x = torch.randn(16, 384).to(torch.bfloat16)
    _, variants = variants_at(x, bf16, fp8)
    assert set(variants) == {
        "engine",
        "quantize",
        "fp8_block",
        "fp8_tensor",
        "fp8_tensor_fast",
        "fp8_rowwise",
        "bf16",
        "bf16_lt",
    }
    w8 = fp8[0].weight.float()  # the per-tensor GEMMs take the e4m3 bytes with a weight scale of 1
    independent = {
        "engine": x.float() @ fp8[0].dequantize().t(),
        "fp8_tensor": x.float() @ w8.t(),
        "fp8_tensor_fast": x.float() @ w8.t(),
        "fp8_rowwise": x.float() @ w8.t(),  # (the weight's row scales are ones)
        "bf16": x.float() @ bf16[0].float().t(),
        "bf16_lt": x.float() @ bf16[0].float().t(),
    }
    if not _cpu_takes_row_scales():
        del independent["fp8_rowwise"]
    for name, want in independent.items():
        weights, call, reference = variants[name]
        got = call(weights[0]).float()
        assert got.shape == (16, 256)
        assert ((got - want).norm() / want.norm()).item() < 0.06, name  # e4m3 rounding of x at most
        assert checked(name, weights, call, reference) < 0.01
    q, scale = variants["quantize"][1](fp8[0])
    assert q.dtype == torch.float8_e4m3fn and tuple(scale.shape) == (16, 3)


def test_a_wrong_result_is_refused():
    weights = [torch.eye(4)]
    with pytest.raises(RuntimeError, match="wrong result"):
        checked("bf16", weights, lambda w: 2 * w, lambda: torch.eye(4))
    assert checked("bf16", weights, lambda w: w, lambda: torch.eye(4)) == 0.0
    assert checked("quantize", weights, lambda w: w, None) is None
