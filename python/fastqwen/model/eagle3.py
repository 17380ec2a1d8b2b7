"""An EAGLE-3 draft head: one Llama decoder layer over [normed token embedding, normed feature], in the layout the
published Qwen3 EAGLE-3 heads use (SpecForge, AngelSlim), loaded from its own folder and written in fastqwen's ops.

The head at position p reads the token at p + 1 and a feature of position p, and predicts the token at p + 2:
- for a position the target computed, the feature is `fc` of the target's hidden states entering its aux layers
  (Qwen3Model.forward's aux_out, concatenated in the order of the head's layer ids);
- for a drafted position, it is the head's own output at p - 1 before its final norm (already `hidden` wide, so
  `fc` is skipped): the residual stream after the layer's MLP, as SGLang and vLLM feed it back.

Positions are the sequence's own (RoPE at p, the head's rope_theta). The head's KV is its own: a one-layer paged
pool whose pages the drafter (engine/eagle3_drafter.py) hands out per request. The forward runs a batch of requests
through the ops the target's layers use (ops.linear, qk_norm_rope_store_kv without the q/k norms, paged attention for
prefill and decode), so the same code runs on the CPU references and the CUDA kernels.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

import torch

from .. import ops
from ..config import ModelConfig
from ..kvcache import KVPool
from ..speculative.config import SpeculativeConfigError
from .forward_batch import ForwardBatch

HEAD_PREFIX = "midlayer."


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # the target's
    draft_vocab_size: int
    # The target's residual stream entering these layers (0 = the embeddings, L = after the last layer).
    capture_layers: tuple[int, ...]

    @classmethod
    def read(cls, folder: str, target: ModelConfig) -> Eagle3Config:
        with open(os.path.join(folder, "config.json")) as f:
            raw = json.load(f)

        def bad(message: str):
            return SpeculativeConfigError(f"speculative_config.model {folder!r}: {message}", "model")

        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            config = cls(
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads", heads)),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(raw.get("rope_theta", 10000.0)),
                vocab_size=int(raw.get("vocab_size", target.vocab_size)),
                draft_vocab_size=int(raw.get("draft_vocab_size") or raw.get("vocab_size", target.vocab_size)),
                capture_layers=capture_layers(raw, target.num_layers),
            )
        except KeyError as missing:
            raise bad(f"config.json lacks {missing}") from None
        except (TypeError, ValueError) as error:
            raise bad(f"config.json: {error}") from None
        if config.vocab_size != target.vocab_size:
            raise bad(f"vocab_size {config.vocab_size} differs from the target's {target.vocab_size}")
        target_hidden = raw.get("target_hidden_size") or target.hidden_size
        if target_hidden != target.hidden_size:
            raise bad(f"target_hidden_size {target_hidden} differs from the target's hidden size {target.hidden_size}")
        if any(not 0 <= i <= target.num_layers for i in config.capture_layers):
            raise bad(f"aux hidden-state layers {config.capture_layers} outside the target's {target.num_layers}")
        rope_scaling = raw.get("rope_scaling")
        if rope_scaling and (rope_scaling.get("rope_type") or rope_scaling.get("type")) not in (None, "default"):
            raise bad(f"rope_scaling {rope_scaling!r} is not supported (plain RoPE only)")
        return config


def capture_layers(raw: dict, num_layers: int) -> tuple[int, ...]:
    """Where the target's residual stream is captured, as the layer index it enters. eagle_aux_hidden_state_layer_ids
    name layer outputs (SpecForge trains on them; SGLang captures before layer id + 1); without them, the
    default SGLang and vLLM share: before layers 2, L // 2 and L - 3."""
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = raw.get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return tuple(int(i) + 1 for i in ids)
    return (2, num_layers // 2, num_layers - 3)


@dataclass
class Eagle3Weights:
    fc: ops.LinearWeight  # [hidden, n_aux * target_hidden]
    input_norm: torch.Tensor  # the token embedding's norm
    hidden_norm: torch.Tensor  # the feature's norm
    qkv: ops.LinearWeight  # q, k and v stacked: [(heads + 2 * kv_heads) * D, 2 * hidden]
    o_proj: ops.LinearWeight
    post_norm: torch.Tensor
    gate_up: ops.LinearWeight  # gate and up stacked, for linear_silu_and_mul
    down: ops.LinearWeight
    final_norm: torch.Tensor
    lm_head: ops.LinearWeight  # [draft_vocab, hidden]
    embed: torch.Tensor  # [vocab, hidden]: the head's own, or the target's
    d2t: torch.Tensor  # [draft_vocab] int64: target id = draft id + d2t[draft id]


def load_eagle3(
    folder: str,
    target: ModelConfig,
    target_embed: torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
    fp8: bool = False,
) -> tuple[Eagle3Config, Eagle3Weights]:
    """The head's config and weights, every shape checked against its config and the target's; with fp8 its
    projections and LM head quantized to FP8 (speculative_config.quantization)."""
    from safetensors.torch import load_file

    config = Eagle3Config.read(folder, target)
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise SpeculativeConfigError(f"speculative_config.model {folder!r} has no .safetensors file", "model")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(os.path.join(folder, name)))
    # Some exports keep the training wrapper's "model." prefix.
    tensors = {k.removeprefix("model."): v for k, v in tensors.items()}
    h, t = config.hidden_size, target.hidden_size
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim

    def get(name: str, shape: tuple[int, ...], kind: torch.dtype | None = dtype) -> torch.Tensor:
        if name not in tensors:
            raise SpeculativeConfigError(f"speculative_config.model {folder!r}: no tensor {name!r}", "model")
        tensor = tensors[name]
        if tuple(tensor.shape) != shape:
            what = f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}"
            if name == "fc.weight":
                what += f" ({len(config.capture_layers)} aux hidden states of the target's hidden size {t})"
            raise SpeculativeConfigError(f"speculative_config.model {folder!r}: {what}", "model")
        return tensor.to(device=device, dtype=kind or tensor.dtype).contiguous()

    def proj(name: str, rows: int, cols: int) -> ops.LinearWeight:
        return ops.LinearWeight(get(name, (rows, cols)))

    layer = HEAD_PREFIX
    if "embed_tokens.weight" in tensors:
        embed = get("embed_tokens.weight", (target.vocab_size, h))
    elif h == t:
        embed = target_embed
    else:
        raise SpeculativeConfigError(
            f"speculative_config.model {folder!r}: no embed_tokens.weight, and its hidden size {h} differs from the "
            f"target's {t} (whose embedding it would use)",
            "model",
        )
    if "d2t" in tensors:
        d2t = get("d2t", (config.draft_vocab_size,), torch.int64)
    elif config.draft_vocab_size == target.vocab_size:
        d2t = torch.zeros(config.draft_vocab_size, dtype=torch.int64, device=device)
    else:
        raise SpeculativeConfigError(
            f"speculative_config.model {folder!r}: draft_vocab_size {config.draft_vocab_size} needs a d2t tensor",
            "model",
        )
    targets = torch.arange(config.draft_vocab_size, device=device) + d2t
    if int(targets.min()) < 0 or int(targets.max()) >= target.vocab_size:
        raise SpeculativeConfigError(f"speculative_config.model {folder!r}: d2t maps outside the vocabulary", "model")
    gate = get(layer + "mlp.gate_proj.weight", (config.intermediate_size, h))
    up = get(layer + "mlp.up_proj.weight", (config.intermediate_size, h))
    weights = Eagle3Weights(
        fc=proj("fc.weight", h, len(config.capture_layers) * t),
        input_norm=get(layer + "input_layernorm.weight", (h,)),
        hidden_norm=get(layer + "hidden_norm.weight", (h,)),
        qkv=ops.LinearWeight(
            torch.cat(
                [
                    get(layer + f"self_attn.{n}_proj.weight", (rows, 2 * h))
                    for n, rows in (("q", q_size), ("k", kv_size), ("v", kv_size))
                ]
            ).contiguous()
        ),
        o_proj=proj(layer + "self_attn.o_proj.weight", h, q_size),
        post_norm=get(layer + "post_attention_layernorm.weight", (h,)),
        gate_up=ops.LinearWeight(torch.cat([gate, up]).contiguous()),
        down=proj(layer + "mlp.down_proj.weight", h, config.intermediate_size),
        final_norm=get("norm.weight", (h,)),
        lm_head=proj("lm_head.weight", config.draft_vocab_size, h),
        embed=embed,
        d2t=d2t,
    )
    if fp8:
        weights = replace(
            weights,
            **{name: getattr(weights, name).to_fp8() for name in ("fc", "qkv", "o_proj", "gate_up", "down", "lm_head")},
        )
    return config, weights


