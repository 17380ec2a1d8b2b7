"""ForwardBatch: everything one model step needs to know, as tensors on the model's device. Model inputs only: how
the logits become tokens is the sampler's business (engine/sampler.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, the tokens to compute, packed by sequence
    positions: torch.Tensor  # [T] int64, position of each token in its sequence
    out_slots: torch.Tensor  # [T] int64, flat KV slot (page * page_size + offset) of each token; -1 = padding
    query_start: torch.Tensor  # [B + 1] int32, sequence b's tokens are input_ids[query_start[b]:query_start[b+1]]
    kv_lens: torch.Tensor  # [B] int32, cached tokens of each sequence after this step
    page_table: torch.Tensor  # [B, max_pages] int32, pages of each sequence in order
    logits_indices: torch.Tensor  # [S] int64, rows of T whose logits are needed (last token of sampling sequences)
    is_decode: bool  # every sequence computes exactly one token
    max_query_len: int = 0  # longest run of query tokens of one sequence (sizes the prefill grid); 0 = unknown

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def batch_size(self) -> int:
        return self.kv_lens.shape[0]
