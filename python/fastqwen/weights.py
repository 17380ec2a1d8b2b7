"""Weights: safetensors checkpoints (single or sharded), tied embeddings, fused q/k/v and gate/up, dummy weights,
FP8 weights.

q/k/v are concatenated into one [q + 2 kv, hidden] matrix and gate/up into one [2 * intermediate, hidden] matrix
at load, so each layer does two input projections instead of five. Each projection is an ops.LinearWeight.

FP8 (fp8=True): the projections are float8_e4m3fn with one float32 scale per 128x128 block. A checkpoint in Qwen's
FP8 layout (`<name>.weight` e4m3 and `<name>.weight_scale_inv` [ceil(out/128), ceil(in/128)]) loads as it is;
dense projections are quantized on load (amax / 448 per block). Embeddings, norms and the LM head stay dense, as in
Qwen's own FP8 checkpoints. With fp8=False an FP8 checkpoint is dequantized on load to the model dtype.

Norm folding (fold_norms, for the batch-1 decode step whose GEMVs carry the RMSNorms: model/qwen3_batch1.py): each
dense projection right after an RMSNorm takes the norm's weight into its columns, so that its GEMV reads x alone.

With tensor parallelism each rank loads only its shard (sharding.py says which rows and columns): straight from the
safetensors file, slice by slice (safe_open's get_slice), so no rank ever holds a whole weight matrix. An FP8
projection's shard takes the rows or columns of weight_scale_inv's 128x128 blocks that go with its own (a shard
that would split a block is refused, naming the projection); a dense one quantized on load is quantized shard by
shard.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field, replace

import torch
from safetensors import SafetensorError, safe_open

from .config import ConfigError, ModelConfig
from .ops.linear import FP8_BLOCK, LinearWeight, quantize_fp8
from .sharding import Shard

log = logging.getLogger(__name__)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: LinearWeight  # [q_size + 2 * kv_size, hidden], with its bias when attention_bias
    q_norm: torch.Tensor  # [head_dim]
    k_norm: torch.Tensor  # [head_dim]
    o_proj: LinearWeight  # [hidden, q_size]
    post_norm: torch.Tensor  # [hidden]
    gate_up: LinearWeight  # [2 * intermediate, hidden]
    down: LinearWeight  # [hidden, intermediate]


@dataclass(frozen=True)
class NormFolding:
    """Which projections carry the RMSNorm weight before them in their columns (fold_norms), the norm's own weight
    then being ones: qkv (input_norm), gate_up (post_norm), the same in every layer, and the LM head (final_norm)."""

    qkv: bool = False
    gate_up: bool = False
    lm_head: bool = False


@dataclass
class Qwen3Weights:
    embed: torch.Tensor  # [vocab, hidden]; a rank's [vocab_rows, hidden] slice under tensor parallelism
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    # [vocab, hidden] (sliced like embed), dense; its weight is the embed tensor itself when tied. None for a checkpoint
    # saved without one (transformers' Qwen3Model, as Qwen3-Embedding's): it can embed (pooling.py), never generate.
    lm_head: LinearWeight | None
    norms_folded: NormFolding = field(default_factory=NormFolding)

    def projections(self) -> list[LinearWeight]:
        """Every projection: each layer's qkv, o_proj, gate_up and down, then the LM head."""
        layers = [p for layer in self.layers for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
        return layers + ([self.lm_head] if self.lm_head is not None else [])

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
        if self.lm_head is not None:
            yield from self.lm_head.tensors()
        for layer in self.layers:
            for t in vars(layer).values():
                if isinstance(t, LinearWeight):
                    yield from t.tensors()
                elif t is not None:
                    yield t


class CorruptWeightsError(ConfigError):
    """A weights file that safetensors cannot read (truncated, not safetensors, a Git LFS pointer); names the file."""

    def __init__(self, path: str, cause: Exception):
        super().__init__(f"{path} is not a readable safetensors file ({cause}); download it again", "model")


def _open(path: str):
    """safe_open, with an error that names the file instead of the safetensors library's bare message."""
    try:
        return safe_open(path, framework="pt")
    except (SafetensorError, OSError) as e:
        raise CorruptWeightsError(path, e) from None


def check_weight_files(folder: str) -> None:
    """Read each safetensors file's header (a few kilobytes, no tensor), so that a corrupt file is reported before
    the engine starts to load. Raises CorruptWeightsError naming the first bad file."""
    source = _TensorSource(folder)
    for path in sorted(set(source._file_of.values())):
        source._handle_of(path)


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
            with _open(single) as f:
                self._file_of = {name: single for name in f.keys()}
        else:
            raise FileNotFoundError(
                f"no model.safetensors or model.safetensors.index.json in {folder!r} "
                "(the dummy load format gives random weights)"
            )
        # The name each tensor is asked for -> the name it is stored under. A checkpoint saved from transformers'
        # bare Qwen3Model (Qwen3-Embedding's) names its tensors without the "model." prefix of Qwen3ForCausalLM.
        self._stored = {name: name for name in self._file_of}
        if not any(name.startswith("model.") for name in self._file_of):
            self._stored = {"model." + name: name for name in self._file_of}
            self._file_of = {"model." + name: path for name, path in self._file_of.items()}
        self._handles: dict[str, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def _handle(self, name: str):
        if name not in self._file_of:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        return self._handle_of(self._file_of[name])

    def _handle_of(self, path: str):
        if path not in self._handles:
            self._handles[path] = _open(path)
        return self._handles[path]

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(self._stored[name])

    def get_part(self, name: str, shape: tuple[int, ...], dim: int, span: tuple[int, int]) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) [first, end) of a tensor whose whole shape must be `shape`; only that
        part is read from the file."""
        part = self._handle(name).get_slice(self._stored[name])
        _checked_shape(tuple(part.get_shape()), shape, name)
        first, end = span
        return part[first:end] if dim == 0 else part[:, first:end]


def _checked_shape(have: tuple[int, ...], shape: tuple[int, ...], name: str) -> None:
    if have != shape:
        raise ValueError(f"tensor {name!r} has shape {have}, expected {shape} from config.json")


def _checked(t: torch.Tensor, shape: tuple[int, ...], name: str) -> torch.Tensor:
    _checked_shape(tuple(t.shape), shape, name)
    return t


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """A vocabulary slice padded with zero rows to the slice height every rank has."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])


def _blocks(n: int) -> int:
    return -(-n // FP8_BLOCK)


def _fused(
    parts: list[LinearWeight | torch.Tensor], bias: torch.Tensor | None, dtype: torch.dtype, fp8: bool, name: str
) -> LinearWeight:
    """Row-concatenates a projection's parts (each an FP8 LinearWeight or a dense tensor) into one LinearWeight:
    FP8 parts are kept as they are when every part is FP8 and all but the last fill whole 128-row blocks (their
    block scales then concatenate too); otherwise the parts are dequantized, and quantized again when fp8."""
    all_fp8 = all(isinstance(p, LinearWeight) for p in parts)
    if not fp8 and not any(isinstance(p, LinearWeight) for p in parts):
        return LinearWeight(torch.cat([p.to(dtype) for p in parts]), None, bias)  # no float32 copy of the whole
    if fp8 and all_fp8 and all(p.out_features % FP8_BLOCK == 0 for p in parts[:-1]):
        weight = torch.cat([p.weight for p in parts])
        return LinearWeight(weight, torch.cat([p.scale for p in parts]), bias)
    if fp8 and any(isinstance(p, LinearWeight) for p in parts):
        log.warning(
            "%s: FP8 parts that do not fill whole 128-row blocks (or mixed with dense ones) are "
            "dequantized and quantized again as one matrix",
            name,
        )
    dense = torch.cat([p.dequantize(torch.float32) if isinstance(p, LinearWeight) else p.float() for p in parts])
    if fp8:
        return LinearWeight(*quantize_fp8(dense), bias)
    return LinearWeight(dense.to(dtype), None, bias)


def _scale_blocks(name: str, shape: tuple[int, int], dim: int, span: tuple[int, int], shard: Shard) -> tuple[int, int]:
    """The block rows (dim 0) or block columns (dim 1) of an FP8 weight's weight_scale_inv that go with the rows or
    columns [first, end) a rank takes: [first / 128, ceil(end / 128)). A span that does not start and end on a block
    boundary (the matrix's end excepted) would share a scale block with another rank's span: refused, naming the
    projection and the sizes (Qwen3's head_dim of 128 keeps every head, replicated KV heads included, on whole
    blocks; an intermediate size split into parts that are not multiples of 128 is what can hit this)."""
    first, end = span
    if first % FP8_BLOCK == 0 and (end % FP8_BLOCK == 0 or end == shape[dim]):
        return first // FP8_BLOCK, _blocks(end)
    what = "rows" if dim == 0 else "columns"
    raise ValueError(
        f"{name} {list(shape)} is FP8 with {FP8_BLOCK}x{FP8_BLOCK} block scales, and tensor parallel rank "
        f"{shard.rank} of {shard.size} would take its {what} [{first}, {end}), which do not fall on {FP8_BLOCK}-"
        f"{what[:-1]} block boundaries: choose a tensor parallel size that splits it into whole blocks"
    )


def load_weights(
    folder: str, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, fp8: bool = False, shard: Shard = Shard()
) -> Qwen3Weights:
    """Loads a checkpoint (dense, or Qwen's FP8 layout); fp8 chooses FP8 projections (see the module docstring).
    With a shard of several ranks: this rank's part only (rows of the column-parallel projections, columns of the
    row-parallel ones, an FP8 weight's scale blocks with them), read slice by slice, never whole."""
    src = _TensorSource(folder)
    h, q, kv, i, d = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.head_dim
    if not shard.whole:
        shard.check(cfg)
    heads, kv_heads, inter = shard.heads(cfg), shard.kv_heads(cfg), shard.intermediate(cfg)
    q_span, kv_span = (heads[0] * d, heads[1] * d), (kv_heads[0] * d, kv_heads[1] * d)
    rows, cols = 0, 1  # the dimension a span selects: column-parallel projections split rows, row-parallel columns

    def read(name: str, shape: tuple[int, ...], dim: int | None = None, span: tuple[int, int] | None = None):
        """The stored tensor (its rows or columns in span, read alone, under tensor parallelism) on the device."""
        if shard.whole or dim is None:
            return _checked(src.get(name), shape, name).to(device)
        return src.get_part(name, shape, dim, span).to(device)

    def get_part(
        prefix: str, shape: tuple[int, ...], dim: int | None = None, span: tuple[int, int] | None = None
    ) -> LinearWeight | torch.Tensor:
        """`prefix.weight` (this rank's span of it): an FP8 LinearWeight with the scale blocks that go with the span
        when the checkpoint has its weight_scale_inv, else the raw tensor on the device (an e4m3 tensor without scales
        is refused: its values mean nothing alone)."""
        name, scale_name = prefix + ".weight", prefix + ".weight_scale_inv"
        t = read(name, shape, dim, span)
        if scale_name not in src:
            if t.dtype.is_floating_point and t.element_size() == 1:
                raise ValueError(
                    f"tensor {name!r} is {t.dtype} but the checkpoint has no {scale_name!r}: FP8 "
                    "weights need their block scales (Qwen's FP8 layout)"
                )
            return t
        if t.dtype != torch.float8_e4m3fn:
            raise ValueError(f"tensor {name!r} has block scales but dtype {t.dtype}; only float8_e4m3fn is supported")
        blocks = (_blocks(shape[0]), _blocks(shape[1]))
        whole = shard.whole or dim is None
        scale = read(scale_name, blocks, dim, None if whole else _scale_blocks(prefix, shape, dim, span, shard))
        return LinearWeight(t, scale.to(torch.float32))

    def get(name: str, shape: tuple[int, ...], dim: int | None = None, span: tuple[int, int] | None = None):
        """A dense tensor of `dtype` (an FP8 one with block scales is dequantized)."""
        if not name.endswith(".weight"):
            return read(name, shape, dim, span).to(dtype)
        part = get_part(name.removesuffix(".weight"), shape, dim, span)
        return part.dequantize(dtype) if isinstance(part, LinearWeight) else part.to(dtype)

    def projection(parts: list[tuple[str, tuple[int, int], tuple[int, int]]], dim: int, bias=None) -> LinearWeight:
        """One projection from its (prefix, whole shape, this rank's span) parts, row-concatenated."""
        loaded = [get_part(prefix, shape, dim, span) for prefix, shape, span in parts]
        return _fused(loaded, bias, dtype, fp8, parts[0][0])

    layers = []
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        attn = p + "self_attn."
        qkv_bias = None
        if cfg.attention_bias:
            qkv_bias = torch.cat(
                [
                    get(attn + "q_proj.bias", (q,), rows, q_span),
                    get(attn + "k_proj.bias", (kv,), rows, kv_span),
                    get(attn + "v_proj.bias", (kv,), rows, kv_span),
                ]
            )
        qkv = [
            (attn + "q_proj", (q, h), q_span),
            (attn + "k_proj", (kv, h), kv_span),
            (attn + "v_proj", (kv, h), kv_span),
        ]
        gate_up = [(p + "mlp.gate_proj", (i, h), inter), (p + "mlp.up_proj", (i, h), inter)]
        layers.append(
            LayerWeights(
                input_norm=get(p + "input_layernorm.weight", (h,)),
                qkv=projection(qkv, rows, qkv_bias),
                q_norm=get(attn + "q_norm.weight", (d,)),
                k_norm=get(attn + "k_norm.weight", (d,)),
                o_proj=projection([(attn + "o_proj", (h, q), q_span)], cols),
                post_norm=get(p + "post_attention_layernorm.weight", (h,)),
                gate_up=projection(gate_up, rows),
                down=projection([(p + "mlp.down_proj", (h, i), inter)], cols),
            )
        )
    vocab_rows, vocab_span = shard.vocab_rows(cfg.vocab_size), shard.vocab(cfg.vocab_size)

    def vocab_table(name: str) -> torch.Tensor:
        """The embedding or the LM head: this rank's vocabulary rows, padded to the height every rank has."""
        return _pad_rows(get(name, (cfg.vocab_size, h), rows, vocab_span), vocab_rows)

    embed = vocab_table("model.embed_tokens.weight")
    if cfg.tie_word_embeddings:
        lm_head = LinearWeight(embed)
    elif "lm_head.weight" in src:
        lm_head = LinearWeight(vocab_table("lm_head.weight"))
    else:
        lm_head = None  # an embedding checkpoint (pooling.detect_task)
    return Qwen3Weights(embed=embed, layers=layers, final_norm=get("model.norm.weight", (h,)), lm_head=lm_head)


def _shard_layer(layer: LayerWeights, cfg: ModelConfig, shard: Shard) -> LayerWeights:
    d, q, kv, i = cfg.head_dim, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    (h0, h1), (k0, k1), (i0, i1) = shard.heads(cfg), shard.kv_heads(cfg), shard.intermediate(cfg)

    def qkv_part(t: torch.Tensor) -> torch.Tensor:
        wq, wk, wv = t.split([q, kv, kv])
        return torch.cat([wq[h0 * d : h1 * d], wk[k0 * d : k1 * d], wv[k0 * d : k1 * d]])

    return LayerWeights(
        input_norm=layer.input_norm,
        qkv=LinearWeight(
            qkv_part(layer.qkv.weight), None, None if layer.qkv.bias is None else qkv_part(layer.qkv.bias)
        ),
        q_norm=layer.q_norm,
        k_norm=layer.k_norm,
        o_proj=LinearWeight(layer.o_proj.weight[:, h0 * d : h1 * d].contiguous()),
        post_norm=layer.post_norm,
        gate_up=LinearWeight(torch.cat([layer.gate_up.weight[i0:i1], layer.gate_up.weight[i + i0 : i + i1]])),
        down=LinearWeight(layer.down.weight[:, i0:i1].contiguous()),
    )


def _quantized(layer: LayerWeights) -> LayerWeights:
    """The layer with its projections quantized to FP8 (quantize_fp8: 128x128 block scales)."""
    return replace(
        layer,
        qkv=layer.qkv.to_fp8(),
        o_proj=layer.o_proj.to_fp8(),
        gate_up=layer.gate_up.to_fp8(),
        down=layer.down.to_fp8(),
    )


def shard_weights(full: Qwen3Weights, cfg: ModelConfig, shard: Shard) -> Qwen3Weights:
    """This rank's shard of whole weights already in memory (for dummy weights: a checkpoint is sliced on read)."""
    if shard.whole:
        return full
    shard.check(cfg)
    layers = [_shard_layer(layer, cfg, shard) for layer in full.layers]
    vocab_rows, vocab_span = shard.vocab_rows(cfg.vocab_size), shard.vocab(cfg.vocab_size)
    first, end = vocab_span
    embed = _pad_rows(full.embed[first:end].clone(), vocab_rows)
    tied = full.lm_head.weight is full.embed
    lm_head = LinearWeight(embed if tied else _pad_rows(full.lm_head.weight[first:end].clone(), vocab_rows))
    return Qwen3Weights(embed=embed, layers=layers, final_norm=full.final_norm, lm_head=lm_head)


def dummy_weights(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0, fp8: bool = False, shard: Shard = Shard()
) -> Qwen3Weights:
    """Random weights with the real shapes, made on the device (no checkpoint needed, for benchmarks); with fp8 the
    projections are quantized as they are made. Under tensor parallelism each rank draws every layer whole (the same
    numbers at any TP size) and keeps its shard: one layer at a time, so no rank holds more than one whole layer
    beyond its shard; with fp8 each rank quantizes its shard (the same values as the whole model's where the shard
    boundaries fall on 128 blocks)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    h, q, kv, i, d = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.head_dim

    def rand(*shape: int, std: float = 0.02) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=device)
        return t.normal_(0.0, std, generator=gen)

    def norm(n: int) -> torch.Tensor:
        # Near one, like trained norms, but not exactly one so that a wrong weight shows up.
        return 1.0 + rand(n, std=0.05)

    def proj(rows: int, cols: int, bias: torch.Tensor | None = None) -> LinearWeight:
        return LinearWeight(rand(rows, cols), None, bias)

    def one_layer() -> LayerWeights:
        layer = LayerWeights(
            input_norm=norm(h),
            qkv=proj(q + 2 * kv, h, rand(q + 2 * kv) if cfg.attention_bias else None),
            q_norm=norm(d),
            k_norm=norm(d),
            o_proj=proj(h, q),
            post_norm=norm(h),
            gate_up=proj(2 * i, h),
            down=proj(h, i),
        )
        layer = layer if shard.whole else _shard_layer(layer, cfg, shard)
        return _quantized(layer) if fp8 else layer

    layers = [one_layer() for _ in range(cfg.num_layers)]
    embed = rand(cfg.vocab_size, h)
    lm_head = LinearWeight(embed if cfg.tie_word_embeddings else rand(cfg.vocab_size, h))
    full = Qwen3Weights(embed=embed, layers=[], final_norm=norm(h), lm_head=lm_head)
    sharded = shard_weights(full, cfg, shard)
    sharded.layers = layers
    return sharded


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


# ---- norm folding --------------------------------------------------------------------------------------------------


def fold_norm(norm_weight: torch.Tensor, w: LinearWeight) -> bool:
    """Multiplies an RMSNorm's weight into the columns of the dense projection that follows it (W[:, c] *= g[c],
    rounded to W's dtype) and sets the norm's weight to ones, in place: RMSNorm(x) @ W^T keeps its value (up to that
    rounding) on every path, and the one-token GEMV's norm (`linear(..., norm=(None, eps))`) no longer reads the
    weight. False, and nothing changed, for an FP8 weight (its 128x128 block scales cannot take a per-column factor)."""
    if w.is_fp8 or w.in_features != norm_weight.numel():
        return False
    w.weight.mul_(norm_weight.to(w.weight.dtype).view(1, -1))
    norm_weight.fill_(1)
    return True


def fold_norms(weights: Qwen3Weights) -> NormFolding:
    """fold_norm for every RMSNorm and the dense projection after it (not the LM head when it is the embedding:
    tied), once, in place; records and returns which were folded. Measured on the H100 (8B bf16 batch-1 step:
    git show 1274b3f:bench/results/2026-11-24-h100-norm-in-gemv), the GEMV that reads x alone was faster than the one that also loads
    the norm's weight."""
    if weights.norms_folded != NormFolding():
        raise ValueError("fold_norms: these weights are folded already")
    if len({(layer.qkv.is_fp8, layer.gate_up.is_fp8) for layer in weights.layers}) > 1:
        raise ValueError("fold_norms: layers with dense and FP8 projections mixed")
    layers = [
        (fold_norm(layer.input_norm, layer.qkv), fold_norm(layer.post_norm, layer.gate_up)) for layer in weights.layers
    ]
    tied = weights.lm_head.weight is weights.embed
    qkv, gate_up = layers[0] if layers else (False, False)
    weights.norms_folded = NormFolding(qkv, gate_up, not tied and fold_norm(weights.final_norm, weights.lm_head))
    return weights.norms_folded
