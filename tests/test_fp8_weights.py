"""FP8 weights on the CPU reference path: Qwen's FP8 checkpoint layout, quantize-on-load, refusals.

References are independent of the loader: block-by-block float64 dequantization written in the test, the e4m3
rounding bound, and Hugging Face transformers running the dequantized weights.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from checkpoints import FP8_PROJECTIONS, hf_greedy, load_projections_into_hf, make_checkpoint, make_fp8_checkpoint
from fastqwen import LLM, SamplingParams
from fastqwen.config import ConfigError, EngineConfig, load_model_config
from fastqwen.ops.activation import silu_and_mul
from fastqwen.ops.linear import (
    LinearWeight,
    QuantizedRows,
    dequantize_fp8,
    linear,
    linear_reference,
    linear_silu_and_mul,
    quantize_activations,
    quantize_fp8,
    quantized_input_applies,
    silu_and_mul_quantized,
)
from fastqwen.weights import load_weights

CPU = torch.device("cpu")


def fused_reference(reference: dict, layer: int, parts: list[str]) -> torch.Tensor:
    return torch.cat([reference[f"model.layers.{layer}.{p}.weight"] for p in parts])


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("fp8"))
    hf, reference = make_fp8_checkpoint(folder, seed=5)
    return folder, hf, reference


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_fp8_checkpoint_loads_block_scales(tmp_path, scale_dtype):
    folder = str(tmp_path)
    _, reference = make_fp8_checkpoint(folder, seed=1, scale_dtype=scale_dtype)
    cfg, _ = load_model_config(folder)
    assert cfg.quantization == "fp8"
    w = load_weights(folder, cfg, torch.float32, CPU, fp8=True)
    # bf16 scales times e4m3 values are exact in float32; float32 scales round once.
    tol = {"rtol": 0, "atol": 0} if scale_dtype == torch.bfloat16 else {"rtol": 2**-23, "atol": 0}
    for n, layer in enumerate(w.layers):
        assert layer.qkv.is_fp8 and layer.gate_up.is_fp8 and layer.down.is_fp8 and layer.o_proj.is_fp8
        assert layer.qkv.scale.shape == (-(-layer.qkv.out_features // 128), 1)
        for got, parts in (
            (layer.qkv, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
            (layer.o_proj, ["self_attn.o_proj"]),
            (layer.gate_up, ["mlp.gate_proj", "mlp.up_proj"]),
            (layer.down, ["mlp.down_proj"]),
        ):
            torch.testing.assert_close(got.dequantize(torch.float64), fused_reference(reference, n, parts), **tol)
    assert not w.lm_head.is_fp8 and w.lm_head.weight.dtype == torch.float32
    # quantization="none": the same values, dequantized once on load.
    dense = load_weights(folder, cfg, torch.float32, CPU, fp8=False)
    assert not dense.layers[0].gate_up.is_fp8
    torch.testing.assert_close(
        dense.layers[0].gate_up.weight.double(), fused_reference(reference, 0, ["mlp.gate_proj", "mlp.up_proj"]), **tol
    )


def test_fp8_checkpoint_greedy_matches_dequantized_hf(fp8_checkpoint):
    folder, hf, _ = fp8_checkpoint
    prompts = [[5, 17, 200, 3, 9], [11] * 20, [300, 1, 2]]
    expected = [hf_greedy(hf, p, 24) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    for quantization in ("auto", "none"):
        llm = LLM(folder, dtype="float32", device="cpu", num_pages=64, quantization=quantization)
        assert llm.engine.model.weights.layers[0].qkv.is_fp8 == (quantization == "auto")
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in outputs] == expected, quantization
    assert any(len(e) == 24 for e in expected)


def test_quantize_on_load_round_trip_within_e4m3_error(tmp_path):
    folder = str(tmp_path)
    hf = make_checkpoint(folder, tied=True, seed=2, hidden=64, intermediate=200)  # rows/cols not multiples of 128
    cfg, _ = load_model_config(folder)
    assert cfg.quantization is None
    w = load_weights(folder, cfg, torch.float32, CPU, fp8=True)
    original = hf.model.layers[1].mlp.down_proj.weight.detach().double()  # [64, 200]: a partial column block
    got = w.layers[1].down
    assert got.is_fp8 and got.scale.shape == (1, 2)
    deq = got.dequantize(torch.float64)
    for bj, cols in enumerate((slice(0, 128), slice(128, 200))):
        block = original[:, cols]
        scale = block.abs().max() / 448  # the block's largest magnitude maps to e4m3's largest finite value
        torch.testing.assert_close(got.scale[0, bj].double(), scale, rtol=2**-22, atol=0)
        # Round to nearest e4m3: half a step, 2^-4 relative for normal values and 2^-10 * scale in the subnormals.
        bound = torch.maximum(block.abs() * 2**-4, torch.full_like(block, 2**-10) * scale)
        assert ((deq[:, cols] - block).abs() <= bound * (1 + 1e-6)).all()
    assert not torch.equal(deq, original), "nothing was quantized"
    assert w.lm_head.weight is w.embed and not w.lm_head.is_fp8  # the LM head and embeddings stay dense
    # The engine on quantized-on-load weights generates what HF generates with those dequantized weights.
    load_projections_into_hf(hf, w.layers, cfg)
    prompt = [7, 8, 9, 100, 250]
    llm = LLM(folder, dtype="float32", device="cpu", num_pages=64, quantization="fp8")
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0]
    assert out.token_ids == hf_greedy(hf, prompt, 16)


def test_fp8_linear_reference_is_dequantized_matmul():
    gen = torch.Generator().manual_seed(0)
    dense = torch.randn(300, 260, generator=gen, dtype=torch.float64)
    w = LinearWeight(*quantize_fp8(dense.float()), bias=torch.randn(300, generator=gen))
    x = torch.randn(5, 260, generator=gen)
    deq = dequantize_fp8(w.weight, w.scale).double()
    want = x.double() @ deq.t() + w.bias.double()
    torch.testing.assert_close(linear_reference(x, w).double(), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(linear(x, w), linear_reference(x, w))
    with pytest.raises(ValueError, match="block scales"):
        LinearWeight(w.weight, w.scale[:1])
    with pytest.raises(ValueError, match="takes no scale"):
        LinearWeight(dense.float(), w.scale)
    with pytest.raises(ValueError, match="tokens"):
        linear(torch.randn(2, 3), w)


def test_the_silu_activation_quantized_for_down_on_the_cpu():
    """silu_and_mul_quantized without the CUDA quantizer: the reference quantizer (quantize_activations) of
    silu_and_mul's activation, rows padded to 16 with zeros; linear on QuantizedRows refuses what its GEMM cannot
    take; on the CPU the quantized path never applies, so linear_silu_and_mul with quantize_for gives the plain
    activation."""
    gen = torch.Generator().manual_seed(3)
    gate_up = torch.randn(5, 512, generator=gen).to(torch.bfloat16)
    got = silu_and_mul_quantized(gate_up)
    act = silu_and_mul(gate_up)
    q, scale = quantize_activations(torch.cat([act, torch.zeros(11, 256, dtype=act.dtype)]))
    assert got.rows == 5 and got.dtype == torch.bfloat16 and got.in_features == 256
    assert torch.equal(got.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(got.scale, scale)
    with pytest.raises(ValueError, match="multiple of 128"):
        silu_and_mul_quantized(torch.randn(5, 200))
    dense = LinearWeight(torch.randn(64, 256, generator=gen).to(torch.bfloat16))
    with pytest.raises(ValueError, match="FP8 weight"):
        linear(got, dense)
    fp8 = LinearWeight(*quantize_fp8(torch.randn(256, 256, generator=gen)))
    assert not quantized_input_applies((64, 256), torch.bfloat16, CPU, fp8)
    gate_up_w = LinearWeight(torch.randn(512, 64, generator=gen).to(torch.bfloat16))
    x = torch.randn(64, 64, generator=gen).to(torch.bfloat16)
    out = linear_silu_and_mul(x, gate_up_w, quantize_for=fp8)
    assert not isinstance(out, QuantizedRows) and torch.equal(out, linear_silu_and_mul(x, gate_up_w))


def test_the_norm_quantized_for_the_next_gemm_on_the_cpu():
    """fused_add_rms_norm_quantized without the CUDA kernel: fused_add_rms_norm (the residual updated as there), then
    the reference quantizer of its output, rows padded to 16."""
    from fastqwen.ops.norm import fused_add_rms_norm, fused_add_rms_norm_quantized

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, 256, generator=gen).to(torch.bfloat16)
    residual = torch.randn(5, 256, generator=gen).to(torch.bfloat16)
    weight = torch.rand(256, generator=gen).to(torch.bfloat16)
    want_x, want_residual = fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
    q, scale = quantize_activations(torch.cat([want_x, torch.zeros(11, 256, dtype=want_x.dtype)]))
    got, got_residual = fused_add_rms_norm_quantized(x.clone(), residual, weight, 1e-6)
    assert isinstance(got, QuantizedRows) and got.rows == 5 and got.in_features == 256
    assert torch.equal(got_residual, want_residual)
    assert torch.equal(got.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(got.scale, scale)


def _write_config(folder, quantization_config):
    make_checkpoint(str(folder), tied=True)
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(path, "w") as f:
        json.dump(config, f)


QWEN_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


@pytest.mark.parametrize(
    "quantization_config,message",
    [
        ({"quant_method": "awq", "bits": 4}, "quant_method='awq'"),
        ({"quant_method": "compressed-tensors"}, "cannot run"),
        ({**QWEN_FP8, "weight_block_size": None}, "per-tensor"),
        ({**QWEN_FP8, "weight_block_size": [1, 128]}, "weight_block_size"),
        ({**QWEN_FP8, "activation_scheme": "static"}, "activation_scheme"),
        ({**QWEN_FP8, "fmt": "e5m2"}, "fmt"),
    ],
)
def test_unsupported_quantization_is_refused(tmp_path, quantization_config, message):
    _write_config(tmp_path, quantization_config)
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path), device="cpu", num_pages=16)


def test_fp8_tensors_without_scales_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = str(tmp_path)
    make_checkpoint(folder, tied=True)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)  # what a broken export looks like: no weight_scale_inv
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="weight_scale_inv"):
        LLM(folder, device="cpu", num_pages=16)


def test_quantization_knob():
    assert EngineConfig(model="m", quantization="fp8").quantization == "fp8"
    with pytest.raises(ConfigError, match="quantization"):
        EngineConfig(model="m", quantization="int4")
    import argparse

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(parser)
    args = parser.parse_args(["--model", "m", "--quantization", "fp8"])
    assert EngineConfig.from_cli(args).quantization == "fp8"
    assert FP8_PROJECTIONS  # the layout helper names the seven projections
