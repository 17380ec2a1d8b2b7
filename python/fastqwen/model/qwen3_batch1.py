"""The decode step of one sequence with its RMSNorms carried by the projections' GEMVs: no norm kernel runs in it.

At one token every projection runs the one-token GEMV (csrc/gemv.cu), and each block of it reads all of x anyway, so
the RMSNorm between two projections costs nothing extra there: the projection before the norm (o_proj, down) adds its
outputs into the residual (ops.linear_add_residual), and the one after it (qkv, gate_up, the LM head) reads the
residual and normalizes it as it loads it (ops.linear(..., norm=)). Where the norm's weight was folded into a dense
projection's columns at load (weights.fold_norms), that GEMV reads x alone. Measured on the H100
(git show 1274b3f:bench/results/2026-11-24-h100-norm-in-gemv): batch-1 Qwen3-8B bf16 5.563 -> 5.470 ms a step at a 1,024-token
prompt, FP8 3.334 -> 3.309.

The engine builds Qwen3WithBatch1Decode instead of Qwen3Model where this step runs (EngineConfig.norms_in_gemv, one
rank, every projection on the one-token GEMV: `applies`); every other step is Qwen3Model.forward's.
"""

from __future__ import annotations

import torch

from .. import ops
from ..ops.collectives import ParallelGroup
from ..weights import Qwen3Weights
from .qwen3 import Qwen3Model


class Qwen3WithBatch1Decode(Qwen3Model):
    # Whether forward takes the step below for a one-sequence decode (True; bench/leave_out.py turns it off to compare).
    norms_in_gemv = True

    @staticmethod
    def applies(weights: Qwen3Weights, parallel: ParallelGroup) -> bool:
        """Whether the step runs for these weights: the one-token GEMV takes every projection on their device and
        dtype, and one rank (no all-reduce between a projection and its norm)."""
        return parallel.single and ops.norm_in_gemv_applies(
            weights.embed.dtype, weights.embed.device, weights.projections()
        )

    @torch.inference_mode()
    def forward(
        self,
        batch,
        kv,
        logits_out: torch.Tensor | None = None,
        extra_rows: torch.Tensor | None = None,
        aux_out: torch.Tensor | None = None,
    ):
        """Qwen3Model.forward; a decode step of one sequence (no prompt-logprob rows, no EAGLE-3 hidden states)
        takes batch1_decode."""
        simple = extra_rows is None and aux_out is None
        if not (self.norms_in_gemv and batch.is_decode and batch.num_tokens == 1 and simple):
            return super().forward(batch, kv, logits_out, extra_rows, aux_out)
        logits = self.batch1_decode(batch, kv)
        return logits.float() if logits_out is None else logits_out.copy_(logits)

    def batch1_decode(self, batch, kv) -> torch.Tensor:
        """The logits [1, vocab] (the model's dtype) of a decode step of one sequence: the projections before a norm
        add into the residual, the ones after it read the residual and normalize it on the way."""
        cfg, w, eps = self.cfg, self.weights, self.cfg.rms_norm_eps
        folded = w.norms_folded
        residual = self.parallel.embed(w.embed, batch.input_ids)  # a copy: the in-place residual adds never touch embed
        q = torch.empty(1, cfg.num_heads, cfg.head_dim, dtype=self.dtype, device=self.device)
        attn = torch.empty_like(q)
        decode_kernel = self.decode_workspace is not None
        if decode_kernel:
            ops.plan_decode(batch.kv_lens, self.decode_workspace, kv.k(0))
        for index, layer in enumerate(w.layers):
            qkv = ops.linear(residual, layer.qkv, norm=(None if folded.qkv else layer.input_norm, eps))
            self._attention(index, layer, batch, kv, qkv, q, attn, decode_kernel)
            ops.linear_add_residual(attn.view(1, -1), layer.o_proj, residual)
            act = ops.linear_silu_and_mul(
                residual, layer.gate_up, norm=(None if folded.gate_up else layer.post_norm, eps)
            )
            ops.linear_add_residual(act, layer.down, residual)
        return ops.linear(residual, w.lm_head, norm=(None if folded.lm_head else w.final_norm, eps))