class Eagle3Head:
    """The head's forward over a batch of requests: rows packed by request as the target's (ForwardBatch), its KV in a
    one-layer paged pool of its own (the drafter, engine/eagle3_drafter.py, owns the pages and says where each row's
    K and V go: out_slots, page_table, kv_lens)."""

    def __init__(self, config: Eagle3Config, weights: Eagle3Weights, max_positions: int, max_batch: int):
        self.config, self.weights = config, weights
        self.device, self.dtype = weights.final_norm.device, weights.final_norm.dtype  # (projections may be FP8)
        # (FP8 projections: their GEMM probed and its scales laid out now, not inside a draft graph's capture)
        linears = (weights.fc, weights.qkv, weights.o_proj, weights.gate_up, weights.down, weights.lm_head)
        ops.prepare_linear(linears, self.dtype, self.device)
        self.cos_sin_cache = ops.rope_cos_sin_cache(config.head_dim, max_positions, config.rope_theta, self.device)
        self.scale = config.head_dim**-0.5
        # Decode steps of up to max_batch requests (the drafts' steps) take the split-KV kernel where it runs.
        self.max_batch = max_batch
        self.decode_workspace = None
        if ops.attention_kernel_applies(self.device.type == "cuda", self.dtype, config.head_dim):
            self.decode_workspace = ops.decode_workspace(max_batch, config.num_heads, self.device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVPool, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """batch.input_ids [T]: the token at p + 1 of each row at position p (batch.positions); features
        [T, n_aux * target_hidden] (the target's) or [T, hidden] (the head's own outputs at p - 1). Writes the rows' K
        and V at batch.out_slots; each request attends to its kv_lens entries, the rows being its last ones. Returns,
        for the rows batch.logits_indices, (the draft's target-vocabulary ids predicting p + 2, the outputs before the
        final norm [S, hidden] that feed the next position)."""
        c, w = self.config, self.weights
        eps, rows = c.rms_norm_eps, batch.num_tokens
        features = features.to(self.dtype)
        if features.shape[1] != c.hidden_size:
            features = ops.linear(features, w.fc)
        embeds = w.embed[batch.input_ids]
        x = torch.cat([ops.rms_norm(embeds, w.input_norm, eps), ops.rms_norm(features, w.hidden_norm, eps)], dim=-1)
        q = torch.empty(rows, c.num_heads, c.head_dim, dtype=self.dtype, device=self.device)
        k_cache, v_cache = kv.k(0), kv.v(0)
        # A Llama layer: RoPE without the per-head norms of Qwen3's (q_weight = k_weight = None).
        ops.qk_norm_rope_store_kv(
            ops.linear(x, w.qkv),
            None,
            None,
            self.cos_sin_cache,
            batch.positions,
            k_cache,
            v_cache,
            batch.out_slots,
            eps,
            q_out=q,
        )
        attn = torch.empty_like(q)
        ops.paged_attention(q, k_cache, v_cache, batch, self.scale, attn, self.decode_workspace)
        residual = features + ops.linear(attn.view(rows, -1), w.o_proj)  # the feature is the layer's residual
        out = residual + ops.linear(
            ops.linear_silu_and_mul(ops.rms_norm(residual, w.post_norm, eps), w.gate_up), w.down
        )
        out = out[batch.logits_indices]
        logits = ops.linear(ops.rms_norm(out, w.final_norm, eps), w.lm_head)
        draft_ids = logits.float().argmax(dim=-1)
        return draft_ids + w.d2t[draft_ids], out
