"""Sampling: one token per row of float32 logits, each row with its own temperature (0 = greedy)."""

from __future__ import annotations

import torch


def sample(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    out: torch.Tensor,
    generator: torch.Generator | None = None,
    all_greedy: bool = False,
) -> torch.Tensor:
    """logits [B, V] float32, temperatures [B] float32 -> out [B] int64.

    Sampled rows use the exponential race (argmax of p / Exp(1)), which draws from softmax(logits / T) without a
    host sync; greedy rows take the argmax of the logits. The caller knows on the host whether every row is greedy
    (all_greedy) and so skips the softmax without a device-to-host read.
    """
    greedy = logits.argmax(dim=-1)
    if all_greedy:
        out.copy_(greedy)
        return out
    sampled_rows = temperatures > 0
    temps = torch.where(sampled_rows, temperatures, torch.ones_like(temperatures))
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    drawn = (probs / noise).argmax(dim=-1)
    out.copy_(torch.where(sampled_rows, drawn, greedy))
    return out
