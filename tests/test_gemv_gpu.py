"""The small-batch GEMV kernel (dense bf16/fp16 and FP8 weight-only) and the FP8 GEMM path, on the GPU, against the
reference: dequantize, then multiply in float32 (float64 where noted). Then the FP8 engine against the engine on
the same weights dequantized to bf16, teacher-forced, under the margin rule of test_engine_gpu.py."""

from __future__ import annotations

import importlib
import random

import pytest
import torch
import torch.nn.functional as F
from checkpoints import (
    TWO_BF16_ENGINES,
    captured_graph,
    engine_logits,
    float32_spread,
    logit_spread,
    make_checkpoint,
    make_fp8_checkpoint,
    native_setting,
    record_result,
    teacher_forced_match,
)
from fastqwen import LLM
from fastqwen.config import ModelConfig
from fastqwen.model import Qwen3Model, Qwen3WithBatch1Decode
from fastqwen.ops import _native
from fastqwen.ops.linear import (
    DENSE_GEMV_MAX_TOKENS,
    FP8_DTYPE,
    FP8_GEMV_MAX_TOKENS,
    GEMV_MAX_TOKENS,
    LinearWeight,
    fp8_gemm_supported,
    gemv,
    gemv_kernel_applies,
    linear,
    linear_silu_and_mul,
    quantize_fp8,
)
from fastqwen.weights import NormFolding, fold_norm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not _native.has_cuda_kernels(), reason="needs the CUDA kernels"),
]

# Stated tolerance of the GEMV: the fp32 sums differ from the reference's only in order (~1e-6 relative), then
# both round to bf16: within 2^-8 relative plus 1e-4 of the largest output.
RTOL = 2**-8

PRESETS = ["Qwen3-0.6B", "Qwen3-1.7B", "Qwen3-4B", "Qwen3-8B", "Qwen3-14B", "Qwen3-32B"]


def projection_shapes(preset: str) -> dict[str, tuple[int, int]]:
    cfg = ModelConfig.from_preset(preset)
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {"qkv": (q + 2 * kv, h), "o_proj": (h, q), "gate_up": (2 * i, h), "down": (h, i)}


# The tensor-core GEMV (csrc/gemv_tc.cu) takes 2 to 8 tokens (rows a multiple of 128 bytes; FP8: x fits its staging);
# the FMA kernel of csrc/gemv.cu the rest, and the same calls when the tensor cores are switched off.
TENSOR_CORE_TOKENS = range(2, 9)


# The tensor-core GEMV's FP8 pipelines (csrc/gemv_tc.cu, the last one kByGrid); 13 in a build without CUDA kernels,
# so that the test ids tests/mutation_check.py names exist wherever the tests are collected.
FP8_PIPELINES = getattr(_native.native(), "GEMV_TC_FP8_PIPELINES", 13)


