"""Model configuration: Qwen3's config.json and generation_config.json, plus named shape presets.

Only what the engine needs is kept; everything comes from the checkpoint's own files so that any
dense Qwen3 (0.6B to 32B) loads without a table of special cases.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    import torch

# Dtype names to torch's attribute names: torch is imported only when a dtype is resolved (by the engine), so that
# the frontend and the server, which read this module for its knobs, do not load it.
_DTYPES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
}


def _is_torch_dtype(value: Any) -> bool:
    torch = sys.modules.get("torch")  # a torch.dtype cannot exist before torch is imported
    return torch is not None and isinstance(value, torch.dtype)


# ---- RoPE scaling -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class YarnScaling:
    """YaRN (rope_type "yarn"), Qwen's documented way past the pretraining length: the inverse frequencies interpolated
    by `factor` where a dimension turns fewer than beta_slow times over the original length, kept where it turns more
    than beta_fast times, ramped between; cos and sin multiplied by an attention factor. Static, as in transformers:
    the same scaling at every length. ops/rope_kv.py turns it into the cos/sin cache, exactly as transformers does."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # None: derived from factor (and mscale / mscale_all_dim)
    truncate: bool = True  # round the ramp's ends to whole dimensions

    @property
    def context_length(self) -> int:
        return int(self.factor * self.original_max_position_embeddings)


# What a yarn rope_scaling may hold (transformers' own list, plus rope_theta and the old key "type").
_YARN_KEYS = {
    "rope_type",
    "type",
    "rope_theta",
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "truncate",
    "partial_rotary_factor",
}


def rope_from_dict(rope: Any, rope_theta: float, max_position_embeddings: int) -> tuple[float, YarnScaling | None]:
    """(rope_theta, YaRN or None) from a rope_scaling / rope_parameters object, read as transformers 5 reads it:
    rope_type (or the old key "type") "default" or "yarn"; the object's own rope_theta over the one given;
    original_max_position_embeddings defaults to max_position_embeddings; beta_fast / beta_slow left out or 0 mean
    32 / 1. Any other rope_type, an unknown key or a value out of range is a ValueError that names it."""
    if not isinstance(rope, dict):
        raise ValueError(f"rope_scaling must be a JSON object, not {rope!r}")
    theta = rope.get("rope_theta", rope_theta)
    if not _number(theta) or theta <= 0:
        raise ValueError(f"rope_theta must be a positive number, not {theta!r}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "yarn":
        raise ValueError(
            f"rope_scaling rope_type {rope_type!r} is not supported: fastqwen runs RoPE unscaled (rope_type "
            "'default') or with YaRN (rope_type 'yarn')"
        )
    unknown = sorted(set(rope) - _YARN_KEYS)
    if unknown:
        raise ValueError(f"rope_scaling of rope_type 'yarn' has unknown keys {unknown}")

    def value(key: str, default: Any, ok, what: str) -> Any:
        found = rope.get(key, default)
        if not ok(found):
            raise ValueError(f"rope_scaling's {key} must be {what}, not {found!r}")
        return found

    factor = value("factor", None, lambda v: _number(v) and v >= 1, "a number >= 1")
    original = value("original_max_position_embeddings", max_position_embeddings, _positive_int, "a positive integer")
    optional_positive = lambda v: v is None or (_number(v) and v > 0)  # noqa: E731
    beta_fast = value("beta_fast", None, lambda v: v is None or _number(v), "a number") or 32
    beta_slow = value("beta_slow", None, lambda v: v is None or _number(v), "a number") or 1
    value("partial_rotary_factor", 1.0, lambda v: v == 1, "1 (Qwen3 rotates whole heads)")
    return float(theta), YarnScaling(
        factor=float(factor),
        original_max_position_embeddings=original,
        beta_fast=float(beta_fast),
        beta_slow=float(beta_slow),
        mscale=value("mscale", None, lambda v: v is None or _number(v), "a number"),
        mscale_all_dim=value("mscale_all_dim", None, lambda v: v is None or _number(v), "a number"),
        attention_factor=value("attention_factor", None, optional_positive, "a positive number"),
        truncate=value("truncate", True, lambda v: isinstance(v, bool), "true or false"),
    )


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value  # not NaN


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
    quantization: str | None = None  # the checkpoint's own: None (dense) or "fp8" (Qwen's block-scaled FP8 layout)
    rope_scaling: YarnScaling | None = None  # None: plain RoPE

    @property
    def context_length(self) -> int:
        """The longest sequence the model is made for: with YaRN, factor x the pretraining length (Qwen3: 4 x 32,768
        = 131,072, as Qwen documents it and vLLM derives it), else max_position_embeddings."""
        if self.rope_scaling is not None:
            return self.rope_scaling.context_length
        return self.max_position_embeddings

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_parameters(self) -> int:
        """Parameters of the checkpoint, counted from the shapes (the LM head once more when it is not tied)."""
        h = self.hidden_size
        attention = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 2 * self.head_dim  # + q/k norms
        if self.attention_bias:
            attention += self.q_size + 2 * self.kv_size
        layer = attention + 3 * h * self.intermediate_size + 2 * h  # MLP, two norms
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * layer + h

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type")
        if model_type not in (None, "qwen3"):
            raise ValueError(f"fastqwen serves dense Qwen3 models; this checkpoint is model_type={model_type!r}")
        # transformers >= 5 nests the RoPE parameters (rope_theta, and rope_type with its scaling) in rope_parameters;
        # older configs have rope_theta at the top level and the scaling in rope_scaling, which wins where both are.
        max_positions = cfg.get("max_position_embeddings", 40960)
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        rope_theta, yarn = rope_from_dict(rope, cfg.get("rope_theta", 1_000_000.0), max_positions)
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
            rope_theta=rope_theta,
            max_position_embeddings=max_positions,
            rope_scaling=yarn,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            eos_token_ids=_as_id_list(eos),
            bos_token_id=cfg.get("bos_token_id"),
            quantization=checkpoint_quantization(cfg.get("quantization_config")),
        )

    @classmethod
    def from_preset(cls, name: str) -> ModelConfig:
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
    def from_dict(cls, cfg: dict[str, Any]) -> GenerationDefaults:
        return cls(
            eos_token_ids=_as_id_list(cfg.get("eos_token_id")),
            temperature=cfg.get("temperature"),
            top_k=cfg.get("top_k"),
            top_p=cfg.get("top_p"),
            min_p=cfg.get("min_p"),
            repetition_penalty=cfg.get("repetition_penalty"),
            do_sample=cfg.get("do_sample"),
        )


