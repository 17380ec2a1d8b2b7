"""The Qwen3 dense forward pass over a ForwardBatch and the paged KV pool, written only in terms of ops."""

from __future__ import annotations

import torch

from .. import ops
from ..config import ModelConfig
from ..kvcache import KVPool
from ..weights import Qwen3Weights
from .forward_batch import ForwardBatch


# Split-KV decode cuts every sequence into the same number of chunks whatever the batch: a sequence's attention
# then does not depend on what else is in the batch, which keeps seeded sampling reproducible across batch
# compositions (a batch-dependent split plan changed the fp32 summation order, and sometimes a sampled token).
DECODE_SPLITS = 4


class Qwen3Model:
    def __init__(self, cfg: ModelConfig, weights: Qwen3Weights, max_positions: int, max_batch: int = 256):
        self.cfg = cfg
        self.weights = weights
        self.device = weights.embed.device
        self.dtype = weights.embed.dtype
        self.scale = cfg.head_dim**-0.5
        self.cos_sin_cache = ops.rope_cos_sin_cache(cfg.head_dim, max_positions, cfg.rope_theta, self.device)
        # Split-KV decode scratch, allocated once (nothing is allocated inside a step), and the SM count it plans by.
        self.decode_workspace = None
        self.num_sms = 1
        if self.device.type == "cuda":
            self.decode_workspace = ops.decode_workspace(max_batch * cfg.num_heads * DECODE_SPLITS, self.device)
            self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVPool, logits_out: torch.Tensor | None = None) -> torch.Tensor:
        """Returns float32 logits [S, vocab] for batch.logits_indices, in logits_out when given (a CUDA graph's
        persistent output, so that captured graphs do not each keep their own logits)."""
        cfg, w = self.cfg, self.weights
        num_tokens = batch.num_tokens
        eps = cfg.rms_norm_eps
        residual = w.embed[batch.input_ids]  # indexing copies, so the in-place residual adds never touch embed
        hidden = torch.empty_like(residual)
        q = torch.empty(num_tokens, cfg.num_heads, cfg.head_dim, dtype=self.dtype, device=self.device)
        attn = torch.empty_like(q)
        for index, layer in enumerate(w.layers):
            if index == 0:
                ops.rms_norm(residual, layer.input_norm, eps, out=hidden)
            else:
                ops.fused_add_rms_norm(hidden, residual, layer.input_norm, eps)
            qkv = torch.nn.functional.linear(hidden, layer.qkv, layer.qkv_bias)
            k_cache, v_cache = kv.k(index), kv.v(index)
            ops.qk_norm_rope_store_kv(
                qkv, layer.q_norm, layer.k_norm, self.cos_sin_cache, batch.positions,
                k_cache, v_cache, batch.out_slots, eps, q_out=q,
            )  # fmt: skip
            if batch.is_decode:
                ops.paged_attention_decode(
                    q, k_cache, v_cache, batch.page_table, batch.kv_lens, self.scale, attn,
                    batch.decode_splits, self.decode_workspace,
                )  # fmt: skip
            else:
                ops.paged_attention_prefill(
                    q, k_cache, v_cache, batch.query_start, batch.page_table, batch.kv_lens, self.scale, attn
                )
            hidden = torch.nn.functional.linear(attn.view(num_tokens, -1), layer.o_proj)
            ops.fused_add_rms_norm(hidden, residual, layer.post_norm, eps)
            gate_up = torch.nn.functional.linear(hidden, layer.gate_up)
            act = ops.silu_and_mul(gate_up)
            hidden = torch.nn.functional.linear(act, layer.down)
        # Only the rows that sample reach the final norm and the LM head.
        hidden = hidden[batch.logits_indices]
        residual = residual[batch.logits_indices]
        ops.fused_add_rms_norm(hidden, residual, w.final_norm, eps)
        logits = torch.nn.functional.linear(hidden, w.lm_head)
        if logits_out is None:
            return logits.float()
        return logits_out.copy_(logits)