def tensor_core_applies(m: int, w: LinearWeight) -> bool:
    """FP8 stages x as f16 in shared memory (at most 100 KB): 8 warps, each its ceil(k / 1024) blocks of 128 columns."""
    k = w.in_features
    staged = 8 * m * -(-k // 1024) * 128 * 2 if w.is_fp8 else 0
    return m in TENSOR_CORE_TOKENS and (k % 128 == 0 if w.is_fp8 else k % 64 == 0) and staged <= 100 * 1024


def tensor_cores(enabled: bool):
    return native_setting("set_gemv_tensor_cores", enabled)


def check_all_batches(w: LinearWeight, dtype: torch.dtype, gen: torch.Generator, max_batch: int = GEMV_MAX_TOKENS):
    """Every token count against the float32 reference; at the tensor-core kernel's counts, the FMA kernel too."""
    deq = w.dequantize(torch.float32)
    x_all = torch.randn(max_batch, w.in_features, device="cuda", generator=gen).to(dtype)
    for m in range(1, max_batch + 1):
        x = x_all[:m].contiguous()
        limit = FP8_GEMV_MAX_TOKENS if w.is_fp8 else DENSE_GEMV_MAX_TOKENS
        assert gemv_kernel_applies(x, w) == (m == 1 or (m <= limit and tensor_core_applies(m, w)))
        assert _native.native().gemv_uses_tensor_cores(m, w.in_features, w.is_fp8) == tensor_core_applies(m, w)
        want = x.float() @ deq.t()
        if w.bias is not None:
            want += w.bias.float()
        for enabled in (True, False) if tensor_core_applies(m, w) else (True,):
            with tensor_cores(enabled):
                got = gemv(x, w).float()
            torch.testing.assert_close(
                got, want, rtol=RTOL, atol=1e-4 * want.abs().max().item(), msg=f"batch {m}, tensor cores {enabled}"
            )


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("preset", PRESETS)
def test_gemv_matches_reference_on_qwen3_shapes(preset, fp8):
    gen = torch.Generator(device="cuda").manual_seed(PRESETS.index(preset))
    for name, (rows, cols) in projection_shapes(preset).items():
        dense = torch.randn(rows, cols, device="cuda", generator=gen) * 0.02
        w = LinearWeight(*quantize_fp8(dense)) if fp8 else LinearWeight(dense.to(torch.bfloat16))
        check_all_batches(w, torch.bfloat16, gen)
        del dense, w


@pytest.mark.parametrize("variant", range(1, FP8_PIPELINES))
def test_tensor_core_fp8_pipelines_equal_the_first_bit_for_bit(variant):
    """The FP8 kernel's pipelines (more weight steps in flight, fewer blocks per SM, x staged four tokens at a time)
    do the same arithmetic in the same order as pipeline 0: bitwise its output, on Qwen3-8B's and Qwen3-32B's shapes
    at every token count the tensor cores take, plain and with the SiLU epilogue; and the float32 reference's
    tolerance (with the default pipeline, whichever it is)."""
    gen = torch.Generator(device="cuda").manual_seed(50 + variant)
    for preset in ("Qwen3-8B", "Qwen3-32B"):
        for name, (rows, cols) in projection_shapes(preset).items():
            w = LinearWeight(*quantize_fp8(torch.randn(rows, cols, device="cuda", generator=gen) * 0.02))
            deq = w.dequantize(torch.float32)
            for m in [m for m in range(2, FP8_GEMV_MAX_TOKENS + 1) if tensor_core_applies(m, w)]:
                x = (torch.randn(m, cols, device="cuda", generator=gen) * 3).to(torch.bfloat16)
                calls = [lambda x=x, w=w: gemv(x, w)]
                if name == "gate_up":
                    calls.append(lambda x=x, w=w: linear_silu_and_mul(x, w, gemv_only=True))
                for call in calls:
                    with native_setting("set_gemv_tc_fp8_variant", 0):
                        first = call()
                    with native_setting("set_gemv_tc_fp8_variant", variant):
                        got = call()
                    assert torch.equal(got, first), (preset, name, m)
                want = x.float() @ deq.t()
                torch.testing.assert_close(gemv(x, w).float(), want, rtol=RTOL, atol=1e-4 * want.abs().max().item())
            del w, deq
    pipelines = _native.native().GEMV_TC_FP8_PIPELINES
    with pytest.raises(ValueError, match=f"variant {pipelines}"):
        _native.native().set_gemv_tc_fp8_variant(pipelines)


@pytest.mark.parametrize("variant", range(FP8_PIPELINES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_tensor_core_fp8_pipelines_read_every_e4m3_value_exactly(variant, dtype):
    """Every finite e4m3 byte (subnormals, both zeros, +-448) in a [256, 256] weight with unit scales; each token's x
    is one-hot at another column, so each output is a single weight, exact in bf16 and fp16: the kernel must return the
    float64 dequantization bit for bit. The pipelines that convert the weights to bf16 by placing bits (7..) get every
    byte through that conversion; the random weights of the other tests rarely hold subnormals whose error would
    survive the output's rounding."""
    rows = cols = 256
    codes = (torch.arange(rows)[:, None] + 7 * torch.arange(cols)[None, :]) % 256
    codes[(codes & 0x7F) == 0x7F] = 0  # (the two NaN bytes)
    weight = codes.to(torch.uint8).view(FP8_DTYPE).cuda()
    w = LinearWeight(weight, torch.ones(2, 2, device="cuda"))
    want = weight.double()  # [rows, cols]: the values, exactly
    for m in TENSOR_CORE_TOKENS:
        hot = [(5 + 37 * t) % cols for t in range(m)]  # columns in both 128-wide blocks
        x = torch.zeros(m, cols, device="cuda", dtype=dtype)
        x[torch.arange(m), hot] = 1
        with native_setting("set_gemv_tc_fp8_variant", variant):
            got = gemv(x, w)
        assert torch.equal(got.double(), want[:, hot].t()), (variant, m)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gemv_lm_head_odd_rows_bias_and_fp16(fp8):
    gen = torch.Generator(device="cuda").manual_seed(1)
    for rows, cols, dtype, bias in (
        (151936, 4096, torch.bfloat16, False),
        (1001, 384, torch.float16, True),
        (3, 128, torch.bfloat16, True),
    ):
        dense = torch.randn(rows, cols, device="cuda", generator=gen) * 0.02
        b = torch.randn(rows, device="cuda", generator=gen).to(dtype) if bias else None
        w = LinearWeight(*quantize_fp8(dense), b) if fp8 else LinearWeight(dense.to(dtype), None, b)
        check_all_batches(w, dtype, gen, max_batch=4 if rows > 100000 else GEMV_MAX_TOKENS)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gemv_blocks_of_4_5_and_6_rows_agree_bit_for_bit(fp8):
    """One token: how many weight rows a block takes (set_gemv_rows_per_block; the default rule picks 4, 5 or 6) changes
    which block computes a row, not its arithmetic: every choice equals the default's output bit for bit, and the
    float32 reference within the GEMV's tolerance. Row counts that leave the last block part-filled for each choice
    (5,121 = 5 x 1,024 + 1; 1,001), and a bad choice refused."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    for rows, cols in ((5121, 5120), (1001, 384)):
        dense = torch.randn(rows, cols, device="cuda", generator=gen) * 0.02
        w = LinearWeight(*quantize_fp8(dense)) if fp8 else LinearWeight(dense.to(torch.bfloat16))
        x = torch.randn(1, cols, device="cuda", generator=gen).to(torch.bfloat16)
        default = gemv(x, w)
        for block_rows in (4, 5, 6):
            with native_setting("set_gemv_rows_per_block", block_rows):
                got = gemv(x, w)
            assert torch.equal(got, default), (rows, block_rows)
        want = x.float() @ w.dequantize(torch.float32).t()
        torch.testing.assert_close(default.float(), want, rtol=RTOL, atol=1e-4 * want.abs().max().item())
    with pytest.raises(ValueError, match="4, 5 or 6"):
        _native.native().set_gemv_rows_per_block(3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_tensor_core_fp8_gemv_scales_each_token_into_f16_range(dtype):
    """The FP8 tensor-core GEMV multiplies e4m3 weights (exact in f16) with x converted to f16 after scaling each
    warp's share of a token by a power of two: exact for all but values 2^29 below the share's largest. Tokens
    10^10 apart in size (bf16 also beyond f16's 65,504), e4m3 subnormal weights, rows that only tiny
    values of x reach: each output against float64 within the bf16/fp16 rounding of the output (with fp32 sums),
    where one shared f16 scale would overflow the first token or flush the second."""
    gen = torch.Generator(device="cuda").manual_seed(17)
    rows, cols = 512, 4096
    size = 1.0 if dtype == torch.bfloat16 else 1e-3  # (fp16 outputs stay below 65,504)
    dense = torch.randn(rows, cols, device="cuda", generator=gen) * size
    dense[:, :8] = 5e-5 * size  # e4m3 subnormals once each block's largest (above 3 * size) maps to 448
    values, scales = quantize_fp8(dense)
    assert (values[:, :8].float().abs() < 2**-6).all()  # subnormal e4m3: below the smallest normal, 2^-6
    w = LinearWeight(values, scales)
    big = 3e5 if dtype == torch.bfloat16 else 6e4
    x = torch.randn(8, cols, device="cuda", generator=gen)
    x[0] *= big / x[0].abs().max()
    x[1] *= 1e-5 / x[1].abs().max()
    x[2:] *= torch.logspace(-3, 3, 6, device="cuda").unsqueeze(1)  # more tokens, of every size between
    x = x.to(dtype)
    x[1, 8:] = 0  # token 1 sees only the subnormal weights of the first 8 columns ...
    x[1, 8:16] = (1e-6 * torch.randn(8, device="cuda", generator=gen)).to(dtype)  # ... and a few normal ones
    want = x.double() @ w.dequantize(torch.float64).t()
    eps = 2**-8 if dtype == torch.bfloat16 else 2**-11
    floor = 0.0 if dtype == torch.bfloat16 else 2**-25  # half of fp16's subnormal step: tiny outputs round to it
    for m in range(2, 9):  # (one token: the FMA kernel, which works in fp32 throughout)
        got = gemv(x[:m].contiguous(), w).double()
        assert torch.isfinite(got).all()
        err = (got - want[:m]).abs()
        # Per token: the output's own rounding, plus the fp32 sums' (relative 1e-6 of the sum of |products|).
        bound = eps * want[:m].abs() + 1e-5 * (x[:m].double().abs() @ w.dequantize(torch.float64).abs().t()) + floor
        assert (err <= bound).all(), (m, (err / bound).max().item())


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gemv_silu_epilogue_is_bitwise_silu_and_mul_of_the_gemv(fp8):
    """linear_silu_and_mul's GEMV (gate and up rows in one block, silu(gate) * up in the epilogue) against the GEMV's
    plain output put through the silu_and_mul kernel: the same bits, on the MLP shapes of the presets, an odd
    intermediate size with a bias, and fp16, at every token count the kernel takes."""
    from fastqwen import ops

    gen = torch.Generator(device="cuda").manual_seed(5)
    cases = [
        (
            2 * ModelConfig.from_preset(p).intermediate_size,
            ModelConfig.from_preset(p).hidden_size,
            torch.bfloat16,
            False,
        )
        for p in ("Qwen3-0.6B", "Qwen3-8B", "Qwen3-32B")
    ]
    cases += [(2 * 1001, 384, torch.float16, True), (2, 128, torch.bfloat16, True)]
    for rows, cols, dtype, bias in cases:
        dense = torch.randn(rows, cols, device="cuda", generator=gen) * 0.05
        b = torch.randn(rows, device="cuda", generator=gen).to(dtype) if bias else None
        w = LinearWeight(*quantize_fp8(dense), b) if fp8 else LinearWeight(dense.to(dtype), None, b)
        x_all = torch.randn(GEMV_MAX_TOKENS, cols, device="cuda", generator=gen).to(dtype)
        for m in range(1, GEMV_MAX_TOKENS + 1):
            x = x_all[:m].contiguous()
            got = linear_silu_and_mul(x, w, gemv_only=True)
            want = ops.silu_and_mul(gemv(x, w))
            assert got.shape == (m, rows // 2) and torch.equal(got, want), f"{rows}x{cols} {dtype} batch {m}"
        # What linear_silu_and_mul picks at any size equals the two ops (the GEMV where it applies, else cuBLAS).
        x = x_all[:3].contiguous()
        torch.testing.assert_close(linear_silu_and_mul(x, w), ops.silu_and_mul(linear(x, w)), rtol=0, atol=0)
        del dense, w
    with pytest.raises(ValueError, match="even rows"):
        linear_silu_and_mul(x_all[:1, :128], LinearWeight(torch.randn(3, 128, device="cuda", dtype=torch.bfloat16)))


NORM_CASES = [(p, torch.bfloat16, False) for p in ("Qwen3-0.6B", "Qwen3-8B", "Qwen3-32B")] + [
    (None, torch.float16, True)
]


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("preset,dtype,bias", NORM_CASES, ids=["0.6B", "8B", "32B", "odd-fp16-bias"])
def test_norm_in_gemv_matches_float64_and_the_norm_kernel(preset, dtype, bias, fp8):
    """The RMSNorm carried by the one-token GEMVs around it. linear_add_residual (o_proj's shape): the new residual
    bit for bit the plain GEMV's output added to it. linear(..., norm=) (qkv's shape) and linear_silu_and_mul(...,
    norm=) (gate_up's): against float64 RMSNorm then projection within the output's rounding (the normalized row is
    not rounded), and against what the step ran before (fused_add_rms_norm, then the GEMV) within the roundings of
    both; with the norm weight folded into a dense W (fold_norm), within that rounding of W too."""
    from fastqwen import ops

    gen = torch.Generator(device="cuda").manual_seed(23)
    if preset is None:
        h, k_o, n_qkv, inter = 1008, 384, 640, 1001
    else:
        cfg = ModelConfig.from_preset(preset)
        h, k_o, n_qkv, inter = cfg.hidden_size, cfg.q_size, cfg.q_size + 2 * cfg.kv_size, cfg.intermediate_size
    eps = 1e-6

    def weight(rows, cols):
        dense = torch.randn(rows, cols, device="cuda", generator=gen) * 0.03
        b = torch.randn(rows, device="cuda", generator=gen).to(dtype) if bias else None
        return LinearWeight(*quantize_fp8(dense), b) if fp8 else LinearWeight(dense.to(dtype), None, b)

    w_o, w_qkv, w_gate_up = weight(h, k_o), weight(n_qkv, h), weight(2 * inter, h)
    x = torch.randn(1, k_o, device="cuda", generator=gen).to(dtype)
    residual = (4 * torch.randn(1, h, device="cuda", generator=gen)).to(dtype)
    norm_w = (1 + 0.3 * torch.randn(h, device="cuda", generator=gen)).to(dtype)

    new_residual = residual.clone()
    assert ops.linear_add_residual(x, w_o, new_residual) is new_residual
    assert torch.equal(new_residual, (gemv(x, w_o).float() + residual.float()).to(dtype))
    h_row = new_residual

    inv_rms = 1.0 / ((h_row.double() ** 2).mean() + eps).sqrt()
    normed = h_row.double() * inv_rms * norm_w.double()  # RMSNorm in float64, not rounded
    hidden, scratch = gemv(x, w_o), residual.clone()  # what the step ran before: the norm kernel, then the projection
    ops.fused_add_rms_norm(hidden, scratch, norm_w, eps)
    unit = 2**-8 if dtype == torch.bfloat16 else 2**-11  # the output type's relative rounding step

    def reference(w):
        y = normed @ w.dequantize(torch.float64).t()
        return y + w.bias.double() if w.bias is not None else y

    def products(w):  # the sum of |products| of each output: what fp32 sums and rounded inputs err relative to
        return normed.abs() @ w.dequantize(torch.float64).abs().t()

    got, want = linear(h_row, w_qkv, norm=(norm_w, eps)).double(), reference(w_qkv)
    assert ((got - want).abs() <= unit * want.abs() + 1e-5 * products(w_qkv)).all()
    before = linear(hidden, w_qkv).double()  # its row rounded twice (x / rms, then * weight)
    assert ((got - before).abs() <= 2 * unit * want.abs() + 2 * unit * products(w_qkv)).all()

    got = linear_silu_and_mul(h_row, w_gate_up, norm=(norm_w, eps)).double()
    gate_up = reference(w_gate_up)
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    want = F.silu(gate) * up
    err_in = unit * gate_up.abs() + 1e-5 * products(w_gate_up)  # each half's rounding, as for qkv
    # silu's slope is within [-0.1, 1.1]: each half's error moves the product by at most its partner's size times it.
    bound = unit * want.abs() + 1.1 * up.abs() * err_in[:, :inter] + F.silu(gate).abs() * err_in[:, inter:]
    assert ((got - want).abs() <= 2 * bound).all()

    # The norm weight folded into W's columns (dense weights only): the GEMV then reads x alone; W * g is rounded once.
    folded = LinearWeight(w_qkv.weight.clone(), w_qkv.scale, w_qkv.bias)
    g_copy = norm_w.clone()
    assert fold_norm(g_copy, folded) == (not fp8)
    if not fp8:
        assert (g_copy == 1).all()
        got = linear(h_row, folded, norm=(None, eps)).double()
        want = reference(w_qkv)
        assert ((got - want).abs() <= unit * want.abs() + (unit / 2 + 1e-5) * products(w_qkv)).all()

    with pytest.raises(ValueError, match="norm weight must have"):
        linear(h_row, w_qkv, norm=(norm_w[:-16], eps))
    native = _native.native()
    args = native.GemvArgs()
    args.out, args.x, args.w, args.m, args.n, args.k = (
        residual.data_ptr(),
        x.data_ptr(),
        w_o.weight.data_ptr(),
        1,
        h,
        k_o,
    )
    args.dtype, args.silu_gate_up, args.epilogue = _native.dtype_code(dtype), True, native.GemvEpilogue.ADD_RESIDUAL
    with pytest.raises(ValueError, match="SiLU"):
        native.gemv_norm(args)
    args.silu_gate_up = False
    with pytest.raises(ValueError, match="gemv_norm's"):  # gemv() takes the plain epilogue only
        native.gemv(args)


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_engine_norms_in_gemv_match_the_norm_kernels(tmp_path, monkeypatch, quantization):
    """Batch-1 decode with the RMSNorms carried by the GEMVs (the default) against the same engine with the norm
    kernels (norms_in_gemv=False), under the margin rule with free-running decode compared step by step. The two
    differ only in bf16 roundings: the normalized row is no longer rounded, and dense projections take the norm
    weight into their columns (W * g rounded once, prefill included). Tolerance: TWO_BF16_ENGINES times the norm-kernel
    engine's spread, its distance to a float32 engine measured here; the checkpoint is float32, so the spread holds
    the bf16 rounding of every weight too, which is where the two engines differ (W * g against W and g). Was 4%
    (measured on the H100: 2.3% without folding, 3.0% with it); the CPU estimate of the spread is 3.27% (FP8 2.87%),
    leaving 24 (26) of 96 steps decisive: at least 12 must be, a count reached at a spread of 4.25% (5.11%), 1.3x
    (1.8x) the CPU's. FP8 takes the weight-only path (the teacher-forced prefill of the block-scaled GEMM rounds
    activations to e4m3, whose noise test_fp8_engine_matches_dequantized_engine measures)."""
    linear_module = importlib.import_module("fastqwen.ops.linear")
    folder = str(tmp_path)
    make_checkpoint(
        folder,
        tied=False,
        hidden=256,
        intermediate=512,
        num_heads=4,
        num_kv_heads=2,
        head_dim=128,
        layers=4,
        logit_scale=8.0,
        seed=29,
    )
    rng = random.Random(11)
    prompts = [[rng.randrange(0, 380) for _ in range(n)] for n in (6, 150, 400)]
    kwargs = dict(
        dtype="bfloat16",
        device="cuda",
        page_size=16,
        num_pages=1024,
        max_num_batched_tokens=256,
        quantization=quantization,
    )
    monkeypatch.setattr(linear_module, "_scaled_mm_ok", False)
    kernels_llm = LLM(folder, norms_in_gemv=False, **kwargs)
    assert type(kernels_llm.engine.model) is Qwen3Model
    references = [engine_logits(kernels_llm, p, 32) for p in prompts]
    del kernels_llm
    spread = float32_spread(folder, prompts, references, **kwargs)
    tolerance = TWO_BF16_ENGINES * spread
    llm = LLM(folder, **kwargs)
    model = llm.engine.model
    assert isinstance(model, Qwen3WithBatch1Decode) and llm.engine.runner.graphs is not None
    dense = quantization == "none"
    assert model.weights.norms_folded == NormFolding(qkv=dense, gate_up=dense, lm_head=True)
    decisive, worst = teacher_forced_match(llm, prompts, references, tolerance, min_decisive=12, bound_forced=True)
    record_result(
        "gemv_gpu.json",
        f"norms_in_gemv_vs_norm_kernels_{quantization}",
        {"spread": spread, "tolerance": tolerance, "max_logit_error_frac": worst, "decisive": decisive},
    )


def make_engine_checkpoint(folder: str, seed: int) -> None:
    """The small random checkpoint of the engine-level bitwise tests: 3 layers, hidden 256, head dim 128 (the
    kernels' size), MLP 512 (whole 128 blocks for the FP8 GEMM)."""
    make_checkpoint(
        folder,
        tied=False,
        hidden=256,
        intermediate=512,
        num_heads=4,
        num_kv_heads=2,
        head_dim=128,
        layers=3,
        logit_scale=4.0,
        seed=seed,
        max_positions=2048,
    )


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_engine_with_programmatic_launch_is_bitwise_the_engine_without(tmp_path, quantization):
    """Under programmatic dependent launch every kernel of a decode step (RMSNorm, the GEMVs with and without the SiLU
    epilogue, q/k-norm + RoPE + KV write, decode attention and its merge) may start before the kernel before it ends,
    and must wait for its inputs. Same checkpoint, CUDA-graph decode at batch 1 (the GEMV's FMA kernel) and at 5
    (bf16: its tensor-core kernel; FP8: the block-scaled GEMM beside the PDL kernels), with PDL off and then on: the
    same logits, bit for bit, at every step."""
    native = _native.native()
    folder = str(tmp_path)
    make_engine_checkpoint(folder, seed=13)
    rng = random.Random(3)
    prompts = [[rng.randrange(0, 380) for _ in range(n)] for n in (5, 300, 17, 64, 1000)]
    kwargs = dict(dtype="bfloat16", device="cuda", page_size=16, num_pages=512, quantization=quantization)

    def run() -> tuple[list, list]:
        llm = LLM(folder, **kwargs)  # the graphs are captured with the launch mode set now
        assert llm.engine.runner.graphs is not None
        alone = [engine_logits(llm, p, 24) for p in prompts[:2]]
        from fastqwen import SamplingParams

        together = llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False
        )
        return alone, [o.token_ids for o in together]

    try:
        native.set_programmatic_launch(False)
        want_alone, want_together = run()
        native.set_programmatic_launch(True)
        got_alone, got_together = run()
    finally:
        native.set_programmatic_launch(True)
    for (want_tokens, want_logits), (got_tokens, got_logits) in zip(want_alone, got_alone):
        assert got_tokens == want_tokens
        assert torch.equal(got_logits, want_logits)
    assert got_together == want_together


@pytest.mark.parametrize("tokens", [1, 4])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_programmatic_launch_waits_for_the_kernel_before(fp8, tokens):
    """With programmatic dependent launch the GEMV starts while the RMSNorm or SiLU-and-mul before it still runs and
    must not read x until that kernel is done: a chain norm -> GEMV -> SiLU-and-mul -> GEMV, eager and replayed in a
    CUDA graph with fresh inputs each time, gives bitwise the results of the same chain launched without it. One
    token runs the FMA kernel, four the tensor-core kernel."""
    from fastqwen import ops

    native = _native.native()
    gen = torch.Generator(device="cuda").manual_seed(11)
    hidden, inter = 4096, 12288

    def make(rows, cols):
        return LinearWeight((torch.randn(rows, cols, device="cuda", generator=gen) * 0.02).to(torch.bfloat16))  # noqa: E731

    up, down = make(2 * inter, hidden), make(hidden, inter)
    if fp8:
        up, down = LinearWeight(*quantize_fp8(up.weight)), LinearWeight(*quantize_fp8(down.weight))
    norm_w = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    inputs = torch.randn(20, tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    x_in = torch.empty(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    normed = torch.empty_like(x_in)
    act = torch.empty(tokens, inter, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.empty(tokens, 2 * inter, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(tokens, hidden, device="cuda", dtype=torch.bfloat16)

    def chain():
        ops.rms_norm(x_in, norm_w, 1e-6, out=normed)
        gemv(normed, up, out=gate_up)
        ops.silu_and_mul(gate_up, out=act)
        gemv(act, down, out=out)
        out.copy_(gemv(linear_silu_and_mul(out, up, gemv_only=True), down))

    def run_all(graph: bool) -> torch.Tensor:
        results = []
        g = None
        if graph:
            x_in.copy_(inputs[0])
            g = captured_graph(chain)
        for i in range(inputs.shape[0]):
            x_in.copy_(inputs[i])
            g.replay() if graph else chain()
            results.append(out.clone())
        return torch.cat(results)

    try:
        native.set_programmatic_launch(False)
        want = run_all(graph=False)
        native.set_programmatic_launch(True)
        assert torch.equal(run_all(graph=False), want)
        assert torch.equal(run_all(graph=True), want)
    finally:
        native.set_programmatic_launch(True)


def test_gemv_refuses_bad_arguments():
    w = LinearWeight(torch.randn(64, 128, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(2, 129, device="cuda", dtype=torch.bfloat16)[:, 1:]  # misaligned rows: not contiguous
    native = _native.native()

    def gemv_args(out, x, w, scale, bias, m, n, k, dtype, fp8, silu_gate_up):
        args = native.GemvArgs()
        args.out, args.x, args.w, args.scale, args.bias, args.m, args.n, args.k = out, x, w, scale, bias, m, n, k
        args.dtype, args.fp8, args.silu_gate_up = _native.dtype_code(dtype), fp8, silu_gate_up
        return args

    with pytest.raises(ValueError):
        native.gemv(gemv_args(0, 0, 0, 0, 0, 1, 64, 128, torch.bfloat16, False, False))
    with pytest.raises(ValueError, match="m must be"):
        native.gemv(gemv_args(1, 16, 16, 0, 0, 17, 64, 128, torch.bfloat16, False, False))
    with pytest.raises(ValueError, match="multiple of 16"):
        native.gemv(gemv_args(16, 16, 16, 16, 0, 1, 64, 120, torch.bfloat16, True, False))
    with pytest.raises(ValueError, match="dtype"):
        native.gemv(gemv_args(16, 16, 16, 0, 0, 1, 64, 128, torch.float32, False, False))
    with pytest.raises(ValueError, match="n even"):
        native.gemv(gemv_args(16, 16, 16, 0, 0, 1, 63, 128, torch.bfloat16, False, True))
    with pytest.raises(ValueError, match="too large"):  # 2^31 16-byte chunks: beyond the kernel's 32-bit row offsets
        native.gemv(gemv_args(16, 16, 16, 0, 0, 1, 1 << 20, 1 << 14, torch.bfloat16, False, False))
    got = gemv(x, w)  # a strided x is made contiguous first
    torch.testing.assert_close(got.float(), x.float() @ w.weight.float().t(), rtol=RTOL, atol=1e-3)
    with pytest.raises(ValueError, match="does not apply"):
        gemv(torch.randn(17, 128, device="cuda", dtype=torch.bfloat16), w)


@pytest.mark.parametrize("tokens", [17, 64, 300])
def test_fp8_large_batch_path(tokens):
    """Above the GEMV threshold: scaled_mm with per-token 1x128 activation scales where supported (activations
    rounded to e4m3: stated tolerance 4% relative Frobenius error), else dequantize + bf16 GEMM (1%)."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    w = LinearWeight(*quantize_fp8(torch.randn(1024, 4096, device="cuda", generator=gen) * 0.02))
    x = torch.randn(tokens, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    got = linear(x, w).double()
    want = x.double() @ w.dequantize(torch.float64).t()
    error = ((got - want).norm() / want.norm()).item()
    scaled = fp8_gemm_supported(x.device, x.dtype, w)
    record_result("gemv_gpu.json", f"fp8_large_batch_{tokens}", {"scaled_mm": scaled, "relative_error": error})
    assert error < (0.04 if scaled else 0.01), error


@pytest.mark.parametrize("cols", [1024, 12416])
@pytest.mark.parametrize("tokens", [1, 17, 333])
def test_fp8_activation_quantizer_matches_reference(tokens, cols):
    """The CUDA quantizer against float64 math: scale = amax / 448 correctly rounded to float32 (the kernel divides in
    IEEE float32), values = e4m3(x / scale); zero padding rows with scale 1, scales column-major. (PyTorch's own
    quantize_activations divides by a scalar through its reciprocal, one ulp away at times.) Rows of 8 groups of 128
    columns, and of 97 (a block of the kernel takes 8: the last block of a row part-filled); the largest value of
    some groups in their second half (a thread holds columns of both halves)."""
    from fastqwen.ops.linear import _quantize_for_gemm

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = (
        torch.randn(tokens, cols, device="cuda", generator=gen)
        * torch.rand(tokens, 1, device="cuda", generator=gen)
        * 5
    ).to(torch.bfloat16)
    x[0, :128] = 0  # an all-zero group
    x[-1, 128 + 100] = 40.0  # group 1's largest, in its second half
    x[-1, cols - 1] = -40.0  # the last group's, at its last column
    padded = -(-tokens // 16) * 16
    q, scale = _quantize_for_gemm(x, padded)
    assert scale.stride() == (1, padded) and q.shape == (padded, cols)
    groups = x.double().view(tokens, cols // 128, 128)
    want_scale = (groups.abs().amax(-1).clamp_min(1e-12) / 448).float()
    torch.testing.assert_close(scale[:tokens], want_scale, rtol=0, atol=0)
    ratio = (groups / want_scale.double().unsqueeze(-1)).float().clamp(-448, 448)  # one rounding, as in float32
    want_q = ratio.to(torch.float8_e4m3fn).view(tokens, cols)
    same = (q[:tokens].view(torch.uint8) == want_q.view(torch.uint8)).float().mean().item()
    assert same > 0.999, same  # ties may round apart between the hardware and PyTorch conversions, nothing more
    step = (want_q.float().abs() * 2**-3).clamp_min(2**-9)  # one e4m3 step
    assert ((q[:tokens].float() - want_q.float()).abs() <= step).all()
    assert not q[tokens:].view(torch.uint8).any() and (scale[tokens:] == 1).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("tokens, d", [(17, 1024), (333, 12416)], ids=["small", "large"])
def test_silu_activation_quantized_in_one_pass_is_the_quantized_silu_and_mul(tokens, d, dtype):
    """The quantizer's silu_gate_up form (silu_and_mul_quantized) against its two steps on the GPU: silu_and_mul's
    kernel, then the quantizer: the same e4m3 values and scales, bit for bit, in both of the quantizer's forms (17
    tokens x 1,024 columns: four values a thread; 333 x 12,416: sixteen, the last block of a row part-filled); and
    the FP8 GEMM on the quantized rows gives linear's output on the activation, bit for bit. A gate/up pair whose
    product is a group's largest sits in the up half's second 64 columns."""
    from fastqwen.ops import silu_and_mul
    from fastqwen.ops.linear import QuantizedRows, _quantize_for_gemm, fp8_gemm_supported, silu_and_mul_quantized

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    gate_up = (torch.randn(tokens, 2 * d, device="cuda", generator=gen) * 3).to(dtype)
    gate_up[-1, 128 + 100], gate_up[-1, d + 128 + 100] = 6.0, 9.0  # group 1's largest product, in its second half
    got = silu_and_mul_quantized(gate_up)
    act = silu_and_mul(gate_up)
    padded = -(-tokens // 16) * 16
    want_q, want_scale = _quantize_for_gemm(act, padded)
    assert isinstance(got, QuantizedRows) and got.rows == tokens and got.dtype == dtype
    assert got.scale.stride() == want_scale.stride() and torch.equal(got.scale, want_scale)
    assert torch.equal(got.q.view(torch.uint8), want_q.view(torch.uint8))
    w = LinearWeight(*quantize_fp8(torch.randn(256, d, device="cuda", generator=gen) * 0.02))
    if fp8_gemm_supported(torch.device("cuda"), dtype, w):
        assert torch.equal(linear(got, w), linear(act, w))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("hidden", [4096, 5120])
def test_norm_quantized_in_one_pass_is_the_quantized_norm(hidden, dtype):
    """fused_add_rms_norm_quantized against its two steps on the GPU (fused_add_rms_norm's kernel, then the
    quantizer): the same residual, e4m3 values and scales, bit for bit, padding rows zero with scale 1; rows of 4,096
    (one 16-byte pack a thread) and 5,120 (two: a thread's packs in two groups) at 333 tokens. A row whose largest
    normalized value sits in the second half of a group's columns."""
    from fastqwen.ops import fused_add_rms_norm, fused_add_rms_norm_quantized
    from fastqwen.ops.linear import QuantizedRows, _quantize_for_gemm

    gen = torch.Generator(device="cuda").manual_seed(hidden)
    tokens = 333
    x = (torch.randn(tokens, hidden, device="cuda", generator=gen) * 2).to(dtype)
    x[-1, 128 + 120] = 60.0
    residual = torch.randn(tokens, hidden, device="cuda", generator=gen).to(dtype)
    weight = (torch.rand(hidden, device="cuda", generator=gen) + 0.5).to(dtype)
    want_x, want_residual = fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
    want_q, want_scale = _quantize_for_gemm(want_x, 336)
    got, got_residual = fused_add_rms_norm_quantized(x.clone(), residual, weight, 1e-6)
    assert isinstance(got, QuantizedRows) and got.rows == tokens and got.dtype == dtype
    assert torch.equal(got_residual, want_residual)
    assert got.scale.stride() == want_scale.stride() and torch.equal(got.scale, want_scale)
    assert torch.equal(got.q.view(torch.uint8), want_q.view(torch.uint8))


def test_engine_with_the_activations_quantized_where_computed_is_bitwise_the_engine_without(tmp_path, monkeypatch):
    """FASTQWEN_FP8_FUSED_QUANT=1 hands the FP8 GEMMs their inputs quantized by the kernels that compute them (the
    norms before qkv and gate_up, the SiLU before down) instead of quantized after: the same GEMM inputs, so the same
    logits, bit for bit, at every step of a long prefill (the GEMM path) and of decode steps of 5 sequences (5
    tokens: past the FP8 GEMV, the GEMM too), with CUDA graphs. And both paths are taken."""
    from fastqwen import SamplingParams

    linear_module = importlib.import_module("fastqwen.ops.linear")  # (fastqwen.ops.linear is also the function)

    folder = str(tmp_path)
    make_engine_checkpoint(folder, seed=17)
    rng = random.Random(5)
    prompts = [[rng.randrange(0, 380) for _ in range(n)] for n in (300, 5, 64, 17, 1000)]
    kwargs = dict(dtype="bfloat16", device="cuda", page_size=16, num_pages=512, quantization="fp8")
    collectives = importlib.import_module("fastqwen.ops.collectives")
    quantized_calls, norm_calls = [], []
    original, original_norm = linear_module.silu_and_mul_quantized, collectives.fused_add_rms_norm_quantized

    def counted(gate_up):
        quantized_calls.append(gate_up.shape[0])
        return original(gate_up)

    def counted_norm(x, *args):
        norm_calls.append(x.shape[0])
        return original_norm(x, *args)

    monkeypatch.setattr(linear_module, "silu_and_mul_quantized", counted)
    monkeypatch.setattr(collectives, "fused_add_rms_norm_quantized", counted_norm)

    def run(flag: str) -> tuple[list, list]:
        monkeypatch.setenv("FASTQWEN_FP8_FUSED_QUANT", flag)
        llm = LLM(folder, **kwargs)
        try:
            if not linear_module.fp8_gemm_supported(
                torch.device("cuda"), torch.bfloat16, llm.engine.runner.model.weights.layers[0].down
            ):
                pytest.skip("no block-scaled FP8 GEMM on this GPU and torch")
            alone = [engine_logits(llm, p, 16) for p in prompts[:2]]
            together = llm.generate(
                prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False
            )
            return alone, [o.token_ids for o in together]
        finally:
            llm.close()

    want_alone, want_together = run("0")
    assert not quantized_calls and not norm_calls
    got_alone, got_together = run("1")
    assert quantized_calls and max(quantized_calls) >= 300, quantized_calls
    assert norm_calls and max(norm_calls) >= 300, norm_calls
    for (want_tokens, want_logits), (got_tokens, got_logits) in zip(want_alone, got_alone):
        assert got_tokens == want_tokens
        assert torch.equal(got_logits, want_logits)
    assert got_together == want_together


# The FP8 engine, teacher-forced under the margin rule, against a reference that shares its arithmetic but for the
# roundings, each tolerance a stated multiple of a spread measured in the same run (issue 43: this test allowed 3% and
# 15% before, where the model's median top-2 margin is 5.5% of the largest logit).
# - weight_only (the FP8 GEMM off: prefill dequantizes the weight, decode runs the GEMV): against the engine on the
#   same weights dequantized to bf16. The two differ in where the dequantized weight is rounded (the GEMV never rounds
#   it) and in every bf16 rounding after it: two bf16 engines, TWO_BF16_ENGINES times the dense engine's distance to
#   float32 (the CPU estimate: 3.52%, leaving 33 of 192 steps decisive; 2.26% measured on the H100 against the dense
#   engine before). At least FP8_MIN_DECISIVE steps, a count reached at a spread of 4.75% (1.35x the CPU's).
# - scaled_mm (the block-scaled FP8 GEMM, which rounds every GEMM input to e4m3 per token and 128 columns): against
#   the same engine with the GEMM emulated in PyTorch (emulated_fp8_gemm: the reference quantizer, float64 products).
#   The spread is that emulation's distance to the same emulation summing in float32, as the tensor cores do: e4m3
#   rounds a bf16-sized difference between two engines up to a whole e4m3 step (2^-4, 16 bf16 steps) wherever a value
#   sits near a rounding boundary, so the two lie 13.7% of the largest logit apart on the CPU (3.9 bf16 spreads; the
#   e4m3 effect itself, against the dense engine, is 13.2%). Twice it leaves no step decisive, so no minimum; what the
#   test still sees is a wrong scale or layout, which moves logits by their whole size (tolerance capped at 0.5).
FP8_MIN_DECISIVE = 15


def emulated_fp8_gemm(accumulate: torch.dtype):
    """linear's block-scaled FP8 GEMM (_fp8_gemm) in PyTorch: x rounded to e4m3 per token and 128 columns by the
    reference quantizer (quantize_activations), both operands dequantized and multiplied in `accumulate`, one rounding
    to x's dtype, the bias added after as _fp8_gemm adds it. x may come quantized (QuantizedRows, from the norm or the
    SiLU that computed it: bit for bit the reference quantizer's, test_*_quantized_in_one_pass above)."""
    linear_module = importlib.import_module("fastqwen.ops.linear")

    def gemm(x, w: LinearWeight) -> torch.Tensor:
        if isinstance(x, linear_module.QuantizedRows):
            m, k, dtype = x.rows, x.in_features, x.dtype
            q, scale = x.q[:m], x.scale[:m]
        else:
            (m, k), dtype = x.shape, x.dtype
            q, scale = linear_module.quantize_activations(x.contiguous())
        xq = (q.to(accumulate).view(m, k // 128, 128) * scale.to(accumulate).unsqueeze(-1)).view(m, k)
        y = (xq @ w.dequantize(accumulate).t()).to(dtype)
        return y if w.bias is None else y + w.bias

    return gemm


@pytest.mark.parametrize("path", ["weight_only", "scaled_mm"])
def test_fp8_engine_matches_dequantized_engine(tmp_path, monkeypatch, path):
    linear_module = importlib.import_module(
        "fastqwen.ops.linear"
    )  # (fastqwen.ops.linear the attribute is the function)

    folder = str(tmp_path)
    make_fp8_checkpoint(
        folder,
        seed=9,
        hidden=256,
        intermediate=512,
        num_heads=2,
        num_kv_heads=1,
        head_dim=128,
        layers=4,
        logit_scale=8.0,
    )
    rng = random.Random(7)
    prompts = [[rng.randrange(0, 380) for _ in range(n)] for n in (6, 150, 400, 40, 90, 250)]  # 192 steps
    kwargs = dict(dtype="bfloat16", device="cuda", page_size=16, num_pages=1024, max_num_batched_tokens=256)
    if path == "weight_only":
        dense_llm = LLM(folder, quantization="none", **kwargs)
        assert not dense_llm.engine.model.weights.layers[0].qkv.is_fp8
        references = [engine_logits(dense_llm, p, 32) for p in prompts]
        del dense_llm
        spread = float32_spread(folder, prompts, references, quantization="none", **kwargs)
        min_decisive = FP8_MIN_DECISIVE
        monkeypatch.setattr(linear_module, "_scaled_mm_ok", False)
        fp8_llm = LLM(folder, **kwargs)
    else:
        fp8_llm = LLM(folder, **kwargs)  # decides, with the real GEMM, whether this torch and GPU have it
        if not linear_module._scaled_mm_ok:
            pytest.skip("this torch/GPU has no block-scaled FP8 GEMM")
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(linear_module, "_fp8_gemm", emulated_fp8_gemm(torch.float64))
            exact_sums = LLM(folder, **kwargs)
            references = [engine_logits(exact_sums, p, 32) for p in prompts]
            del exact_sums
            patch.setattr(linear_module, "_fp8_gemm", emulated_fp8_gemm(torch.float32))
            float32_sums = LLM(folder, **kwargs)
            spread = logit_spread(float32_sums, prompts, references)
            del float32_sums
        min_decisive = 0
    tolerance = TWO_BF16_ENGINES * spread
    assert tolerance <= 0.5, f"a tolerance of {tolerance:.2f} of the largest logit would pass a wrong GEMM"
    assert fp8_llm.engine.model.weights.layers[0].qkv.is_fp8 and fp8_llm.engine.runner.graphs is not None
    decisive, worst = teacher_forced_match(
        fp8_llm, prompts, references, tolerance, min_decisive=min_decisive, bound_forced=True
    )
    record_result(
        "gemv_gpu.json",
        f"fp8_engine_vs_dequantized_{path}",
        {"spread": spread, "tolerance": tolerance, "max_logit_error_frac": worst, "decisive": decisive},
    )
