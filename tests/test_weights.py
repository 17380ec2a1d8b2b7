"""Checkpoint loading: sharded safetensors, tied and untied embeddings, dtype selection, presets, bad folders."""

from __future__ import annotations

import json
import os

import pytest
import torch
from checkpoints import EOS_IDS, make_checkpoint
from fastqwen import LLM, SamplingParams
from fastqwen.config import PRESETS, ModelConfig, load_model_config, resolve_dtype
from fastqwen.weights import load_weights


def test_sharded_checkpoint_loads_like_single(tmp_path):
    single, sharded = str(tmp_path / "single"), str(tmp_path / "sharded")
    make_checkpoint(single, tied=False, seed=3)
    make_checkpoint(sharded, tied=False, seed=3, max_shard_size="60KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    cfg, _ = load_model_config(single)
    a = load_weights(single, cfg, torch.float32, torch.device("cpu"))
    b = load_weights(sharded, cfg, torch.float32, torch.device("cpu"))
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(la.qkv.weight, lb.qkv.weight) and torch.equal(la.gate_up.weight, lb.gate_up.weight)


def test_fused_projections_match_hf_tensors(tmp_path):
    folder = str(tmp_path)
    hf = make_checkpoint(folder, tied=True, seed=4)
    cfg, gen = load_model_config(folder)
    assert gen.eos_token_ids == EOS_IDS
    w = load_weights(folder, cfg, torch.float32, torch.device("cpu"))
    attn = hf.model.layers[1].self_attn
    q, k, v = w.layers[1].qkv.weight.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
    assert torch.equal(q, attn.q_proj.weight) and torch.equal(k, attn.k_proj.weight)
    assert torch.equal(v, attn.v_proj.weight)
    gate, up = w.layers[1].gate_up.weight.chunk(2)
    assert torch.equal(gate, hf.model.layers[1].mlp.gate_proj.weight)
    assert torch.equal(up, hf.model.layers[1].mlp.up_proj.weight)
    assert w.lm_head.weight is w.embed, "tied embeddings must share one tensor"


@pytest.mark.parametrize(
    "dtype,expected", [("bfloat16", torch.bfloat16), ("float16", torch.float16), ("float32", torch.float32)]
)
def test_dtype_selection(tmp_path, dtype, expected):
    folder = str(tmp_path)
    make_checkpoint(folder, tied=False, dtype=torch.bfloat16)
    cfg, _ = load_model_config(folder)
    assert resolve_dtype("auto", cfg, torch.device("cpu")) == torch.bfloat16  # from config.json's dtype
    w = load_weights(folder, cfg, resolve_dtype(dtype, cfg, torch.device("cpu")), torch.device("cpu"))
    assert w.embed.dtype == expected and w.layers[0].qkv.weight.dtype == expected
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8", cfg, torch.device("cpu"))


def test_presets_have_real_qwen3_shapes():
    groups = {}
    for name in PRESETS:
        cfg = ModelConfig.from_preset(name)
        assert cfg.num_kv_heads == 8 and cfg.head_dim == 128 and cfg.vocab_size == 151936
        groups[name] = cfg.num_heads // cfg.num_kv_heads
    assert groups == {"Qwen3-0.6B": 2, "Qwen3-1.7B": 2, "Qwen3-4B": 4, "Qwen3-8B": 4, "Qwen3-14B": 5, "Qwen3-32B": 8}
    with pytest.raises(ValueError, match="preset"):
        ModelConfig.from_preset("Qwen3-3B")


def test_dummy_weights_from_config_json(tmp_path):
    folder = str(tmp_path)
    make_checkpoint(folder, tied=False)
    os.remove(os.path.join(folder, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="dummy"):
        LLM(folder, device="cpu")
    llm = LLM(os.path.join(folder, "config.json"), device="cpu", load_format="dummy", num_pages=32)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 3


def test_preset_requires_dummy_and_unknown_model_type_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="dummy"):
        LLM("Qwen3-0.6B", device="cpu")
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="Qwen3"):
        LLM(str(folder), device="cpu")


@pytest.mark.parametrize("fp8,tied", [(False, False), (False, True), (True, False)], ids=["dense", "tied", "fp8"])
def test_fold_norms_keeps_every_normed_projection(fp8, tied):
    """Norm folding (for the batch-1 decode whose GEMVs carry the norms) moves each norm weight g into the dense
    projection after it: RMSNorm(x; g) @ W^T before equals RMSNorm(x; folded g) @ (folded W)^T after, in float64 from
    the float32 tensors (float32 products: within 1e-6 relative), and the norm weight is then ones. FP8 projections and
    a tied LM head (the embedding) keep theirs."""
    from fastqwen.weights import NormFolding, dummy_weights, fold_norms

    cfg = ModelConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        tie_word_embeddings=tied,
    )
    weights = dummy_weights(cfg, torch.float32, torch.device("cpu"), seed=4, fp8=fp8)
    x = torch.randn(3, cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt()  # RMSNorm without its weight

    def normed_projections():
        pairs = [(layer.input_norm, layer.qkv) for layer in weights.layers]
        pairs += [(layer.post_norm, layer.gate_up) for layer in weights.layers] + [
            (weights.final_norm, weights.lm_head)
        ]
        return [(x * g.double()) @ w.dequantize(torch.float64).t() for g, w in pairs]

    before = normed_projections()
    embed = weights.embed.clone()
    folding = fold_norms(weights)
    assert folding == weights.norms_folded == NormFolding(qkv=not fp8, gate_up=not fp8, lm_head=not tied)
    for want, got in zip(before, normed_projections()):
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
    layer = weights.layers[0]
    assert bool((layer.input_norm == 1).all()) == (not fp8) and bool((weights.final_norm == 1).all()) == (not tied)
    assert torch.equal(weights.embed, embed)  # a tied LM head is the embedding: never scaled
    with pytest.raises(ValueError, match="folded already"):
        fold_norms(weights)
