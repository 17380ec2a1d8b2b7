"""The Qwen3 dense forward pass over a ForwardBatch and the paged KV pool, written only in terms of ops."""

from __future__ import annotations

import torch

from .. import env, ops
from ..config import ModelConfig
from ..kvcache import KVPool
from ..ops.collectives import SINGLE, ParallelGroup
from ..weights import Qwen3Weights
from .forward_batch import ForwardBatch




class Qwen3Model:
    def __init__(
        self, cfg: ModelConfig, weights: Qwen3Weights, max_positions: int, max_batch: int = 256,
        parallel: ParallelGroup = SINGLE,
    ):  # fmt: skip
        """cfg: the model as this rank sees it (sharding.Shard.rank_config: its own head counts); weights: its shard.
        Under tensor parallelism the row-parallel o_proj and down are followed by an all-reduce, the embedding and
        the LM head are vocabulary-parallel (parallel.embed, parallel.gather_vocab)."""
        self.cfg = cfg
        self.weights = weights
        self.parallel = parallel
        self.device = weights.embed.device
        self.dtype = weights.embed.dtype
        self.scale = cfg.head_dim**-0.5
        self.cos_sin_cache = ops.rope_cos_sin_cache(cfg.head_dim, max_positions, cfg.rope_theta, self.device)
        # Split-KV decode scratch and plan, allocated once (nothing is allocated inside a step), where the kernel runs.
        self.decode_workspace = None
        if ops.attention_kernel_applies(self.device.type == "cuda", self.dtype, cfg.head_dim):
            self.decode_workspace = ops.decode_workspace(max_batch, cfg.num_heads, self.device)
        projections = [getattr(layer, n) for layer in weights.layers for n in ("qkv", "o_proj", "gate_up", "down")]
        ops.prepare_linear(projections + [weights.lm_head], self.dtype, self.device)
        # Decode at batch 1: the RMSNorms ride on the GEMVs (ops.linear_add_residual, then linear(..., norm=)), so no
        # norm kernel runs in the step; where the one-token GEMV runs every projection and no all-reduce comes
        # between a projection and its norm.
        self.norms_in_gemv = (
            parallel.single and env.norm_in_gemv()
            and ops.norm_in_gemv_applies(self.dtype, self.device, projections + [weights.lm_head])
        )  # fmt: skip
        # Dense projections after a norm take its weight into their columns, so that their one-token GEMV reads only
        # x (measured on the H100, 8B bf16 batch-1 step: see bench/results/2026-11-24-h100-norm-in-gemv). Which of
        # (qkv, gate_up, the LM head) did: the same for every layer (one dtype; a tied LM head is the embedding).
        self.norm_folded = (False, False, False)
        if self.norms_in_gemv:
            folded = [(ops.fold_norm(l.input_norm, l.qkv), ops.fold_norm(l.post_norm, l.gate_up)) for l in weights.layers]
            tied = weights.lm_head.weight is weights.embed
            self.norm_folded = (*folded[0], not tied and ops.fold_norm(weights.final_norm, weights.lm_head))
            assert all(f == folded[0] for f in folded), "layers with dense and FP8 projections mixed"

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, kv: KVPool, logits_out: torch.Tensor | None = None, extra_rows: torch.Tensor | None = None
    ):
        """Returns float32 logits [S, vocab] for batch.logits_indices, in logits_out when given (a CUDA graph's
        persistent output, so that captured graphs do not each keep their own logits).

        extra_rows (token rows of the batch, for prompt logprobs): then returns (logits, their final hidden states
        [E, hidden]), for the caller to project with lm_head_logits a slice at a time (a logits row is as wide as the
        vocabulary, far larger than a hidden row)."""
        cfg, w = self.cfg, self.weights
        num_tokens = batch.num_tokens
        eps = cfg.rms_norm_eps
        residual = self.parallel.embed(w.embed, batch.input_ids)  # a copy: the in-place residual adds never touch embed
        hidden = torch.empty_like(residual)
        q = torch.empty(num_tokens, cfg.num_heads, cfg.head_dim, dtype=self.dtype, device=self.device)
        attn = torch.empty_like(q)
        decode_kernel = batch.is_decode and self.decode_workspace is not None
        if self.norms_in_gemv and batch.is_decode and num_tokens == 1 and extra_rows is None:
            logits = self._one_token_norms_in_gemv(batch, kv, residual, q, attn, decode_kernel)
            return logits.float() if logits_out is None else logits_out.copy_(logits)
        if decode_kernel:  # the split plan of this step, once for all layers, on the device
            ops.plan_decode(batch.kv_lens, self.decode_workspace, kv.k(0).dtype)
        for index, layer in enumerate(w.layers):
            if index == 0:
                ops.rms_norm(residual, layer.input_norm, eps, out=hidden)
            else:
                ops.fused_add_rms_norm(hidden, residual, layer.input_norm, eps)
            qkv = ops.linear(hidden, layer.qkv)
            self._attention(index, layer, batch, kv, qkv, q, attn, decode_kernel)
            hidden = self.parallel.all_reduce(ops.linear(attn.view(num_tokens, -1), layer.o_proj))
            ops.fused_add_rms_norm(hidden, residual, layer.post_norm, eps)
            act = ops.linear_silu_and_mul(hidden, layer.gate_up)
            hidden = self.parallel.all_reduce(ops.linear(act, layer.down))
        # Only the rows that sample reach the final norm and the LM head.
        rows = batch.logits_indices if extra_rows is None else torch.cat([batch.logits_indices, extra_rows])
        hidden = hidden[rows]
        residual = residual[rows]
        ops.fused_add_rms_norm(hidden, residual, w.final_norm, eps)
        if extra_rows is not None:
            num_samples = batch.logits_indices.shape[0]
            return self.lm_head_logits(hidden[:num_samples]), hidden[num_samples:]
        logits = self.parallel.gather_vocab(ops.linear(hidden, w.lm_head), cfg.vocab_size)
        if logits_out is None:
            return logits.float()
        return logits_out.copy_(logits)

    def _attention(self, index, layer, batch, kv, qkv, q, attn, decode_kernel: bool) -> None:
        """Layer index's q/k-norm + RoPE + KV write, then attention into attn."""
        k_cache, v_cache = kv.k(index), kv.v(index)
        k_scale, v_scale = kv.k_scales[index], kv.v_scales[index]  # 1.0 but for a scaled FP8 pool
        ops.qk_norm_rope_store_kv(
            qkv, layer.q_norm, layer.k_norm, self.cos_sin_cache, batch.positions,
            k_cache, v_cache, batch.out_slots, self.cfg.rms_norm_eps, q_out=q, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
        if batch.is_decode:
            ops.paged_attention_decode(
                q, k_cache, v_cache, batch.page_table, batch.kv_lens, self.scale, attn,
                self.decode_workspace, planned=decode_kernel, k_scale=k_scale, v_scale=v_scale,
            )  # fmt: skip
        else:
            ops.paged_attention_prefill(
                q, k_cache, v_cache, batch.query_start, batch.page_table, batch.kv_lens, self.scale, attn,
                batch.max_query_len or None,  # the batch builder knows it: no read-back
                k_scale=k_scale, v_scale=v_scale,
            )

    def _one_token_norms_in_gemv(self, batch, kv, residual, q, attn, decode_kernel: bool) -> torch.Tensor:
        """forward's decode step of one sequence with the norms in the GEMVs: the projections before a norm add into
        the residual, the ones after it read the residual and normalize it on the way. Returns the logits."""
        w, eps = self.weights, self.cfg.rms_norm_eps
        if decode_kernel:
            ops.plan_decode(batch.kv_lens, self.decode_workspace, kv.k(0).dtype)
        qkv_folded, gate_up_folded, lm_head_folded = self.norm_folded
        for index, layer in enumerate(w.layers):
            qkv = ops.linear(residual, layer.qkv, norm=(None if qkv_folded else layer.input_norm, eps))
            self._attention(index, layer, batch, kv, qkv, q, attn, decode_kernel)
            ops.linear_add_residual(attn.view(1, -1), layer.o_proj, residual)
            act = ops.linear_silu_and_mul(residual, layer.gate_up, norm=(None if gate_up_folded else layer.post_norm, eps))
            ops.linear_add_residual(act, layer.down, residual)
        return ops.linear(residual, w.lm_head, norm=(None if lm_head_folded else w.final_norm, eps))

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of final hidden states [N, hidden]."""
        return self.parallel.gather_vocab(ops.linear(hidden, self.weights.lm_head), self.cfg.vocab_size).float()
