"""Sampling: the one op of the CUDA sampler kernel (``sample``, csrc/sampling.cu) and its PyTorch references.

``sample`` turns logits into one token per row, each row with its own parameters packed into a row of words
(``pack_sampler_rows``, in the layout csrc/sampling.h defines and the extension exports), with penalties from a
counts table kept on the device, min_tokens bans, logprobs and seeded draws; on anything but a CUDA tensor it runs
``sample_reference``, the same contract in PyTorch.

The references are the oracle. Order, per row: penalties and blocked tokens on the raw logits; greedy rows take the
argmax of the result; sampled rows divide by the temperature, take the softmax, keep the intersection of the top-k
set, the top-p set (computed on the top-k-renormalized probabilities) and the min-p set, and draw from what is kept
by the exponential race argmax(p / E), E ~ Exp(1) i.i.d., which samples the renormalized kept distribution exactly
and needs no sort and no host sync. The kernel's E come from Philox keyed by (seed, step), the reference's from
torch generators: the same distribution, not the same draws.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from ._native import check_tensors, dtype_code, kernel_applies, native, stream_of


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
        seen = out_counts > 0
        seen[prompt_tokens[i]] = True
        _penalize(logits, row, out_counts, seen, repetition[i], presence[i], frequency[i])
    return logits


def _penalize(logits, row: int, out_counts, seen, repetition: float, presence: float, frequency: float) -> None:
    if repetition != 1.0:
        x = logits[row]
        logits[row] = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    if presence != 0.0 or frequency != 0.0:
        logits[row] -= frequency * out_counts + presence * (out_counts > 0).to(logits.dtype)


def block_tokens(logits: torch.Tensor, rows: list[int], tokens: list[list[int]]) -> torch.Tensor:
    """In place: the listed tokens of each listed row can never be chosen (min_tokens blocks EOS and stop ids)."""
    for row, ids in zip(rows, tokens):
        if ids:
            logits[row, ids] = float("-inf")
    return logits


def bias_tokens(
    logits: torch.Tensor, rows: list[int], tokens: list[list[int]], values: list[list[float]]
) -> torch.Tensor:
    """In place: each listed token of each listed row gets its value added to its logit (logit_bias)."""
    for row, ids, vals in zip(rows, tokens, values):
        if ids:
            index = torch.tensor(ids, dtype=torch.int64, device=logits.device)
            logits[row, index] += torch.tensor(vals, dtype=logits.dtype, device=logits.device)
    return logits


def bitmask_allows(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[S, W] int32 token bitmasks (bit t % 32 of word t / 32 allows token t) -> [S, vocab] bool."""
    shifts = torch.arange(32, dtype=torch.int32, device=mask.device)
    bits = (mask[:, :, None] >> shifts) & 1
    return bits.reshape(mask.shape[0], -1)[:, :vocab].bool()


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], mask: torch.Tensor) -> torch.Tensor:
    """In place: in each listed row, the tokens its row of mask [S, W] does not allow can never be chosen."""
    if rows:
        allowed = bitmask_allows(mask.to(logits.device), logits.shape[1])
        for row in rows:  # row by row: in place, no gather / scatter of whole rows
            logits[row].masked_fill_(~allowed[row], float("-inf"))
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


