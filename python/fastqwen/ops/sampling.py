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


# ---- the CUDA sampler (csrc/sampling.cu) ------------------------------------------------------------------------
#
# One call does penalties (from a counts table kept on the GPU), min_tokens blocking, greedy / temperature / top-k /
# top-p / min-p sampling, the logprob of the drawn token and the top-N raw alternatives, for rows with different
# parameters. Per-row parameters are a [S, 16] int32 device tensor packed by pack_sampler_rows; the draw of a row
# depends only on its logits, its parameters, its seed and its step (Philox keyed by the seed, counted by step and
# token id), never on the other rows. No host sync and no allocation inside, so it can be captured in a CUDA graph.

SAMPLER_ROW_WORDS = 16
SAMPLER_MAX_TOP_N = 64
COUNT_MASK = (1 << 30) - 1  # counts table: output-token count in bits 0..29
PROMPT_BIT = 1 << 30  # set when the token is in the prompt


def sampler_available(device: torch.device) -> bool:
    from ._native import has_cuda_kernels

    return device.type == "cuda" and has_cuda_kernels()


def sampler_workspace(max_rows: int, vocab: int, device: torch.device) -> torch.Tensor:
    """Scratch memory for sample_on_gpu with up to max_rows rows: allocate once, reuse every call."""
    from ._native import native

    return torch.empty(native().sampler_workspace_bytes(max_rows, vocab), dtype=torch.uint8, device=device)