# ---- quantized checkpoints -----------------------------------------------------------------------------------------

FP8_WEIGHT_BLOCK = [128, 128]


def checkpoint_quantization(qcfg: Any) -> str | None:
    """The quantization a config.json's quantization_config describes: None for none, "fp8" for Qwen's FP8 layout
    (e4m3 weights, 128x128 block scales in weight_scale_inv, activations quantized dynamically). Anything else is
    refused with the reason: running it as if it were dense would generate garbage."""
    if qcfg in (None, {}):
        return None
    if not isinstance(qcfg, dict):
        raise ValueError(f"config.json's quantization_config must be an object, not {qcfg!r}")
    method = qcfg.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"this checkpoint is quantized with quant_method={method!r}, which fastqwen cannot run; it runs dense "
            "checkpoints and FP8 ones in Qwen's layout (quant_method 'fp8', e4m3, weight_block_size [128, 128])"
        )
    problems = []
    if qcfg.get("fmt", "e4m3") != "e4m3":
        problems.append(f"fmt={qcfg.get('fmt')!r} (only 'e4m3')")
    if qcfg.get("weight_block_size") != FP8_WEIGHT_BLOCK:
        problems.append(
            f"weight_block_size={qcfg.get('weight_block_size')!r} (only {FP8_WEIGHT_BLOCK}; per-tensor "
            "or per-channel FP8 scales are not supported)"
        )
    if qcfg.get("activation_scheme", "dynamic") != "dynamic":
        problems.append(f"activation_scheme={qcfg.get('activation_scheme')!r} (only 'dynamic')")
    if problems:
        raise ValueError("unsupported FP8 checkpoint: " + "; ".join(problems))
    return "fp8"


def resolve_quantization(requested: str, cfg: ModelConfig) -> bool:
    """Whether the projections run in FP8: 'auto' follows the checkpoint, 'fp8' quantizes a dense one on load, 'none'
    dequantizes an FP8 one on load."""
    if requested == "auto":
        return cfg.quantization == "fp8"
    return requested == "fp8"


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def is_preset(model: str) -> bool:
    return model.split("/")[-1] in _PRESET_SHAPES and not os.path.isdir(model)


