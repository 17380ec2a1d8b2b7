"""Weights: safetensors checkpoints (single or sharded), tied embeddings, fused q/k/v and gate/up, dummy weights.

q/k/v are concatenated into one [q + 2 kv, hidden] matrix and gate/up into one [2 * intermediate, hidden] matrix
at load, so each layer does two input projections instead of five.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open

from .config import ModelConfig


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size] when attention_bias
    q_norm: torch.Tensor  # [head_dim]
    k_norm: torch.Tensor  # [head_dim]
    o_proj: torch.Tensor  # [hidden, q_size]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


@dataclass
class Qwen3Weights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the same tensor as embed when tied

    def num_bytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for t in self._tensors():
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    def _tensors(self):
        yield self.embed
        yield self.final_norm
        yield self.lm_head
        for layer in self.layers:
            for t in vars(layer).values():
                if t is not None:
                    yield t


class _TensorSource:
    """Name -> tensor over one model.safetensors or a sharded set described by its index."""

    def __init__(self, folder: str):
        index = os.path.join(folder, "model.safetensors.index.json")
        single = os.path.join(folder, "model.safetensors")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            self._file_of = {name: os.path.join(folder, fname) for name, fname in weight_map.items()}
        elif os.path.isfile(single):
            with safe_open(single, framework="pt") as f:
                self._file_of = {name: single for name in f.keys()}
        else:
            raise FileNotFoundError(
                f"no model.safetensors or model.safetensors.index.json in {folder!r} "
                "(use load_format='dummy' for random weights)"
            )
        self._handles: dict[str, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str) -> torch.Tensor:
        if name not in self._file_of:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        path = self._file_of[name]
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt")
        return self._handles[path].get_tensor(name)


def _checked(t: torch.Tensor, shape: tuple[int, ...], name: str) -> torch.Tensor:
    if tuple(t.shape) != shape:
        raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {shape} from config.json")
    return t


def load_weights(folder: str, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> Qwen3Weights:
    src = _TensorSource(folder)
    h, q, kv, i, d = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.head_dim

    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return _checked(src.get(name), shape, name).to(device=device, dtype=dtype)

    layers = []
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        qkv = torch.cat(
            [
                get(p + "self_attn.q_proj.weight", (q, h)),
                get(p + "self_attn.k_proj.weight", (kv, h)),
                get(p + "self_attn.v_proj.weight", (kv, h)),
            ]
        )
        qkv_bias = None
        if cfg.attention_bias:
            qkv_bias = torch.cat(
                [
                    get(p + "self_attn.q_proj.bias", (q,)),
                    get(p + "self_attn.k_proj.bias", (kv,)),
                    get(p + "self_attn.v_proj.bias", (kv,)),
                ]
            )
        gate_up = torch.cat([get(p + "mlp.gate_proj.weight", (i, h)), get(p + "mlp.up_proj.weight", (i, h))])
        layers.append(
            LayerWeights(
                input_norm=get(p + "input_layernorm.weight", (h,)),
                qkv=qkv,
                qkv_bias=qkv_bias,
                q_norm=get(p + "self_attn.q_norm.weight", (d,)),
                k_norm=get(p + "self_attn.k_norm.weight", (d,)),
                o_proj=get(p + "self_attn.o_proj.weight", (h, q)),
                post_norm=get(p + "post_attention_layernorm.weight", (h,)),
                gate_up=gate_up,
                down=get(p + "mlp.down_proj.weight", (h, i)),
            )
        )
    embed = get("model.embed_tokens.weight", (cfg.vocab_size, h))
    if cfg.tie_word_embeddings:
        lm_head = embed
    else:
        lm_head = get("lm_head.weight", (cfg.vocab_size, h))
    return Qwen3Weights(embed=embed, layers=layers, final_norm=get("model.norm.weight", (h,)), lm_head=lm_head)


def dummy_weights(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0) -> Qwen3Weights:
    """Random weights with the real shapes, made on the device (no checkpoint needed, for benchmarks)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    h, q, kv, i, d = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.head_dim

    def rand(*shape: int, std: float = 0.02) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=device)
        return t.normal_(0.0, std, generator=gen)

    def norm(n: int) -> torch.Tensor:
        # Near one, like trained norms, but not exactly one so that a wrong weight shows up.
        return 1.0 + rand(n, std=0.05)

    layers = [
        LayerWeights(
            input_norm=norm(h),
            qkv=rand(q + 2 * kv, h),
            qkv_bias=rand(q + 2 * kv) if cfg.attention_bias else None,
            q_norm=norm(d),
            k_norm=norm(d),
            o_proj=rand(h, q),
            post_norm=norm(h),
            gate_up=rand(2 * i, h),
            down=rand(h, i),
        )
        for _ in range(cfg.num_layers)
    ]
    embed = rand(cfg.vocab_size, h)
    lm_head = embed if cfg.tie_word_embeddings else rand(cfg.vocab_size, h)
    return Qwen3Weights(embed=embed, layers=layers, final_norm=norm(h), lm_head=lm_head)


# Where checkpoints quantized for an FP8 KV cache keep each layer's scales (scalar tensors), as vLLM reads them.
_KV_SCALE_NAMES = {
    "k": ("self_attn.k_scale", "self_attn.k_proj.output_scale", "self_attn.kv_scale"),
    "v": ("self_attn.v_scale", "self_attn.v_proj.output_scale", "self_attn.kv_scale"),
}


def load_kv_scales(folder: str, num_layers: int) -> tuple[list[float] | None, list[float] | None]:
    """Per-layer K and V scales of an FP8 KV cache (cached value = value / scale), or None for each that the
    checkpoint does not provide for every layer."""
    src = _TensorSource(folder)
    found = {}
    for which, names in _KV_SCALE_NAMES.items():
        scales = []
        for n in range(num_layers):
            name = next((f"model.layers.{n}.{s}" for s in names if f"model.layers.{n}.{s}" in src), None)
            if name is None:
                break
            value = src.get(name).float()
            if value.numel() != 1:
                raise ValueError(f"tensor {name!r} must hold one scale, not {value.numel()}")
            scales.append(float(value.item()))
        found[which] = scales if len(scales) == num_layers else None
    return found["k"], found["v"]

