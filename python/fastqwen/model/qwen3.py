"""The Qwen3 dense forward pass over a ForwardBatch and the paged KV pool, written only in terms of ops.

(The decode step of one sequence has a variant whose GEMVs carry the RMSNorms: model/qwen3_batch1.py.)"""

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
        self,
        cfg: ModelConfig,
        weights: Qwen3Weights,
        max_positions: int,
        max_batch: int = 256,
        parallel: ParallelGroup = SINGLE,
    ):
        """cfg: the model as this rank sees it (sharding.Shard.rank_config: its own head counts); weights: its shard.
        Under tensor parallelism the row-parallel o_proj and down give partial sums, summed by the all-reduce that
        also adds them into the residual and applies the next norm (parallel.all_reduce_add_rms_norm; on one rank,
        fused_add_rms_norm); the embedding and the LM head are vocabulary-parallel (parallel.embed,
        parallel.gather_vocab)."""
        self.cfg = cfg
        self.weights = weights
        self.parallel = parallel
        self.device = weights.embed.device
        self.dtype = weights.embed.dtype
        self.scale = cfg.head_dim**-0.5
        self.cos_sin_cache = ops.rope_cos_sin_cache(
            cfg.head_dim, max_positions, cfg.rope_theta, self.device, cfg.rope_scaling
        )
        # Split-KV decode scratch and plan, allocated once (nothing is allocated inside a step), where the kernel runs.
        self.decode_workspace = None
        if ops.attention_kernel_applies(self.device.type == "cuda", self.dtype, cfg.head_dim):
            self.decode_workspace = ops.decode_workspace(max_batch, cfg.num_heads, self.device)
        ops.prepare_linear(weights.projections(), self.dtype, self.device)
        # FASTQWEN_FP8_FUSED_QUANT: the FP8 GEMMs' inputs quantized by the kernels that compute them (the norms before
        # qkv and gate_up, the SiLU before down): each op's quantize_for
        self.fused_quant = env.fp8_fused_quant()
        # EAGLE-3 (model/eagle3.py): the layers whose entering residual stream forward copies into aux_out, when given.
        self.aux_layers: tuple[int, ...] = ()

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        kv: KVPool,
        logits_out: torch.Tensor | None = None,
        extra_rows: torch.Tensor | None = None,
        aux_out: torch.Tensor | None = None,
    ):
        """Returns float32 logits [S, vocab] for batch.logits_indices, in logits_out when given (a CUDA graph's
        persistent output, so that captured graphs do not each keep their own logits).

        extra_rows (token rows of the batch, for prompt logprobs): then returns (logits, their final hidden states
        [E, hidden]), for the caller to project with lm_head_logits a slice at a time (a logits row is as wide as the
        vocabulary, far larger than a hidden row).

        aux_out [T, len(aux_layers) * hidden] (an EAGLE-3 drafter's input): filled with the residual stream of every
        token row as it enters each of self.aux_layers (the layers' count: after the last layer, before the norm)."""
        cfg, w = self.cfg, self.weights
        num_tokens = batch.num_tokens
        eps = cfg.rms_norm_eps
        residual = self.parallel.embed(w.embed, batch.input_ids)  # a copy: the in-place residual adds never touch embed
        hidden = torch.empty_like(residual)
        q = torch.empty(num_tokens, cfg.num_heads, cfg.head_dim, dtype=self.dtype, device=self.device)
        attn = torch.empty_like(q)
        decode_kernel = batch.is_decode and self.decode_workspace is not None
        if decode_kernel:  # the split plan of this step, once for all layers, on the device
            ops.plan_decode(batch.kv_lens, self.decode_workspace, kv.k(0))
        down_sent = False  # whether the layer before's down GEMV sent its rows (ParallelGroup.linear_to_all_reduce)
        last = len(w.layers) - 1
        # Only the rows that sample (and the extra rows) reach the final norm and the LM head.
        rows = batch.logits_indices if extra_rows is None else torch.cat([batch.logits_indices, extra_rows])
        trimmed = self._last_layer_takes_only(rows, num_tokens, aux_out)
        for index, layer in enumerate(w.layers):
            if index == 0:
                ops.rms_norm(residual, layer.input_norm, eps, out=hidden)
            else:  # hidden: the layer before's down, this rank's partial sums
                hidden, residual = self.parallel.all_reduce_add_rms_norm(
                    hidden, residual, layer.input_norm, eps, sent=down_sent, quantize_for=self._quantized(layer.qkv)
                )
            if aux_out is not None:
                self._capture(aux_out, index, residual)
            qkv = ops.linear(hidden, layer.qkv)
            if index == last and trimmed:
                # The last layer's K/V of every row go to the cache; the rest of it only for the rows that sample.
                if rows.shape[0] == 0:  # (only unfinished prefill chunks: nothing more to compute)
                    self._store_kv(index, layer, batch, kv, qkv, q)
                    return self._no_logits(extra_rows is not None)
                attn = self._attention_of_rows(index, layer, batch, kv, qkv, q, attn, rows)
                residual = residual[rows]
            else:
                self._attention(index, layer, batch, kv, qkv, q, attn, decode_kernel)
            o, o_sent = self.parallel.linear_to_all_reduce(attn.view(attn.shape[0], -1), layer.o_proj)
            hidden, residual = self.parallel.all_reduce_add_rms_norm(
                o, residual, layer.post_norm, eps, sent=o_sent, quantize_for=self._quantized(layer.gate_up)
            )
            act = ops.linear_silu_and_mul(hidden, layer.gate_up, quantize_for=self._quantized(layer.down))
            if index < last:
                hidden, down_sent = self.parallel.linear_to_all_reduce(act, layer.down)
            else:  # (the last layer's down goes to the plain all-reduce below)
                hidden = ops.linear(act, layer.down)
        hidden = self.parallel.all_reduce(hidden)  # the last layer's down (the final norm takes only some rows)
        if aux_out is not None and len(w.layers) in self.aux_layers:
            self._capture(aux_out, len(w.layers), hidden + residual)
        if not trimmed:
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

    def _quantized(self, w):
        """The projection whose FP8 GEMM input the op before may hand over already quantized (FASTQWEN_FP8_FUSED_QUANT;
        the op decides where its output would be quantized for that GEMM anyway), else None."""
        return w if self.fused_quant else None

    def _last_layer_takes_only(self, rows: torch.Tensor, num_tokens: int, aux_out: torch.Tensor | None) -> bool:
        """Whether the last layer computes its attention, o_proj and MLP for `rows` only: no other row's output is
        read (in a prefill chunk, only the last token of a finishing prompt samples), unless EAGLE-3 wants every row's
        stream after the last layer, or the rows are more than the decode workspace holds (each row is attended to
        as a decode query of its own). A decode step's rows are all its tokens: it never trims, CUDA graphs alike."""
        if rows.shape[0] >= num_tokens:
            return False
        if aux_out is not None and len(self.weights.layers) in self.aux_layers:
            return False
        return self.decode_workspace is None or rows.shape[0] <= self.decode_workspace.max_batch

    def _no_logits(self, with_hidden: bool):
        logits = torch.empty(0, self.cfg.vocab_size, dtype=torch.float32, device=self.device)
        if with_hidden:
            return logits, torch.empty(0, self.cfg.hidden_size, dtype=self.dtype, device=self.device)
        return logits

    def _capture(self, aux_out: torch.Tensor, index: int, stream: torch.Tensor) -> None:
        width = stream.shape[1]
        for slot, layer in enumerate(self.aux_layers):
            if layer == index:
                aux_out[:, slot * width : (slot + 1) * width].copy_(stream)

    def _attention(self, index, layer, batch, kv, qkv, q, attn, decode_kernel: bool) -> None:
        """Layer index's q/k-norm + RoPE + KV write, then attention into attn."""
        self._store_kv(index, layer, batch, kv, qkv, q)
        k_scale, v_scale = kv.k_scales[index], kv.v_scales[index]
        ops.paged_attention(
            q,
            kv.k(index),
            kv.v(index),
            batch,
            self.scale,
            attn,
            self.decode_workspace,
            planned=decode_kernel,
            k_scale=k_scale,
            v_scale=v_scale,
        )

    def _attention_of_rows(self, index, layer, batch, kv, qkv, q, attn, rows: torch.Tensor) -> torch.Tensor:
        """Layer index's q/k-norm + RoPE + KV write for every row, then the attention of `rows` only, into the first
        rows of attn (returned): each as one decode query over its sequence's cache up to its own position (the KV
        of this step's rows before it is in the cache by then)."""
        self._store_kv(index, layer, batch, kv, qkv, q)
        sequence = torch.searchsorted(batch.query_start[1:].long(), rows, right=True)  # the sequence of each row
        kv_lens = (batch.positions[rows] + 1).to(torch.int32)
        out = attn[: rows.shape[0]]
        ops.paged_attention_decode(
            q[rows],
            kv.k(index),
            kv.v(index),
            batch.page_table[sequence],
            kv_lens,
            self.scale,
            out,
            self.decode_workspace,
            k_scale=kv.k_scales[index],
            v_scale=kv.v_scales[index],
        )
        return out

    def _store_kv(self, index, layer, batch, kv, qkv, q) -> None:
        """Layer index's q/k-norm + RoPE into q, and its K/V written to the cache."""
        k_cache, v_cache = kv.k(index), kv.v(index)
        k_scale, v_scale = kv.k_scales[index], kv.v_scales[index]  # 1.0 but for a scaled FP8 pool
        ops.qk_norm_rope_store_kv(
            qkv,
            layer.q_norm,
            layer.k_norm,
            self.cos_sin_cache,
            batch.positions,
            k_cache,
            v_cache,
            batch.out_slots,
            self.cfg.rms_norm_eps,
            q_out=q,
            k_scale=k_scale,
            v_scale=v_scale,
        )

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of final hidden states [N, hidden]."""
        if hidden.shape[0] == 0:  # (a step of prefill-only rows: an embedding model has no LM head to run)
            return torch.empty(0, self.cfg.vocab_size, dtype=torch.float32, device=self.device)
        return self.parallel.gather_vocab(ops.linear(hidden, self.weights.lm_head), self.cfg.vocab_size).float()