def load_model_config(model: str, rope_scaling: dict | None = None) -> tuple[ModelConfig, GenerationDefaults]:
    """Config for a checkpoint folder, a config.json path, or a preset name. rope_scaling (--rope-scaling) replaces
    the checkpoint's own, as vLLM's flag does (a bad one is a ConfigError naming it)."""
    cfg, gen = _load_model_config(model)
    if rope_scaling is not None:
        try:
            rope_theta, yarn = rope_from_dict(rope_scaling, cfg.rope_theta, cfg.max_position_embeddings)
        except ValueError as e:
            raise ConfigError(str(e), "rope_scaling") from e
        cfg = replace(cfg, rope_theta=rope_theta, rope_scaling=yarn)
    return cfg, gen


def context_length(cfg: ModelConfig, max_model_len: int | None) -> int:
    """The engine's context length: --max-model-len, or the model's own. Longer than the model's is refused: past
    the length it was trained for, unscaled RoPE gives positions the model never saw."""
    if max_model_len is None:
        return cfg.context_length
    if max_model_len > cfg.context_length:
        how = (
            f"with YaRN factor {cfg.rope_scaling.factor:g} x original_max_position_embeddings "
            f"{cfg.rope_scaling.original_max_position_embeddings}"
            if cfg.rope_scaling is not None
            else "max_position_embeddings, without RoPE scaling; to go further pass --rope-scaling, e.g. Qwen3's "
            'documented YaRN to 131,072 tokens: \'{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768}\''
        )
        raise ConfigError(
            f"{max_model_len} is longer than the model's context of {cfg.context_length} tokens ({how})",
            "max_model_len",
        )
    return max_model_len