def pack_sampler_rows(
    temperature,
    top_k=None,
    top_p=None,
    min_p=None,
    seed=None,
    step=None,
    slot=None,
    repetition=None,
    presence=None,
    frequency=None,
    num_blocked=None,
    top_n=None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-row parameters as the kernel reads them: [S, 16] int32 (CPU, or `out`'s first S rows, e.g. pinned).

    temperature 0 = greedy; top_k <= 0 off; top_p 1 off; min_p 0 off; seed any int (taken mod 2^64); step = index of
    the draw within its request; slot = row of the counts table (-1 = no penalties); num_blocked = how many ids of
    this row of `blocked` are banned; top_n = -1 for no logprobs, else the number of alternatives wanted.
    Raises ValueError for values outside their ranges.
    """
    import numpy as np

    t = np.atleast_1d(np.asarray(temperature, dtype=np.float64))
    n = t.shape[0]

    def col(values, default, dtype):
        a = np.full(n, default, dtype=dtype) if values is None else np.broadcast_to(np.asarray(values, dtype=dtype), (n,))
        return a

    k = col(top_k, 0, np.int64)
    p = col(top_p, 1.0, np.float64)
    mp = col(min_p, 0.0, np.float64)
    rep = col(repetition, 1.0, np.float64)
    pres = col(presence, 0.0, np.float64)
    freq = col(frequency, 0.0, np.float64)
    tn = col(top_n, -1, np.int64)
    nb = col(num_blocked, 0, np.int64)
    sl = col(slot, -1, np.int64)
    if not (np.isfinite(t).all() and (t >= 0).all()):
        raise ValueError("sampler: temperature must be finite and >= 0")
    if not ((p > 0) & (p <= 1)).all():
        raise ValueError("sampler: top_p must be in (0, 1]")
    if not ((mp >= 0) & (mp <= 1)).all():
        raise ValueError("sampler: min_p must be in [0, 1]")
    if not (np.isfinite(rep).all() and (rep > 0).all() and np.isfinite(pres).all() and np.isfinite(freq).all()):
        raise ValueError("sampler: repetition must be > 0, presence and frequency finite")
    if not ((tn >= -1) & (tn <= SAMPLER_MAX_TOP_N)).all():
        raise ValueError(f"sampler: top_n must be in [-1, {SAMPLER_MAX_TOP_N}]")
    if (nb < 0).any() or (sl < -1).any() or (np.abs(k) >= 2**31).any() or (sl >= 2**31).any():
        raise ValueError("sampler: num_blocked must be >= 0, slot >= -1, top_k and slot must fit in int32")
    seeds = [0] * n if seed is None else ([seed] * n if isinstance(seed, int) else list(seed))
    steps = [0] * n if step is None else ([step] * n if isinstance(step, int) else list(step))
    if len(seeds) != n or len(steps) != n:
        raise ValueError("sampler: one seed and one step per row")
    words = np.zeros((n, SAMPLER_ROW_WORDS), dtype=np.int32)
    f = words.view(np.float32)
    f[:, 0] = t
    words[:, 1] = np.clip(k, -1, 2**31 - 1)
    f[:, 2] = p
    f[:, 3] = mp
    s64 = np.array([int(s) & (2**64 - 1) for s in seeds], dtype=np.uint64)
    st64 = np.array([int(s) & (2**64 - 1) for s in steps], dtype=np.uint64)
    u = words.view(np.uint32)
    u[:, 4] = (s64 & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    u[:, 5] = (s64 >> np.uint64(32)).astype(np.uint32)
    u[:, 6] = (st64 & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    u[:, 7] = (st64 >> np.uint64(32)).astype(np.uint32)
    words[:, 8] = sl
    f[:, 9] = rep
    f[:, 10] = pres
    f[:, 11] = freq
    words[:, 12] = nb
    words[:, 13] = tn
    if out is None:
        return torch.from_numpy(words)
    out[:n].numpy()[:] = words
    return out[:n]


def sample_on_gpu(
    logits: torch.Tensor,
    rows: torch.Tensor,
    tokens: torch.Tensor,
    workspace: torch.Tensor,
    logprobs: torch.Tensor | None = None,
    top_ids: torch.Tensor | None = None,
    top_logprobs: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    blocked: torch.Tensor | None = None,
) -> torch.Tensor:
    """The CUDA sampler. logits [S, V] float32 or bfloat16 (raw: penalties are applied inside); rows [S, 16] int32
    from pack_sampler_rows, on the device; writes tokens [S] int64, and for rows with top_n >= 0 logprobs [S]
    float32 (log-softmax of the raw logits at the token) and top_ids / top_logprobs [S, N]. counts [R, V] int32 is
    the penalty table (see COUNT_MASK / PROMPT_BIT): the drawn token of a row with a slot is counted in it.
    blocked [S, W] int32: min_tokens bans. Raises ValueError for bad arguments."""
    from ._native import check_tensors, native, stream_of

    if not logits.is_cuda or logits.dim() != 2:
        raise ValueError("sample_on_gpu: logits must be a [S, V] CUDA tensor")
    if logits.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"sample_on_gpu: logits must be float32 or bfloat16, not {logits.dtype}")
    s, vocab = logits.shape
    dev = logits.device
    check_tensors("sample_on_gpu", dev, None, logits=logits, rows=(rows, torch.int32), tokens=(tokens, torch.int64),
                  workspace=(workspace, torch.uint8))  # fmt: skip
    if tuple(rows.shape) != (s, SAMPLER_ROW_WORDS):
        raise ValueError(f"sample_on_gpu: rows has shape {tuple(rows.shape)}, expected ({s}, {SAMPLER_ROW_WORDS})")
    if tuple(tokens.shape) != (s,):
        raise ValueError(f"sample_on_gpu: tokens has shape {tuple(tokens.shape)}, expected ({s},)")
    if logprobs is not None:
        check_tensors("sample_on_gpu", dev, None, logprobs=(logprobs, torch.float32))
        if tuple(logprobs.shape) != (s,):
            raise ValueError(f"sample_on_gpu: logprobs has shape {tuple(logprobs.shape)}, expected ({s},)")
    width = 0
    if top_ids is not None or top_logprobs is not None:
        if top_ids is None or top_logprobs is None:
            raise ValueError("sample_on_gpu: pass both top_ids and top_logprobs, or neither")
        check_tensors("sample_on_gpu", dev, None, top_ids=(top_ids, torch.int64), top_logprobs=(top_logprobs, torch.float32))
        width = top_ids.shape[1] if top_ids.dim() == 2 else -1
        if top_ids.dim() != 2 or top_ids.shape[0] != s or top_logprobs.shape != top_ids.shape or width > SAMPLER_MAX_TOP_N:
            raise ValueError(f"sample_on_gpu: top_ids / top_logprobs must both be [{s}, N <= {SAMPLER_MAX_TOP_N}]")
    counts_rows = 0
    if counts is not None:
        check_tensors("sample_on_gpu", dev, None, counts=(counts, torch.int32))
        if counts.dim() != 2 or counts.shape[1] != vocab:
            raise ValueError(f"sample_on_gpu: counts must be [R, {vocab}]")
        counts_rows = counts.shape[0]
    blocked_width = 0
    if blocked is not None:
        check_tensors("sample_on_gpu", dev, None, blocked=(blocked, torch.int32))
        if blocked.dim() != 2 or blocked.shape[0] != s:
            raise ValueError(f"sample_on_gpu: blocked must be [{s}, W]")
        blocked_width = blocked.shape[1]

    def ptr(t):
        return 0 if t is None or t.numel() == 0 else t.data_ptr()

    native().sample(
        ptr(logits), 0 if logits.dtype == torch.float32 else 2, s, vocab, ptr(rows), ptr(tokens), ptr(logprobs),
        ptr(top_ids), ptr(top_logprobs), width, ptr(counts), counts_rows, ptr(blocked), blocked_width, ptr(workspace),
        workspace.numel(), stream_of(logits),
    )  # fmt: skip
    return tokens


def penalty_row(prompt_ids: list[int], output_ids: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """A counts-table row for one request: output counts, PROMPT_BIT on prompt tokens. [V] int32 on device."""
    row = torch.bincount(torch.tensor(output_ids, dtype=torch.int64), minlength=vocab).to(torch.int32)
    if prompt_ids:
        row[torch.tensor(prompt_ids, dtype=torch.int64)] |= PROMPT_BIT
    return row.to(device, non_blocking=True)
