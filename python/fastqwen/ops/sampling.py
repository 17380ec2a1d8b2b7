"""Sampling references: logit penalties, top-k / top-p / min-p filtering, per-row seeded draws, and logprobs.

These are the oracle for the CUDA sampler. Order, per row: penalties and blocked tokens on the raw logits;
greedy rows take the argmax of the result; sampled rows divide by the temperature, take the softmax, keep the
intersection of the top-k set, the top-p set (computed on the top-k-renormalized probabilities) and the min-p set,
and draw from what is kept by the exponential race argmax(p / E), E ~ Exp(1) i.i.d., which samples the
renormalized kept distribution exactly and needs no sort and no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step; S rows, one per sequence that samples."""

    temperatures: torch.Tensor  # [S] float32, 0 = greedy
    top_k: torch.Tensor | None  # [S] int64, 0 = off; the three filters are None when all_greedy
    top_p: torch.Tensor | None  # [S] float32, 1 = off
    min_p: torch.Tensor | None  # [S] float32, 0 = off
    seeds: list[int | None]  # per row: the seed of this step's draw, or None to use the engine's generator
    all_greedy: bool
    needs_filter: bool  # some sampled row has top_k, top_p or min_p on


def apply_penalties(
    logits: torch.Tensor,
    rows: list[int],
    prompt_tokens: list[torch.Tensor],
    output_tokens: list[torch.Tensor],
    repetition: list[float],
    presence: list[float],
    frequency: list[float],
) -> torch.Tensor:
    """In place on logits [S, V] for the listed rows.

    repetition (HF / CTRL): a token present in the prompt or the output has its logit divided by the penalty when
    positive and multiplied by it when negative. presence / frequency (OpenAI): subtracted from the logit of each
    token generated so far, once / once per occurrence.
    """
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        out_counts = torch.bincount(output_tokens[i], minlength=vocab).to(logits.dtype)
        if repetition[i] != 1.0:
            seen = out_counts > 0
            seen[prompt_tokens[i]] = True
            x = logits[row]
            penalized = torch.where(x > 0, x / repetition[i], x * repetition[i])
            logits[row] = torch.where(seen, penalized, x)
        if presence[i] != 0.0 or frequency[i] != 0.0:
            logits[row] -= frequency[i] * out_counts + presence[i] * (out_counts > 0).to(logits.dtype)
    return logits


def block_tokens(logits: torch.Tensor, rows: list[int], tokens: list[list[int]]) -> torch.Tensor:
    """In place: the listed tokens of each listed row can never be chosen (min_tokens blocks EOS and stop ids)."""
    for row, ids in zip(rows, tokens):
        if ids:
            logits[row, ids] = float("-inf")
    return logits


def top_k_top_p_min_p_mask(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """[S, V] bool: the tokens each row keeps. Ties are broken by token id, so top_k keeps exactly k tokens."""
    vocab = probs.shape[1]
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=probs.device)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    keep = rank[None, :] < k[:, None]
    kept = sorted_probs * keep
    kept = kept / kept.sum(dim=-1, keepdim=True)
    # A token is in the top-p set when the probability of the tokens ranked above it is still short of top_p.
    # top_p = 1 is off outright: in float32 the running sum can round to 1 before the last tokens.
    keep &= ((torch.cumsum(kept, dim=-1) - kept) < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep &= sorted_probs >= min_p[:, None] * sorted_probs[:, :1]
    return torch.zeros_like(keep).scatter_(1, order, keep)


def step_seed(seed: int, index: int) -> int:
    """The seed of a request's index-th draw: depends on nothing but the request's seed and the index."""
    mixed = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    mixed ^= mixed >> 31
    return mixed & (2**63 - 1)


def sample(
    logits: torch.Tensor,
    batch: SamplingBatch,
    out: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits [S, V] float32 (penalties already applied) -> out [S] int64, one token per row."""
    greedy = logits.argmax(dim=-1)
    if batch.all_greedy:
        out.copy_(greedy)
        return out
    sampled_rows = batch.temperatures > 0
    temps = torch.where(sampled_rows, batch.temperatures, torch.ones_like(batch.temperatures))
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    if batch.needs_filter:
        probs = probs * top_k_top_p_min_p_mask(probs, batch.top_k, batch.top_p, batch.min_p)
    noise = torch.empty_like(probs)
    unseeded = [i for i, s in enumerate(batch.seeds) if s is None]
    if unseeded:
        noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_(
            generator=generator
        )
    for i, seed in enumerate(batch.seeds):
        if seed is not None:
            row_gen = torch.Generator(device=probs.device)
            row_gen.manual_seed(seed)
            noise[i].exponential_(generator=row_gen)
    drawn = (probs / noise).argmax(dim=-1)
    out.copy_(torch.where(sampled_rows, drawn, greedy))
    return out


def compute_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From raw logits [S, V]: (logprob of each token [S], top-num_top ids [S, N], their logprobs [S, N])."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1) if num_top > 0 else (logprobs[:, :0], tokens[:, None][:, :0])
    return chosen, top_ids, top_logprobs
