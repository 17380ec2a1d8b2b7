"""Model configuration: Qwen3's config.json and generation_config.json, plus named shape presets.

Only what the engine needs is kept; everything comes from the checkpoint's own files so that any
dense Qwen3 (0.6B to 32B) loads without a table of special cases.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import InvalidRequestError

# Real Qwen3 dense shapes, for load_format="dummy" benchmarks with no checkpoint on disk.
# (hidden, intermediate, layers, query heads, tied embeddings); all have 8 KV heads of dim 128.
_PRESET_SHAPES = {
    "Qwen3-0.6B": (1024, 3072, 28, 16, True),
    "Qwen3-1.7B": (2048, 6144, 28, 16, True),
    "Qwen3-4B": (2560, 9728, 36, 32, True),
    "Qwen3-8B": (4096, 12288, 36, 32, False),
    "Qwen3-14B": (5120, 17408, 40, 40, False),
    "Qwen3-32B": (5120, 25600, 64, 64, False),
}
PRESETS = tuple(_PRESET_SHAPES)

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    torch_dtype: str | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        model_type = cfg.get("model_type")
        if model_type not in (None, "qwen3"):
            raise ValueError(f"fastqwen serves dense Qwen3 models; this checkpoint is model_type={model_type!r}")
        if cfg.get("rope_scaling") not in (None, {}) and (cfg["rope_scaling"] or {}).get("rope_type", "default") != "default":
            raise ValueError(f"rope_scaling {cfg['rope_scaling']!r} is not supported")
        # transformers >= 5 nests rope_theta in rope_parameters; older configs have it at the top level.
        rope = cfg.get("rope_parameters") or {}
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads", num_heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 40960),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            eos_token_ids=_as_id_list(eos),
            bos_token_id=cfg.get("bos_token_id"),
        )

    @classmethod
    def from_preset(cls, name: str) -> "ModelConfig":
        key = name.split("/")[-1]
        if key not in _PRESET_SHAPES:
            raise InvalidRequestError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}", "model")
        hidden, inter, layers, heads, tied = _PRESET_SHAPES[key]
        return cls(
            vocab_size=151936,
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=8,
            head_dim=128,
            tie_word_embeddings=tied,
            torch_dtype="bfloat16",
            eos_token_ids=[151645, 151643],
            bos_token_id=151643,
        )


@dataclass
class GenerationDefaults:
    """generation_config.json: the EOS ids to stop on and default sampling values."""

    eos_token_ids: list[int] = field(default_factory=list)
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    do_sample: bool | None = None

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "GenerationDefaults":
        return cls(
            eos_token_ids=_as_id_list(cfg.get("eos_token_id")),
            temperature=cfg.get("temperature"),
            top_k=cfg.get("top_k"),
            top_p=cfg.get("top_p"),
            min_p=cfg.get("min_p"),
            repetition_penalty=cfg.get("repetition_penalty"),
            do_sample=cfg.get("do_sample"),
        )


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def is_preset(model: str) -> bool:
    return model.split("/")[-1] in _PRESET_SHAPES and not os.path.isdir(model)


def load_model_config(model: str) -> tuple[ModelConfig, GenerationDefaults]:
    """Config for a checkpoint folder, a config.json path, or a preset name."""
    if is_preset(model):
        cfg = ModelConfig.from_preset(model)
        return cfg, GenerationDefaults(eos_token_ids=list(cfg.eos_token_ids))
    path = model if os.path.isdir(model) else os.path.dirname(model)
    config_file = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if not os.path.isfile(config_file):
        raise InvalidRequestError(
            f"unknown model {model!r}: pass a checkpoint folder, a config.json, or a preset "
            f"({', '.join(PRESETS)}) with load_format='dummy'",
            "model",
        )
    with open(config_file) as f:
        cfg = ModelConfig.from_dict(json.load(f))
    gen_file = os.path.join(path, "generation_config.json")
    gen = GenerationDefaults()
    if os.path.isfile(gen_file):
        with open(gen_file) as f:
            gen = GenerationDefaults.from_dict(json.load(f))
    if not gen.eos_token_ids:
        gen.eos_token_ids = list(cfg.eos_token_ids)
    return cfg, gen


def resolve_dtype(dtype: str | torch.dtype, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if cfg.torch_dtype in _DTYPES:
            return _DTYPES[cfg.torch_dtype]
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto', 'bfloat16', 'float16' or 'float32', not {dtype!r}")
    return _DTYPES[dtype]