def _load_model_config(model: str) -> tuple[ModelConfig, GenerationDefaults]:
    if is_preset(model):
        cfg = ModelConfig.from_preset(model)
        return cfg, GenerationDefaults(eos_token_ids=list(cfg.eos_token_ids))
    path = model if os.path.isdir(model) else os.path.dirname(model)
    config_file = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if not os.path.isfile(config_file):
        raise InvalidRequestError(
            f"unknown model {model!r}: pass a checkpoint folder, a config.json, or a preset "
            f"({', '.join(PRESETS)}) with the dummy load format",
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
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if cfg.torch_dtype in _DTYPES:
            return getattr(torch, _DTYPES[cfg.torch_dtype])
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto', 'bfloat16', 'float16' or 'float32', not {dtype!r}")
    return getattr(torch, _DTYPES[dtype])


# KV cache dtypes: auto = the model's dtype; fp8_e4m3 (and its alias fp8, vLLM's spelling) = torch.float8_e4m3fn.
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8")


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("fp8_e4m3", "fp8"):
        import torch

        return torch.float8_e4m3fn
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {kv_cache_dtype!r}")


# ---- KV-cache events (engine/kv_events.py publishes them) ----------------------------------------------------------

KV_EVENT_PUBLISHERS = ("zmq", "null")
_ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KVEventsConfig:
    """--kv-events-config, in vLLM's spelling and with vLLM's defaults, so a deployment written for vLLM's flag works
    unchanged. Published only when enable_kv_cache_events is true and the publisher is "zmq" (the default once
    enabled); "null" publishes nothing and, here, records nothing either."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: "zmq" when enabled
    endpoint: str = (
        "tcp://*:5557"  # the PUB socket: bound when it has a wildcard ("*", "::") or is ipc/inproc, else connected
    )
    replay_endpoint: str | None = None  # the ROUTER socket that replays buffered batches (always bound)
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread before a step waits for it
    topic: str = ""  # the first frame of every message: what subscribers filter on, e.g. "kv@<pod>@<model>"

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def parse(cls, value: str | dict) -> KVEventsConfig:
        """From the flag's JSON text or a dict; a ConfigError naming what is wrong otherwise."""

        def bad(message: str) -> ConfigError:
            return ConfigError(message, "kv_events_config")

        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise bad(f"kv_events_config is not valid JSON ({e}): {value!r}") from None
        if not isinstance(value, dict):
            raise bad(f"kv_events_config must be a JSON object, not {value!r}")
        unknown = sorted(set(value) - set(KV_EVENTS_KEYS))
        if unknown:
            raise bad(f"kv_events_config has unknown keys {unknown}; the keys are {', '.join(KV_EVENTS_KEYS)}")

        def need(ok: bool, key: str, what: str) -> None:
            if not ok:
                raise bad(f"kv_events_config's {key} must be {what}, not {value[key]!r}")

        if "enable_kv_cache_events" in value:
            need(isinstance(value["enable_kv_cache_events"], bool), "enable_kv_cache_events", "true or false")
        if value.get("publisher") is not None:
            need(value["publisher"] in KV_EVENT_PUBLISHERS, "publisher", '"zmq" or "null"')
        for key in ("endpoint", "replay_endpoint"):
            if key in value and not (key == "replay_endpoint" and value[key] is None):  # no replay socket: null
                need(
                    isinstance(value[key], str) and value[key].startswith(_ENDPOINT_SCHEMES),
                    key,
                    "a ZeroMQ address (tcp://host:port, tcp://*:port, ipc://path or inproc://name)",
                )
        for key in ("buffer_steps", "max_queue_size"):
            if key in value:
                need(_positive_int(value[key]), key, "a positive integer")
        if "hwm" in value:
            need(
                isinstance(value["hwm"], int) and not isinstance(value["hwm"], bool) and value["hwm"] >= 0,
                "hwm",
                "an integer >= 0 (0: no limit)",
            )
        if "topic" in value:
            need(isinstance(value["topic"], str), "topic", "a string")
        config = cls(**value)
        if config.publisher is None:
            config = replace(config, publisher="zmq" if config.enable_kv_cache_events else "null")
        return config


KV_EVENTS_KEYS = tuple(f.name for f in fields(KVEventsConfig))


# ---- engine knobs ------------------------------------------------------------------------------------------------


def _knob(default, help: str, flag: str | None = None, choices: tuple | None = None, aliases: tuple[str, ...] = ()):
    """An EngineConfig field with what its command-line flag needs: help text, the flag's name where it is not
    the field's name, and the allowed values. A bool field that defaults to True gets a --disable-... flag."""
    meta = {"help": help, "flag": flag, "choices": choices, "aliases": aliases}
    return field(default=default, metadata=meta)


@dataclass
class EngineConfig:
    """Every engine knob and its default, in one place. `LLM(model, **knobs)`, `python -m fastqwen.serve` and the
    benchmarks all build one of these; the command-line flags are generated from the fields below."""

    model: str = _knob(
        MISSING,
        "checkpoint folder, Hugging Face hub id (e.g. Qwen/Qwen3-8B: the local cache first, downloaded when missing), config.json, or a preset ("
        + ", ".join(PRESETS)
        + ") with --load-format dummy",
    )
    dtype: str | torch.dtype = _knob(
        "auto",
        "weight and KV dtype; auto = the checkpoint's",
        choices=("auto", "bfloat16", "bf16", "float16", "fp16", "half", "float32", "fp32"),
    )
    device: str | None = _knob(None, "cuda or cpu (default: cuda when available)")
    load_format: str = _knob(
        "auto", "dummy = random weights with the model's shapes", choices=("auto", "safetensors", "dummy")
    )
    page_size: int = _knob(16, "tokens per KV page (a power of two, at most 128)")
    max_num_seqs: int | None = _knob(
        None,
        "most requests running at once (default: as many as the KV pool holds at 1,024 tokens each, or the context "
        "length if shorter, in steps of 16 from 256 to 512: engine/batch_limit.py)",
    )
    max_num_batched_tokens: int = _knob(8192, "token budget of one step; longer prompts are prefilled in chunks")
    max_model_len: int | None = _knob(
        None,
        "context length (default: the model's: max_position_embeddings, or with YaRN factor x "
        "original_max_position_embeddings); longer than the model's is refused unless --rope-scaling extends it",
    )
    rope_scaling: str | dict | None = _knob(
        None,
        'RoPE scaling as JSON, in place of the checkpoint\'s rope_scaling: \'{"rope_type":"yarn","factor":4.0,'
        "\"original_max_position_embeddings\":32768}' is YaRN to 4 x 32,768 = 131,072 tokens (Qwen3's documented "
        "long context; static, as in Hugging Face transformers); rope_type default or yarn",
    )
    num_pages: int | None = _knob(None, "KV pages to allocate, overriding --kv-cache-memory-fraction")
    gpu_memory_utilization: float = _knob(
        0.85,
        "on GPU: fraction of the memory left after the weights that the KV cache and activations may use",
        flag="--kv-cache-memory-fraction",
        aliases=("--gpu-memory-utilization",),
    )
    seed: int = _knob(0, "seed of the engine's sampler for unseeded requests (and of dummy weights)")
    enable_prefix_caching: bool = _knob(
        True,
        "turn off the prefix cache (KV reuse across requests sharing a prefix)",
        flag="--disable-radix-cache",
        aliases=("--no-enable-prefix-caching",),
    )
    disable_cuda_graph: bool = _knob(False, "run decode steps eagerly instead of replaying captured CUDA graphs")
    cuda_graph_max_bs: int | None = _knob(
        None,
        "largest decode batch captured in a CUDA graph (default and cap: the batch limit, --max-num-seqs); larger "
        "batches run eagerly",
    )
    disable_overlap_schedule: bool = _knob(
        False,
        "record each decode step before launching the next (by default the next one runs on the GPU while the host records the last)",
    )
    quantization: str = _knob(
        "auto",
        "projection weights: auto = as the checkpoint has them; fp8 = FP8 e4m3 weights with 128x128 block scales (Qwen's FP8 checkpoints as they are, dense ones quantized on load); none = dense (an FP8 checkpoint is dequantized on load)",
        choices=("auto", "fp8", "none"),
    )
    allow_reference_on_gpu: bool = _knob(
        False,
        "run on a GPU even when fastqwen._C was built without the CUDA kernels (every op on its slow PyTorch reference; otherwise startup fails with how to build them); also FASTQWEN_ALLOW_REFERENCE_ON_GPU=1",
    )
    # KV cache precision (issue 20).
    kv_cache_dtype: str = _knob(
        "auto",
        "KV cache dtype: auto = the model's; fp8_e4m3 (alias fp8) = e4m3 with one scale per layer for K and for V (1.0, or the checkpoint's k_scale / v_scale), twice the tokens in the same memory",
        choices=KV_CACHE_DTYPES,
    )
    norms_in_gemv: bool = _knob(
        True,
        "run the RMSNorms of a one-sequence decode step as their own kernels instead of in the projections' GEMVs (by default, where the one-token GEMV runs every projection on one GPU, they ride on the GEMVs and the dense projections after a norm take its weight into their columns at load: model/qwen3_batch1.py)",
        flag="--disable-norms-in-gemv",
    )
    task: str = _knob(
        "auto",
        "what the model serves: generate (completions and chat), embed (/v1/embeddings: Qwen3-Embedding) or score (/v1/rerank and /score: Qwen3-Reranker); auto = from the checkpoint (pooling.py: a bare *Model architecture, no LM head or a name with Embedding: embed; a name with Reranker: score; else generate)",
        choices=("auto", "generate", "embed", "score"),
    )
    # ---- parallelism: tensor (engine/tensor_parallel.py) and data (engine/data_parallel.py) ----
    tensor_parallel_size: int = _knob(
        1,
        "split the model across this many GPUs (GPUs K..K+N-1 from --device cuda:K, else 0..N-1; on the CPU, processes), one process each",
        aliases=("--tp", "-tp"),
    )
    data_parallel_size: int = _knob(
        1,
        "the server only: this many engine replicas behind the HTTP front end(s) (--api-server-count), each an engine-core process on GPUs of its own (replica r on the tensor-parallel group r*TP..r*TP+TP-1; on the CPU, processes sharing the cores); a request goes to the least busy replica unless one holding its prefix in cache is not much busier (engine/replica_router.py)",
        aliases=("--dp", "-dp"),
    )
    api_server_count: int | None = _knob(
        None,
        "the server only: this many HTTP front-end processes on the one --host:--port (each its own socket on the port, SO_REUSEPORT, the kernel spreading connections over them), every one a client of every engine core; for when one process's HTTP, detokenizing and SSE cannot keep up with the engine (docs/architecture.md: Several front ends); default: --data-parallel-size, as vLLM's (1 without data parallelism)",
    )
    disable_custom_all_reduce: bool = _knob(
        False,
        "tensor parallelism: every all-reduce through NCCL (by default messages up to 4 MiB take the custom one-shot kernel over CUDA IPC buffers)",
    )
    # ---- model sources (model_source.py resolves them before anything loads) ----
    revision: str | None = _knob(
        None, "hub revision (branch, tag or commit) of a --model given as a Hugging Face hub id"
    )
    tokenizer: str | None = _knob(None, "tokenizer folder or hub id (default: the model's own)")
    chat_template: str | None = _knob(
        None, "chat template: a jinja file, or the template itself (default: the tokenizer's)"
    )
    # ---- speculative decoding (speculative/) ----
    speculative_config: str | None = _knob(
        None,
        'speculative decoding, as a JSON object: {"method": "ngram", "suffix" or "eagle3" (with "model": the EAGLE-3 head folder), "num_speculative_tokens": k (1-7), ...} (speculative/config.py lists every key; "synthetic_acceptance_length" is for benchmarks only: outputs are not the model\'s)',
    )
    # ---- structured output (grammar/compiler.py) ----
    grammar_cache_mib: int = _knob(
        512,
        "memory the compiled grammars kept for reuse may take, estimated (grammar/compiler.py: estimated_compile_bytes); least recently used ones are dropped",
    )
    # ---- KV-cache events for gateways that route by prefix (engine/kv_events.py) ----
    kv_events_config: str | dict | KVEventsConfig | None = _knob(
        None,
        "publish the prefix cache's stored and removed pages as vLLM's KV-cache events over ZeroMQ, for gateways that "
        "route by cached prefix: a JSON object with the keys "
        + ", ".join(KV_EVENTS_KEYS)
        + """, e.g. '{"enable_kv_cache_events": true, "replay_endpoint": "tcp://*:5558", "topic": "kv@pod-0@Qwen3-8B"}' (docs/kv-events.md)""",
    )

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, what: str) -> None:
            if not ok:
                raise ConfigError(f"{name} must be {what}, not {getattr(self, name)!r}", name)

        need(isinstance(self.model, str) and bool(self.model), "model", "a checkpoint path or a preset name")
        need(
            _is_torch_dtype(self.dtype) or self.dtype == "auto" or self.dtype in _DTYPES,
            "dtype",
            "'auto', 'bfloat16', 'float16' or 'float32'",
        )
        need(self.load_format in ("auto", "safetensors", "dummy"), "load_format", "'auto', 'safetensors' or 'dummy'")
        need(
            _positive_int(self.page_size) and self.page_size & (self.page_size - 1) == 0 and self.page_size <= 128,
            "page_size",
            "a power of two from 1 to 128",
        )
        need(
            self.max_num_seqs is None or _positive_int(self.max_num_seqs),
            "max_num_seqs",
            "a positive integer (or None: from the KV pool's size)",
        )
        need(_positive_int(self.max_num_batched_tokens), "max_num_batched_tokens", "a positive integer")
        need(
            self.max_model_len is None or (_positive_int(self.max_model_len) and self.max_model_len >= 2),
            "max_model_len",
            "an integer >= 2",
        )
        if isinstance(self.rope_scaling, str):  # the command line gives JSON text
            try:
                self.rope_scaling = json.loads(self.rope_scaling)
            except json.JSONDecodeError as e:
                raise ConfigError(f"rope_scaling is not valid JSON ({e}): {self.rope_scaling!r}", "rope_scaling") from e
        need(self.rope_scaling is None or isinstance(self.rope_scaling, dict), "rope_scaling", "a JSON object")
        need(self.num_pages is None or _positive_int(self.num_pages), "num_pages", "a positive integer")
        need(
            isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization <= 1,
            "gpu_memory_utilization",
            "in (0, 1]",
        )
        need(
            self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", "one of " + ", ".join(map(repr, KV_CACHE_DTYPES))
        )
        need(self.quantization in ("auto", "fp8", "none"), "quantization", "'auto', 'fp8' or 'none'")
        need(
            self.cuda_graph_max_bs is None
            or (
                isinstance(self.cuda_graph_max_bs, int)
                and not isinstance(self.cuda_graph_max_bs, bool)
                and self.cuda_graph_max_bs >= 0
            ),
            "cuda_graph_max_bs",
            "an integer >= 0 (0 = no graphs; None = the batch limit)",
        )
        need(_positive_int(self.tensor_parallel_size), "tensor_parallel_size", "a positive integer")
        need(_positive_int(self.data_parallel_size), "data_parallel_size", "a positive integer")
        if self.api_server_count is None:  # one front end per replica by default, as vLLM's serve does
            self.api_server_count = self.data_parallel_size  # (checked above)
        need(_positive_int(self.api_server_count), "api_server_count", "a positive integer")
        need(_positive_int(self.grammar_cache_mib), "grammar_cache_mib", "a positive integer (MiB)")
        if self.speculative_config is not None:
            from .speculative.config import SpeculativeConfig, SpeculativeConfigError

            try:
                spec = SpeculativeConfig.parse(self.speculative_config)
            except SpeculativeConfigError as error:
                raise ConfigError(str(error), "speculative_config") from None
            if spec.method == "eagle3" and self.tensor_parallel_size != 1:
                raise ConfigError(
                    "speculative_config: method 'eagle3' runs on one rank (tensor_parallel_size 1)",
                    "speculative_config",
                )
        if self.kv_events_config is not None and not isinstance(self.kv_events_config, KVEventsConfig):
            self.kv_events_config = KVEventsConfig.parse(self.kv_events_config)
        if self.kv_events_config is not None and self.kv_events_config.publishes and not self.enable_prefix_caching:
            raise ConfigError(
                "kv_events_config publishes the prefix cache's pages, and the prefix cache is off "
                "(--disable-radix-cache): turn one on or the other off",
                "kv_events_config",
            )
        for name in ("revision", "tokenizer", "chat_template"):
            need(
                getattr(self, name) is None or (isinstance(getattr(self, name), str) and getattr(self, name) != ""),
                name,
                "a non-empty string",
            )
        if (
            is_preset(self.model) and "/" not in self.model and self.load_format != "dummy"
        ):  # "Qwen/Qwen3-8B" is a hub id
            raise ConfigError(
                f"{self.model!r} is a shape preset with no weights on disk: pass a checkpoint folder or a "
                f"hub id (Qwen/{self.model}), or use the dummy load format",
                "load_format",
            )

    @classmethod
    def build(cls, model: str | EngineConfig, **knobs) -> EngineConfig:
        """A config from a model path and knobs, or a copy of a config with some knobs changed."""
        if isinstance(model, EngineConfig):
            return replace(model, **knobs)
        return cls(model=model, **knobs)

    # ---- the command line, generated from the fields ---------------------------------------------------------

    @staticmethod
    def flag(name: str) -> str:
        """The command-line spelling of a field, for error messages."""
        meta = EngineConfig.__dataclass_fields__[name].metadata
        return meta.get("flag") or "--" + name.replace("_", "-")

    @classmethod
    def add_cli_arguments(cls, parser: argparse.ArgumentParser, **defaults: Any) -> None:
        """One flag per field (defaults overridable, e.g. model="Qwen3-8B" for a benchmark)."""
        group = parser.add_argument_group("engine")
        for f in fields(cls):
            meta = f.metadata
            default = defaults.get(f.name, f.default)
            names = [cls.flag(f.name), *meta.get("aliases", ())]
            if str(f.type) == "bool":
                # A knob that is on by default is turned off by its flag, and the other way round. Unless a caller
                # overrides it, its default is left out of the namespace (help would print a confusing one).
                action = "store_false" if f.default else "store_true"
                default = defaults.get(f.name, argparse.SUPPRESS)
                group.add_argument(*names, dest=f.name, action=action, default=default, help=meta["help"])
                continue
            kind = int if str(f.type).startswith("int") else float if str(f.type).startswith("float") else str
            group.add_argument(
                *names,
                dest=f.name,
                type=kind,
                default=None if default is MISSING else default,
                metavar=names[0].lstrip("-").replace("-", "_").upper(),
                required=default is MISSING,
                choices=meta.get("choices"),
                help=meta["help"],
            )

    @classmethod
    def knob_docs(cls, indent: int = 0) -> str:
        """Every knob but `model`, one entry each from its field's help: the keyword list of LLM.__init__'s docstring,
        generated so that it cannot miss a knob. A bool knob is shown with the value that changes it."""
        lines = []
        for f in fields(cls):
            if f.name == "model":
                continue
            if str(f.type) == "bool":
                head = f"{f.name}={not f.default}: "
            else:
                head = f"{f.name} (default {f.default!r}): "
            lines += textwrap.wrap(
                head + f.metadata["help"],
                120 - indent,
                subsequent_indent="    ",
                break_long_words=False,
                break_on_hyphens=False,
            )
        return textwrap.indent("\n".join(lines), " " * indent)

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> EngineConfig:
        return cls(**{f.name: getattr(args, f.name, f.default) for f in fields(cls)})


class ConfigError(ValueError):
    """A bad engine knob; `field` names it (the CLI reports it by its flag)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