def draw_reference(
    logits: torch.Tensor,
    batch: SamplingBatch,
    out: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits [S, V] float32 (penalties already applied) -> out [S] int64, one token per row: greedy rows the
    argmax, sampled rows a draw from their kept set (the reference of everything the kernel does after penalties)."""
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


# ---- the kernel's contract (csrc/sampling.h) ----------------------------------------------------------------------
#
# One call does penalties (from a counts table kept on the device), min_tokens blocking, greedy / temperature / top-k /
# top-p / min-p sampling, the logprob of the drawn token and the top-N raw alternatives, for rows with different
# parameters. Per-row parameters are a [S, words] int32 tensor packed by pack_sampler_rows; the draw of a row depends
# only on its logits, its parameters, its seed and its step, never on the other rows. On the GPU: no host sync and no
# allocation inside, so it can be captured in a CUDA graph.


@dataclass(frozen=True)
class SamplerRowLayout:
    """The sampler row and counts table as csrc/sampling.h lays them out, read from the extension."""

    words: int  # int32 words per row
    fields: dict  # name -> (word offset, kind): "f" float32, "i" int32, "u" uint32
    max_top_n: int  # most alternatives a row can ask for
    count_mask: int  # counts table word: the output count in these bits ...
    prompt_bit: int  # ... and this bit set when the token is in the prompt

    def word(self, name: str) -> int:
        return self.fields[name][0]


@lru_cache(maxsize=1)
def sampler_row_layout() -> SamplerRowLayout:
    m = native()
    if m is None:
        from ._native import import_error

        raise RuntimeError(f"the sampler row layout comes from fastqwen._C, which did not import: {import_error()}")
    return SamplerRowLayout(
        m.SAMPLER_ROW_WORDS, dict(m.SAMPLER_ROW_FIELDS), m.SAMPLER_MAX_TOP_N, m.COUNT_MASK, m.PROMPT_BIT
    )


def sample_kernel_applies(on_gpu: bool, dtype: torch.dtype) -> bool:
    """Whether sample runs the CUDA kernel (else sample_reference) for logits on the GPU or not, of this dtype."""
    return kernel_applies("sample", on_gpu, dtype)


def sampler_workspace(max_rows: int, vocab: int, device: torch.device) -> torch.Tensor | None:
    """Scratch memory for sample with up to max_rows rows: allocate once, reuse every call (None: the reference path
    needs none)."""
    if not sample_kernel_applies(device.type == "cuda", torch.float32):
        return None
    return torch.empty(native().sampler_workspace_bytes(max_rows, vocab), dtype=torch.uint8, device=device)


_INT32_MAX = 2**31 - 1


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
    masked=None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-row parameters as the kernel reads them: [S, words] int32 (CPU, or `out`'s first S rows, e.g. pinned).

    temperature 0 = greedy; top_k <= 0 off, and any top_k at or above the vocabulary keeps every token (values past
    int32 are stored as off); top_p 1 off; min_p 0 off; seed any int (taken mod 2^64); step = index of the draw
    within its request; slot = row of the counts table (-1 = no penalties); num_blocked = how many ids of this row of
    `blocked` are banned (or biased); top_n = -1 for no logprobs, else the number of alternatives wanted; masked = 1
    for a row whose row of the token bitmask applies.
    Raises ValueError for values outside their ranges.
    """
    layout = sampler_row_layout()
    t = np.atleast_1d(np.asarray(temperature, dtype=np.float64))
    n = t.shape[0]

    def col(values, default, dtype):
        return (
            np.full(n, default, dtype=dtype)
            if values is None
            else np.broadcast_to(np.asarray(values, dtype=dtype), (n,))
        )

    def top_k_col(values):  # Python ints of any size; past int32 a top_k keeps every token, as off does
        if values is None:
            return np.zeros(n, dtype=np.int64)
        listed = [values] * n if np.ndim(values) == 0 else list(values)
        return col([int(v) if 0 < int(v) <= _INT32_MAX else 0 for v in listed], 0, np.int64)

    k = top_k_col(top_k)
    p = col(top_p, 1.0, np.float64)
    mp = col(min_p, 0.0, np.float64)
    rep = col(repetition, 1.0, np.float64)
    pres = col(presence, 0.0, np.float64)
    freq = col(frequency, 0.0, np.float64)
    tn = col(top_n, -1, np.int64)
    nb = col(num_blocked, 0, np.int64)
    sl = col(slot, -1, np.int64)
    mk = col(masked, 0, np.int64)
    if not (np.isfinite(t).all() and (t >= 0).all()):
        raise ValueError("sampler: temperature must be finite and >= 0")
    if not ((p > 0) & (p <= 1)).all():
        raise ValueError("sampler: top_p must be in (0, 1]")
    if not ((mp >= 0) & (mp <= 1)).all():
        raise ValueError("sampler: min_p must be in [0, 1]")
    if not (np.isfinite(rep).all() and (rep > 0).all() and np.isfinite(pres).all() and np.isfinite(freq).all()):
        raise ValueError("sampler: repetition must be > 0, presence and frequency finite")
    if not ((tn >= -1) & (tn <= layout.max_top_n)).all():
        raise ValueError(f"sampler: top_n must be in [-1, {layout.max_top_n}]")
    if (nb < 0).any() or (nb > _INT32_MAX).any() or (sl < -1).any() or (sl > _INT32_MAX).any():
        raise ValueError("sampler: num_blocked must be >= 0, slot >= -1, and both must fit in int32")
    seeds = [0] * n if seed is None else ([seed] * n if isinstance(seed, int) else list(seed))
    steps = [0] * n if step is None else ([step] * n if isinstance(step, int) else list(step))
    if len(seeds) != n or len(steps) != n:
        raise ValueError("sampler: one seed and one step per row")
    words = np.zeros((n, layout.words), dtype=np.int32)
    views = {"f": words.view(np.float32), "i": words, "u": words.view(np.uint32)}

    def put(name, values):
        offset, kind = layout.fields[name]
        views[kind][:, offset] = values

    s64 = np.array([int(s) & (2**64 - 1) for s in seeds], dtype=np.uint64)
    st64 = np.array([int(s) & (2**64 - 1) for s in steps], dtype=np.uint64)
    low = np.uint64(0xFFFFFFFF)
    put("temperature", t)
    put("top_k", k)
    put("top_p", p)
    put("min_p", mp)
    put("seed_lo", (s64 & low).astype(np.uint32))
    put("seed_hi", (s64 >> np.uint64(32)).astype(np.uint32))
    put("step_lo", (st64 & low).astype(np.uint32))
    put("step_hi", (st64 >> np.uint64(32)).astype(np.uint32))
    put("slot", sl)
    put("repetition", rep)
    put("presence", pres)
    put("frequency", freq)
    put("num_blocked", nb)
    put("top_n", tn)
    put("masked", (mk != 0).astype(np.int32))
    if out is None:
        return torch.from_numpy(words)
    out[:n].numpy()[:] = words
    return out[:n]


def unpack_sampler_rows(rows: torch.Tensor) -> dict[str, np.ndarray]:
    """The fields of packed rows (any device), as numpy columns; seed and step as Python-int-ready uint64."""
    layout = sampler_row_layout()
    words = rows.detach().cpu().numpy()
    views = {"f": words.view(np.float32), "i": words, "u": words.view(np.uint32)}
    out = {name: views[kind][:, offset] for name, (offset, kind) in layout.fields.items()}
    for name in ("seed", "step"):
        out[name] = out.pop(f"{name}_lo").astype(np.uint64) | (out.pop(f"{name}_hi").astype(np.uint64) << np.uint64(32))
    return out


def sample(
    logits: torch.Tensor,
    rows: torch.Tensor,
    tokens: torch.Tensor,
    workspace: torch.Tensor | None = None,
    logprobs: torch.Tensor | None = None,
    top_ids: torch.Tensor | None = None,
    top_logprobs: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    blocked: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row. logits [S, V] (raw: penalties are applied inside); rows [S, words] int32 from
    pack_sampler_rows, on logits' device; writes tokens [S] int64, and for rows with top_n >= 0 logprobs [S]
    float32 (log-softmax of the raw logits at the token) and top_ids / top_logprobs [S, N]. counts [R, V] int32 is
    the penalty table (see SamplerRowLayout): the drawn token of a row with a slot is counted in it. blocked [S, W]
    int32: min_tokens bans, or with bias [S, W] float32 the logit_bias values added to those ids (-inf bans).
    mask [S, ceil(V / 32)] int32: grammar bitmasks, applied to the rows whose `masked` field is set. Order: penalties,
    bias and bans, mask.

    Where sample_kernel_applies (float32 / bfloat16 CUDA logits) this is the kernel of csrc/sampling.cu, which needs
    a workspace from sampler_workspace; otherwise sample_reference. Raises ValueError for bad arguments."""
    if logits.dim() != 2:
        raise ValueError(f"sample: logits must be [S, V], got shape {tuple(logits.shape)}")
    s, vocab = logits.shape
    words = sampler_row_layout().words
    if tuple(rows.shape) != (s, words):
        raise ValueError(f"sample: rows has shape {tuple(rows.shape)}, expected ({s}, {words})")
    if tuple(tokens.shape) != (s,):
        raise ValueError(f"sample: tokens has shape {tuple(tokens.shape)}, expected ({s},)")
    if not sample_kernel_applies(logits.is_cuda, logits.dtype):
        return sample_reference(logits, rows, tokens, logprobs, top_ids, top_logprobs, counts, blocked, bias, mask)
    dev = logits.device
    if workspace is None:
        raise ValueError("sample: the kernel needs a workspace (sampler_workspace)")
    check_tensors(
        "sample",
        dev,
        None,
        logits=logits,
        rows=(rows, torch.int32),
        tokens=(tokens, torch.int64),
        workspace=(workspace, torch.uint8),
    )
    args = native().SampleArgs()
    args.logits, args.dtype, args.rows, args.vocab = logits.data_ptr(), dtype_code(logits.dtype), s, vocab
    args.params, args.tokens = rows.data_ptr(), tokens.data_ptr()
    args.workspace, args.workspace_bytes = workspace.data_ptr(), workspace.numel()
    if logprobs is not None:
        check_tensors("sample", dev, None, logprobs=(logprobs, torch.float32))
        if tuple(logprobs.shape) != (s,):
            raise ValueError(f"sample: logprobs has shape {tuple(logprobs.shape)}, expected ({s},)")
        args.logprobs = logprobs.data_ptr()
    if top_ids is not None or top_logprobs is not None:
        _check_top(s, top_ids, top_logprobs)
        check_tensors("sample", dev, None, top_ids=(top_ids, torch.int64), top_logprobs=(top_logprobs, torch.float32))
        args.top_ids, args.top_logprobs, args.top_width = top_ids.data_ptr(), top_logprobs.data_ptr(), top_ids.shape[1]
    if counts is not None:
        check_tensors("sample", dev, None, counts=(counts, torch.int32))
        if counts.dim() != 2 or counts.shape[1] != vocab:
            raise ValueError(f"sample: counts must be [R, {vocab}]")
        args.counts, args.counts_rows = counts.data_ptr(), counts.shape[0]
    if blocked is not None:
        check_tensors("sample", dev, None, blocked=(blocked, torch.int32))
        if blocked.dim() != 2 or blocked.shape[0] != s:
            raise ValueError(f"sample: blocked must be [{s}, W]")
        args.blocked, args.blocked_width = blocked.data_ptr(), blocked.shape[1]
        if bias is not None:
            check_tensors("sample", dev, None, bias=(bias, torch.float32))
            if tuple(bias.shape) != tuple(blocked.shape):
                raise ValueError(f"sample: bias must have blocked's shape {tuple(blocked.shape)}")
            args.bias = bias.data_ptr()
    elif bias is not None:
        raise ValueError("sample: bias goes with blocked (the ids it applies to)")
    if mask is not None:
        check_tensors("sample", dev, None, mask=(mask, torch.int32))
        if tuple(mask.shape) != (s, (vocab + 31) // 32):
            raise ValueError(f"sample: mask must be [{s}, {(vocab + 31) // 32}]")
        args.mask, args.mask_words = mask.data_ptr(), mask.shape[1]
    args.stream = stream_of(logits)
    native().sample(args)
    return tokens


def _check_top(s: int, top_ids, top_logprobs) -> None:
    limit = sampler_row_layout().max_top_n
    if top_ids is None or top_logprobs is None:
        raise ValueError("sample: pass both top_ids and top_logprobs, or neither")
    if top_ids.dim() != 2 or top_ids.shape[0] != s or top_logprobs.shape != top_ids.shape or top_ids.shape[1] > limit:
        raise ValueError(f"sample: top_ids / top_logprobs must both be [{s}, N <= {limit}]")


def sample_reference(
    logits: torch.Tensor,
    rows: torch.Tensor,
    tokens: torch.Tensor,
    logprobs: torch.Tensor | None = None,
    top_ids: torch.Tensor | None = None,
    top_logprobs: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    blocked: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel's contract in PyTorch, from the same packed rows, counts table, bans / biases and masks: penalties
    from the counts (output count and prompt bit), biases, bans, grammar masks, draw_reference with each row's (seed, step) through step_seed, logprobs of
    the raw logits, and the drawn token counted into the row's slot."""
    layout = sampler_row_layout()
    f = unpack_sampler_rows(rows)
    s, vocab = logits.shape
    raw = logits.float()
    x = raw.clone()
    slots = [int(v) if counts is not None and 0 <= v < counts.shape[0] else -1 for v in f["slot"]]
    for i, slot in enumerate(slots):
        if slot >= 0:
            word = counts[slot].long()
            _penalize(
                x,
                i,
                (word & layout.count_mask).to(x.dtype),
                word != 0,
                float(f["repetition"][i]),
                float(f["presence"][i]),
                float(f["frequency"][i]),
            )
    if blocked is not None and blocked.shape[1] > 0:
        width = blocked.shape[1]
        bans = [
            (i, blocked[i, : min(int(nb), width)].long().tolist()) for i, nb in enumerate(f["num_blocked"]) if nb > 0
        ]
        if bias is None:
            block_tokens(x, [i for i, _ in bans], [b for _, b in bans])
        else:  # -inf entries are bans, the others biases; a ban wins over a bias of the same id
            values = [bias[i, : len(b)].tolist() for i, b in bans]
            biased = [
                ([t for t, v in zip(b, vs) if v != float("-inf")], [v for v in vs if v != float("-inf")])
                for (_, b), vs in zip(bans, values)
            ]
            bias_tokens(x, [i for i, _ in bans], [ids for ids, _ in biased], [vs for _, vs in biased])
            block_tokens(
                x,
                [i for i, _ in bans],
                [[t for t, v in zip(b, vs) if v == float("-inf")] for (_, b), vs in zip(bans, values)],
            )
    if mask is not None:
        apply_token_bitmask(x, [i for i, m in enumerate(f["masked"]) if m != 0], mask)
    temps = torch.from_numpy(f["temperature"].astype(np.float32)).to(x.device)
    top_k = torch.from_numpy(f["top_k"].astype(np.int64)).to(x.device)
    top_p = torch.from_numpy(f["top_p"].astype(np.float32)).to(x.device)
    min_p = torch.from_numpy(f["min_p"].astype(np.float32)).to(x.device)
    sampled = temps > 0
    batch = SamplingBatch(
        temps,
        top_k,
        top_p,
        min_p,
        seeds=[step_seed(int(a), int(b)) for a, b in zip(f["seed"], f["step"])],
        all_greedy=not bool(sampled.any()),
        needs_filter=bool((sampled & (((top_k > 0) & (top_k < vocab)) | (top_p < 1) | (min_p > 0))).any()),
    )
    drawn = torch.empty(s, dtype=torch.int64, device=x.device)
    draw_reference(x, batch, drawn)
    tokens.copy_(drawn)
    top_n = f["top_n"]
    if (top_n >= 0).any():
        width = 0 if top_ids is None else top_ids.shape[1]
        chosen, ids, lps = compute_logprobs(raw, drawn, min(vocab, width))
        for i in np.nonzero(top_n >= 0)[0].tolist():
            if logprobs is not None:
                logprobs[i] = chosen[i]
            n = min(int(top_n[i]), width, vocab)
            if n:
                top_ids[i, :n] = ids[i, :n]
                top_logprobs[i, :n] = lps[i, :n]
    for i, slot in enumerate(slots):
        if slot >= 0:
            counts[slot, drawn[i]] += 1
    return tokens


def penalty_row(prompt_ids: list[int], output_ids: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """A counts-table row for one request: output counts, the prompt bit on prompt tokens. [V] int32 on device."""
    row = torch.bincount(torch.tensor(output_ids, dtype=torch.int64), minlength=vocab).to(torch.int32)
    if prompt_ids:
        row[torch.tensor(prompt_ids, dtype=torch.int64)] |= sampler_row_layout().prompt_bit
    return row.to(device, non_blocking=True)
