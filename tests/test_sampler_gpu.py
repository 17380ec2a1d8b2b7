"""The CUDA sampler (csrc/sampling.cu) against the PyTorch references in fastqwen.ops.sampling, on fresh random
logits: greedy rows equal argmax exactly; over many draws no token outside the reference's top-k / top-p / min-p set
is ever drawn and the frequencies pass a chi-square test against the reference probabilities (float64); the same
seed and step give the same token whatever the batch; edge cases; penalties, min_tokens blocking and logprobs
against the references; bad arguments raise ValueError; the call can be captured in a CUDA graph."""

from __future__ import annotations

import math
import random

import pytest
import torch
from checkpoints import captured_graph, make_checkpoint
from fastqwen import LLM, SamplingParams
from fastqwen.config import GenerationDefaults
from fastqwen.engine.sampler import GpuSampler, ReferenceSampler, effective_top_k
from fastqwen.ops._native import has_cuda_kernels
from fastqwen.ops.sampling import (
    apply_penalties,
    block_tokens,
    compute_logprobs,
    pack_sampler_rows,
    penalty_row,
    sample,
    sampler_row_layout,
    sampler_workspace,
    top_k_top_p_min_p_mask,
)
from fastqwen.scheduler import Request

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and has_cuda_kernels()), reason="needs a CUDA GPU and the kernels"
    ),
]

QWEN_VOCAB = 151_936


def run(logits, rows_cpu, counts=None, blocked=None, top_width=0):
    s, vocab = logits.shape
    dev = logits.device
    ws = sampler_workspace(s, vocab, dev)
    ws.fill_(0xAB)  # poisoned scratch: nothing may depend on its previous contents
    tokens = torch.full((s,), -7, dtype=torch.int64, device=dev)
    logprobs = torch.full((s,), float("nan"), device=dev)
    top_ids = torch.full((s, top_width), -7, dtype=torch.int64, device=dev) if top_width else None
    top_lp = torch.full((s, top_width), float("nan"), device=dev) if top_width else None
    sample(logits, rows_cpu.to(dev), tokens, ws, logprobs, top_ids, top_lp, counts=counts, blocked=blocked)
    torch.cuda.synchronize()
    return tokens, logprobs, top_ids, top_lp


def reference_mask(logits64: torch.Tensor, t: float, k: int, p: float, mp: float) -> torch.Tensor:
    """The reference's kept set of one row (float32, as ops.sample computes it)."""
    x = logits64.float()[None].cpu()
    probs = torch.softmax(x / t, dim=-1)
    return top_k_top_p_min_p_mask(probs, torch.tensor([k]), torch.tensor([p]), torch.tensor([mp]))[0]


def ambiguous_tokens(row: torch.Tensor, t: float, k: int, p: float, mp: float, tol: float = 1e-5) -> torch.Tensor:
    """[V] bool, float64: tokens whose top-p or min-p decision is within `tol` of flipping. Float32 sums (the
    reference's cumsum, the kernel's) can decide these either way; every other token must agree exactly."""
    probs = torch.softmax(row.double().cpu() / t, dim=-1)
    sp, order = probs.sort(descending=True, stable=True)
    kk = k if 0 < k < sp.numel() else sp.numel()
    amb = torch.zeros_like(sp, dtype=torch.bool)
    if p < 1.0:
        kept = sp[:kk] / sp[:kk].sum()
        before = torch.cumsum(kept, 0) - kept
        amb[:kk] |= (before - p).abs() < tol
    if mp > 0:
        amb |= ((sp / sp[0]) - mp).abs() < tol * mp
    return torch.zeros_like(amb).scatter_(0, order, amb).to(row.device)


def chi_square_ok(counts: torch.Tensor, probs: torch.Tensor, draws: int) -> tuple[bool, float, float]:
    """Pearson chi-square over tokens with expected count >= 5 (the rest pooled); threshold at z = 4.5 of the
    Wilson-Hilferty approximation (a false failure below 1e-5)."""
    expected = probs.double() * draws
    big = expected >= 5
    obs = torch.cat([counts.double()[big], counts.double()[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = (((obs - exp) ** 2) / exp).sum().item()
    df = max(1, obs.numel() - 1)
    z = 4.5
    limit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat <= limit, stat, limit


CASES = [
    # vocab, logit scale, temperature, top_k, top_p, min_p
    (QWEN_VOCAB, 3.0, 1.0, 20, 0.95, 0.0),  # the common case: decided from the 64 best
    (QWEN_VOCAB, 3.0, 0.7, 0, 0.9, 0.0),  # nucleus of the full row
    (QWEN_VOCAB, 1.0, 1.0, 200, 0.8, 0.0),  # top_k above 64 with top_p: exact selection over the row
    (QWEN_VOCAB, 4.0, 1.0, 0, 1.0, 0.02),  # min-p alone
    (QWEN_VOCAB, 4.0, 1.0, 1000, 1.0, 0.0),  # large top_k alone
    (5000, 1.0, 1.0, 0, 1.0, 0.0),  # no filter: the race over every token
    (5000, 2.0, 1.5, 64, 0.99, 0.01),  # all three at once
    (300, 1.0, 1.0, 0, 0.3, 0.0),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_draws_stay_in_the_reference_set_and_match_its_distribution(case, dtype):
    vocab, scale, t, k, p, mp = case
    gen = torch.Generator(device="cuda").manual_seed(hash(case) % 2**31)
    row = (torch.randn(vocab, generator=gen, device="cuda") * scale).to(dtype)
    assert_draws_match_the_reference(row, t, k, p, mp)


def test_min_p_keeps_tokens_by_their_ratio_to_the_top():
    """min-p keeps the tokens whose probability is at least min_p times the top token's. A row whose best tokens sit
    at set ratios to the first (1, 0.5, 0.3, 0.2, 0.15, 0.11, then 0.09 and below; the rest about e^-10): min_p = 0.1
    keeps six of them (decided from the 64 best), where min_p taken as a probability (0.1 of their mass, 2.5) would
    keep three. Random rows leave this to chance: one top token far above the rest keeps it alone either way."""
    vocab = 5000
    gen = torch.Generator(device="cuda").manual_seed(71)
    row = torch.randn(vocab, generator=gen, device="cuda") - 10
    ratios = torch.tensor([1, 0.5, 0.3, 0.2, 0.15, 0.11, 0.09, 0.07, 0.05], device="cuda")
    row[torch.randperm(vocab, generator=gen, device="cuda")[: len(ratios)]] = ratios.log()
    for dtype in (torch.float32, torch.bfloat16):
        kept = assert_draws_match_the_reference(row.to(dtype), 1.0, 0, 1.0, 0.1)
        assert kept == 6, kept


def assert_draws_match_the_reference(row: torch.Tensor, t: float, k: int, p: float, mp: float) -> int:
    """40,000 draws from one row (batches of the row, a step each): none outside the reference's kept set (up to
    ambiguous_tokens), frequencies by chi-square against its float64 probabilities. Returns the kept set's size."""
    vocab = row.shape[0]
    row64 = row.double()
    mask = reference_mask(row64, t, k, p, mp).cuda()
    allowed = mask | ambiguous_tokens(row64, t, k, p, mp)
    assert int(mask.sum()) >= 2, "one kept token: the draws would say nothing about the filter's boundary"
    probs = torch.softmax(row64 / t, dim=-1) * mask
    probs = probs / probs.sum()
    draws, batch = 40_000, 4000 if vocab == QWEN_VOCAB else 10_000
    hist = torch.zeros(vocab, dtype=torch.int64, device="cuda")
    logits = row[None].expand(batch, vocab).contiguous()
    for start in range(0, draws, batch):
        rows = pack_sampler_rows([t] * batch, k, p, mp, seed=1234, step=list(range(start, start + batch)))
        tokens, *_ = run(logits, rows)
        assert ((tokens >= 0) & (tokens < vocab)).all()
        hist += torch.bincount(tokens, minlength=vocab)
    outside = hist[~allowed].sum().item()
    assert outside == 0, f"{outside} draws outside the reference's kept set"
    ok, stat, limit = chi_square_ok(hist.cpu(), probs.cpu(), draws)
    assert ok, f"chi-square {stat:.1f} above {limit:.1f} over {int(mask.sum())} kept tokens"
    return int(mask.sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_are_argmax_and_mixed_batches(dtype):
    gen = torch.Generator(device="cuda").manual_seed(5)
    rows, vocab = 67, QWEN_VOCAB
    logits = (torch.randn(rows, vocab, generator=gen, device="cuda") * 2).to(dtype)
    logits[3, 100] = logits[3, 50_000] = logits[3].max() + 1  # tied maxima: the lower id wins, as argmax
    logits[4] = 0.0  # a row of ties
    temps = [0.0 if i % 3 else 0.8 for i in range(rows)]
    rp = pack_sampler_rows(temps, top_k=[20 if i % 2 else 0 for i in range(rows)], top_p=0.9, seed=7, step=3)
    tokens, *_ = run(logits, rp)
    want = logits.float().argmax(dim=-1)
    greedy = torch.tensor([t == 0.0 for t in temps], device="cuda")
    assert torch.equal(tokens[greedy], want[greedy])
    assert ((tokens >= 0) & (tokens < vocab)).all()
    all_greedy, *_ = run(logits, pack_sampler_rows([0.0] * rows))
    assert torch.equal(all_greedy, want)
    assert all_greedy[3].item() == 100 and all_greedy[4].item() == 0


def test_same_seed_and_step_give_the_same_token_whatever_the_batch():
    gen = torch.Generator(device="cuda").manual_seed(11)
    vocab = QWEN_VOCAB
    base = torch.randn(6, vocab, generator=gen, device="cuda") * 3
    params = [
        dict(temperature=1.0, top_k=20, top_p=0.95, min_p=0.0),
        dict(temperature=0.8, top_k=0, top_p=0.9, min_p=0.0),
        dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
        dict(temperature=1.2, top_k=300, top_p=0.7, min_p=0.0),
        dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0),
        dict(temperature=0.9, top_k=0, top_p=1.0, min_p=0.05),
    ]
    seeds = [3, 2**63 + 5, 77, 9, 1, 12345]
    steps = [0, 17, 2**33, 5, 0, 99]

    def rows_for(idx):
        return pack_sampler_rows(
            [params[i]["temperature"] for i in idx],
            [params[i]["top_k"] for i in idx],
            [params[i]["top_p"] for i in idx],
            [params[i]["min_p"] for i in idx],
            seed=[seeds[i] for i in idx],
            step=[steps[i] for i in idx],
            top_n=[3] * len(idx),
        )

    alone = [run(base[i : i + 1], rows_for([i]), top_width=3) for i in range(6)]
    rng = random.Random(0)
    for batch in (7, 64, 300):
        filler = torch.randn(batch, vocab, generator=gen, device="cuda")
        where = rng.sample(range(batch), 6)
        logits = filler.clone()
        for i, w in enumerate(where):
            logits[w] = base[i]
        fill_params = pack_sampler_rows(
            [1.0] * batch,
            top_k=[rng.choice([0, 5, 100]) for _ in range(batch)],
            top_p=0.8,
            seed=list(range(batch)),
            step=1,
        )
        packed = rows_for(range(6))
        for i, w in enumerate(where):
            fill_params[w] = packed[i]
        tokens, logprobs, top_ids, _ = run(logits, fill_params, top_width=3)
        for i, w in enumerate(where):
            assert tokens[w].item() == alone[i][0].item(), f"row {i} at position {w} of {batch}"
            assert logprobs[w].item() == alone[i][1].item()
            assert torch.equal(top_ids[w], alone[i][2][0])


def test_seeds_and_steps_change_the_draw():
    logits = torch.zeros(1, 1000, device="cuda")  # uniform: every draw is a fresh token
    seen = set()
    for seed in range(20):
        tokens, *_ = run(logits, pack_sampler_rows([1.0], seed=seed, step=0))
        seen.add(tokens.item())
    for step in range(20):
        tokens, *_ = run(logits, pack_sampler_rows([1.0], seed=0, step=step))
        seen.add(tokens.item())
    assert len(seen) > 30


def test_edge_cases():
    gen = torch.Generator(device="cuda").manual_seed(21)
    vocab = 4096
    x = torch.randn(vocab, generator=gen, device="cuda") * 2
    n = 4000
    # top_k larger than the vocabulary and top_p = 1: no filter, every token reachable, none outside.
    for k in (vocab + 5, 2**31 - 1):
        tokens, *_ = run(
            x[None].expand(n, vocab).contiguous(), pack_sampler_rows([1.0] * n, k, 1.0, seed=1, step=list(range(n)))
        )
        assert ((tokens >= 0) & (tokens < vocab)).all()
    # Ties: 10 equal logits on top, top_k 4 keeps the four lowest ids, drawn uniformly.
    tied = torch.full((vocab,), -5.0, device="cuda")
    ids = torch.tensor([7, 900, 901, 1500, 2000, 2500, 3000, 3500, 4000, 4095], device="cuda")
    tied[ids] = 3.0
    tokens, *_ = run(
        tied[None].expand(n, vocab).contiguous(), pack_sampler_rows([1.0] * n, 4, seed=2, step=list(range(n)))
    )
    counts = torch.bincount(tokens, minlength=vocab)
    assert set(torch.nonzero(counts).flatten().tolist()) == {7, 900, 901, 1500}
    assert counts[[7, 900, 901, 1500]].min().item() > n / 4 - 5 * math.sqrt(n * 3 / 16)
    # -inf logits: only finite tokens, even with top_k above their number.
    inf_row = x.clone()
    inf_row[::2] = float("-inf")
    inf_row[1::4] = float("-inf")
    finite = torch.isfinite(inf_row)
    for k, p in ((0, 1.0), (vocab, 0.9), (3000, 1.0), (20, 0.95)):
        tokens, *_ = run(
            inf_row[None].expand(n, vocab).contiguous(), pack_sampler_rows([1.0] * n, k, p, seed=3, step=list(range(n)))
        )
        assert finite[tokens].all()
    all_inf_but_one = torch.full((vocab,), float("-inf"), device="cuda")
    all_inf_but_one[1234] = -1e30
    for t, k in ((1.0, 0), (0.5, 10), (0.0, 0)):
        tokens, *_ = run(
            all_inf_but_one[None].expand(4, vocab).contiguous(),
            pack_sampler_rows([t] * 4, k, seed=4, step=list(range(4))),
        )
        assert (tokens == 1234).all()
    # A tiny temperature is greedy unless the maxima tie exactly.
    tokens, *_ = run(
        x[None].expand(n, vocab).contiguous(), pack_sampler_rows([1e-4] * n, 0, 0.95, seed=5, step=list(range(n)))
    )
    assert (tokens == x.argmax()).all()
    two = x.clone()
    two[[10, 20]] = x.max() + 1
    tokens, *_ = run(
        two[None].expand(n, vocab).contiguous(), pack_sampler_rows([1e-4] * n, seed=6, step=list(range(n)))
    )
    assert set(tokens.unique().tolist()) == {10, 20}
    # Vocabularies that are not a multiple of 4 (scalar loads) and smaller than a list.
    for v in (1, 3, 37, 1027):
        y = torch.randn(8, v, generator=gen, device="cuda")
        tokens, *_ = run(
            y,
            pack_sampler_rows(
                [0.0, 1.0, 1.0, 1.0, 0.5, 1.0, 1.0, 0.0],
                [0, 5, 0, 100, 2, 0, 70, 3],
                [1.0, 1.0, 0.5, 0.9, 1.0, 1.0, 0.2, 1.0],
                seed=9,
                step=1,
            ),
        )
        assert ((tokens >= 0) & (tokens < v)).all()
        assert tokens[0].item() == y[0].argmax().item() and tokens[7].item() == y[7].argmax().item()


def test_penalties_blocking_and_counts_match_the_references():
    gen = torch.Generator(device="cuda").manual_seed(31)
    vocab, rows = QWEN_VOCAB, 6
    logits = torch.randn(rows, vocab, generator=gen, device="cuda") * 2
    rng = random.Random(1)
    top = logits.topk(8, dim=-1).indices.tolist()
    prompts = [[top[r][0], top[r][3]] + [rng.randrange(vocab) for _ in range(50)] for r in range(rows)]
    outputs = [[top[r][1]] * 3 + [top[r][2]] + [rng.randrange(vocab) for _ in range(30)] for r in range(rows)]
    rep = [1.3, 1.0, 0.8, 1.1, 2.0, 1.0]
    pres = [0.0, 1.5, 0.0, -0.5, 0.3, 0.0]
    freq = [0.0, 0.7, 0.0, 1.0, -0.2, 0.0]
    counts = torch.zeros(rows + 2, vocab, dtype=torch.int32, device="cuda")
    slots = [2, 0, 5, 1, 7, -1]
    for r, s in enumerate(slots):
        if s >= 0:
            counts[s] = penalty_row(prompts[r], outputs[r], vocab, torch.device("cuda"))
    assert (counts[2, top[0][0]] & sampler_row_layout().prompt_bit) != 0
    blocked = torch.full((rows, 4), -1, dtype=torch.int32, device="cuda")
    blocked[4, 0] = top[4][4]
    blocked[5, :2] = torch.tensor(top[5][:2], dtype=torch.int32)
    want = logits.clone()
    pen_rows = [r for r in range(rows) if slots[r] >= 0]
    apply_penalties(
        want,
        pen_rows,
        [torch.tensor(prompts[r], device="cuda") for r in pen_rows],
        [torch.tensor(outputs[r], device="cuda") for r in pen_rows],
        [rep[r] for r in pen_rows],
        [pres[r] for r in pen_rows],
        [freq[r] for r in pen_rows],
    )
    block_tokens(want, [4, 5], [[top[4][4]], top[5][:2]])
    before = counts.clone()
    params = pack_sampler_rows(
        [0.0] * rows,
        slot=slots,
        repetition=rep,
        presence=pres,
        frequency=freq,
        num_blocked=[0, 0, 0, 0, 1, 2],
        top_n=[5] * rows,
    )
    tokens, logprobs, top_ids, top_lp = run(logits, params, counts=counts, blocked=blocked, top_width=5)
    assert torch.equal(tokens, want.argmax(dim=-1))
    # Logprobs and alternatives from the raw logits, before penalties.
    chosen, ref_ids, ref_lp = compute_logprobs(logits, tokens, 5)
    torch.testing.assert_close(logprobs, chosen, rtol=0, atol=2e-5)
    assert torch.equal(top_ids, ref_ids)
    torch.testing.assert_close(top_lp, ref_lp, rtol=0, atol=2e-5)
    # The drawn token of each row with a slot is counted.
    expect = before.clone()
    for r, s in enumerate(slots):
        if s >= 0:
            expect[s, tokens[r]] += 1
    assert torch.equal(counts, expect)
    # Sampled rows with penalties (each row its own slot, same counts): every draw inside the reference set of the
    # penalized logits.
    n, r = 1000, 3
    table = before[slots[r]][None].expand(n, vocab).contiguous()
    params = pack_sampler_rows(
        [1.0] * n,
        20,
        0.9,
        seed=8,
        step=list(range(n)),
        slot=list(range(n)),
        repetition=rep[r],
        presence=pres[r],
        frequency=freq[r],
    )
    tokens, *_ = run(logits[r][None].expand(n, vocab).contiguous(), params, counts=table)
    mask = reference_mask(want[r].double(), 1.0, 20, 0.9, 0.0).cuda() | ambiguous_tokens(want[r], 1.0, 20, 0.9, 0.0)
    assert mask[tokens].all()
    assert len(set(tokens.tolist())) > 3


def test_logprobs_of_sampled_rows_and_bf16():
    gen = torch.Generator(device="cuda").manual_seed(41)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(33, QWEN_VOCAB, generator=gen, device="cuda") * 3).to(dtype)
        params = pack_sampler_rows([1.0] * 33, 20, 0.95, seed=1, step=list(range(33)), top_n=[20] * 32 + [0])
        tokens, logprobs, top_ids, top_lp = run(logits, params, top_width=20)
        chosen, ref_ids, ref_lp = compute_logprobs(logits.float(), tokens, 20)
        torch.testing.assert_close(logprobs, chosen, rtol=0, atol=3e-5)
        torch.testing.assert_close(top_lp[:32], ref_lp[:32], rtol=0, atol=3e-5)
        # Equal logits (common in bf16) may come in any order from torch.topk; ours lists them by id.
        got_vals = logits.float()[:32].gather(1, top_ids[:32])
        assert torch.equal(got_vals, logits.float()[:32].gather(1, ref_ids[:32]))
        assert (top_ids[:32].sort(dim=1).values.diff(dim=1) > 0).all()
        ties = got_vals[:, 1:] == got_vals[:, :-1]
        assert (top_ids[:32][:, 1:] > top_ids[:32][:, :-1])[ties].all()
        assert top_ids[32].numel() == 20 and (top_ids[32] == -7).all()  # top_n 0: nothing written


def test_bad_arguments_raise_value_error():
    logits = torch.randn(2, 100, device="cuda")
    rows = pack_sampler_rows([1.0, 0.0]).cuda()
    tokens = torch.empty(2, dtype=torch.int64, device="cuda")
    ws = sampler_workspace(2, 100, torch.device("cuda"))
    # float16 logits are no kernel dtype: the reference runs instead, and greedy rows agree with the argmax.
    sample(logits.half(), rows, tokens, ws)
    assert tokens[1].item() == logits.half().float()[1].argmax().item()
    with pytest.raises(ValueError):
        sample(logits, rows[:1], tokens, ws)
    with pytest.raises(ValueError):
        sample(logits, rows, tokens.int(), ws)
    with pytest.raises(ValueError):
        sample(torch.randn(2, 100_000, device="cuda"), rows, tokens, ws)  # workspace too small
    with pytest.raises(ValueError):
        sample(
            logits,
            rows,
            tokens,
            ws,
            top_ids=torch.empty(2, 65, dtype=torch.int64, device="cuda"),
            top_logprobs=torch.empty(2, 65, device="cuda"),
        )
    with pytest.raises(ValueError):
        sample(logits, rows.cpu(), tokens, ws)
    for bad in (dict(top_p=0.0), dict(top_p=1.5), dict(min_p=-0.1), dict(top_n=65), dict(repetition=0.0)):
        with pytest.raises(ValueError):
            pack_sampler_rows([1.0], **bad)
    with pytest.raises(ValueError):
        pack_sampler_rows([-1.0])


def test_capture_in_a_cuda_graph():
    gen = torch.Generator(device="cuda").manual_seed(51)
    s, vocab = 16, QWEN_VOCAB
    logits = torch.randn(s, vocab, generator=gen, device="cuda")
    rows = torch.empty(s, sampler_row_layout().words, dtype=torch.int32, device="cuda")
    tokens = torch.empty(s, dtype=torch.int64, device="cuda")
    ws = sampler_workspace(s, vocab, torch.device("cuda"))
    rows.copy_(pack_sampler_rows([1.0] * s, 20, 0.9, seed=1, step=0))
    graph = captured_graph(lambda: sample(logits, rows, tokens, ws))
    for step in range(3):
        packed = pack_sampler_rows([0.7] * s, [0, 20, 300, 5] * 4, 0.9, seed=2, step=step)
        rows.copy_(packed)
        logits.copy_(torch.randn(s, vocab, generator=gen, device="cuda"))
        graph.replay()
        got = tokens.clone()
        want, *_ = run(logits, packed)
        assert torch.equal(got, want)


def test_top_k_past_the_vocabulary_is_off():
    """top_k at or past the vocabulary keeps every token: the same draws as top_k off (same seeds and steps), for
    values the kernel's int32 holds (vocab, vocab + 1, 2^31 - 1) and values it does not (2^31, 2^40, 2^70), which
    must neither overflow nor raise."""
    gen = torch.Generator(device="cuda").manual_seed(61)
    n, vocab = 512, 4096
    logits = (torch.randn(vocab, generator=gen, device="cuda") * 2)[None].expand(n, vocab).contiguous()
    steps = list(range(n))
    off, *_ = run(logits, pack_sampler_rows([1.0] * n, 0, 0.9, seed=7, step=steps))
    assert len(set(off.tolist())) > 20, "the comparison needs varied draws"
    for k in (vocab, vocab + 1, 2**31 - 1, 2**31, 2**40, 2**70):
        tokens, *_ = run(logits, pack_sampler_rows([1.0] * n, k, 0.9, seed=7, step=steps))
        assert torch.equal(tokens, off), k


# ---- through the engine: huge top_k, and bans wider than the graphs' under CUDA graphs ---------------------------


@pytest.fixture(scope="module")
def graph_folder(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("sampler_graph"))
    make_checkpoint(
        folder,
        tied=False,
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
        hidden=256,
        intermediate=512,
        layers=2,
        dtype=torch.bfloat16,
        logit_scale=8.0,
        seed=13,
    )
    return folder


def engine(folder: str, graphs: bool) -> LLM:
    return LLM(
        folder,
        dtype="bfloat16",
        device="cuda",
        page_size=16,
        num_pages=256,
        max_num_seqs=16,
        disable_cuda_graph=not graphs,
        cuda_graph_max_bs=8,
    )


def test_engine_top_k_past_the_vocabulary_matches_top_k_off(graph_folder):
    llm = engine(graph_folder, graphs=True)
    prompts = [[5, 17, 99, 3], [250, 1, 2]]

    def run_with(top_k):
        params = SamplingParams(temperature=1.0, top_k=top_k, seed=21, max_tokens=12, ignore_eos=True)
        return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    off = run_with(0)
    for k in (2**31, 2**40):
        assert run_with(k) == off, k


def test_min_tokens_with_64_stop_ids_under_graphs_matches_eager(graph_folder):
    """min_tokens with 64 stop ids (plus EOS) bans more ids than the graphs were captured for: those steps run
    eagerly instead of raising, later ones replay graphs, and every token equals the eager engine's; no stop id is
    drawn before min_tokens."""
    graph_llm, eager_llm = engine(graph_folder, graphs=True), engine(graph_folder, graphs=False)
    assert graph_llm.engine.runner.graphs is not None and graph_llm.engine.runner.sampler.graph_hook is not None
    rng = random.Random(3)
    prompts = [[rng.randrange(0, 380) for _ in range(rng.randint(3, 40))] for _ in range(5)]
    free = eager_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    # Stop ids the free-running rows draw early (so the bans decide tokens), padded to 64 distinct ids.
    drawn = sorted({t for o in free for t in o.token_ids[:4]})
    stops = (drawn + [t for t in range(400) if t not in drawn])[:64]
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 else 0.8,
            top_k=30,
            seed=50 + i,
            max_tokens=16,
            min_tokens=6,
            stop_token_ids=stops if i != 4 else [],
            repetition_penalty=1.2 if i == 1 else 1.0,
        )
        for i in range(5)
    ]
    replays = []
    replay = graph_llm.engine.runner.graphs.replay_sampler  # a graph step's sampler graph
    graph_llm.engine.runner.graphs.replay_sampler = lambda size: replays.append(size) or replay(size)
    graph_outs = graph_llm.generate(prompts, params, use_tqdm=False)
    eager_outs = eager_llm.generate(prompts, params, use_tqdm=False)
    for i, (g, e) in enumerate(zip(graph_outs, eager_outs)):
        assert g.token_ids == e.token_ids, i
        assert g.finish_reason == e.finish_reason, i
        if i != 4:
            assert len(g.token_ids) >= 6 and not set(g.token_ids[:6]) & set(stops), i
    assert replays, "no step replayed a graph once min_tokens was out"


# ---- the engine's sampler at the largest default batch (issue 47) ------------------------------------------------

ENGINE_ROWS = 512
EOS = [QWEN_VOCAB - 1, QWEN_VOCAB - 2]


def sampler_request(i: int, top: list[int], rng: random.Random) -> Request:
    """Row i's request, one of four kinds by i % 4, with prompt and output tokens that make its penalties and bans
    decide: greedy with penalties and logprobs; greedy with a min_tokens ban of its best token and a logit_bias on its
    second and sixth; seeded top-k/top-p; unseeded min-p with a repetition penalty. `top`: the row's best token ids."""
    params = [
        SamplingParams(
            temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3, logprobs=3
        ),
        SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=[top[0]], logit_bias={top[1]: -30.0, top[5]: 5.0}),
        SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=1000 + i),
        SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.2),
    ][i % 4]
    prompt = [top[2]] + [rng.randrange(QWEN_VOCAB - 2) for _ in range(20)]
    request = Request(rid=i, prompt_ids=prompt, params=params.with_defaults(GenerationDefaults()), arrival=i)
    request.token_ids += [top[0], top[0], top[1]]  # three outputs: under min_tokens
    return request


def assert_rows_match_the_reference(logits: torch.Tensor, requests: list, tokens: list[int], results) -> None:
    """Each row against ReferenceSampler on the same logits and requests: greedy rows its token, sampled rows a token
    of its kept set (penalties, bias and bans applied by the reference, as the draws' tests take it: up to
    ambiguous_tokens), rows with logprobs the same chosen logprob (within the kernel tests' 3e-5) and top ids."""
    reference = ReferenceSampler(QWEN_VOCAB, logits.device, EOS, seed=0)
    want, want_logprobs = reference.sample(logits.clone(), requests, lambda t: t.tolist())
    processed = logits.clone()
    reference._process_logits(processed, requests)  # what the draws are taken from
    for i, r in enumerate(requests):
        p = r.params
        if p.is_greedy:
            assert tokens[i] == want[i], f"row {i}: {tokens[i]}, the reference {want[i]}"
        else:
            t, k, top_p, min_p = p.temperature, effective_top_k(p.top_k, QWEN_VOCAB), p.top_p, p.min_p
            kept = reference_mask(processed[i].double(), t, k, top_p, min_p)
            ok = bool(kept[tokens[i]]) or bool(ambiguous_tokens(processed[i], t, k, top_p, min_p)[tokens[i]])
            assert ok, f"row {i}: token {tokens[i]} outside the reference's kept set"
        if p.logprobs is not None:
            got, ref = results[i], want_logprobs[i]
            assert got.token == ref.token and abs(got.logprob - ref.logprob) <= 3e-5, (i, got, ref)
            assert [t for t, _ in got.top] == [t for t, _ in ref.top], i


def test_engine_sampler_at_512_rows_matches_the_reference_sampler():
    """The GPU sampler as the engine runs it at the largest default batch: 512 rows of requests prepared by
    GpuSampler.prepare and drawn by its graph hook replayed from a CUDA graph captured at 512 rows, against
    ReferenceSampler (assert_rows_match_the_reference) on every row. Then a second step as the engine takes it: each
    request's token appended, 300 of the requests (rows 212 to 511 of the first step, so their penalty counts
    rows were counted on the device at rows past 256) in rows 0 to 299, rows 300 to 511 padding: the real rows against
    the reference from the token lists, the padding rows greedy on their raw logits."""
    device = torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(47)
    rng = random.Random(47)
    sampler = GpuSampler(QWEN_VOCAB, ENGINE_ROWS, device, EOS, seed=5)
    sampler.freeze()
    logits = torch.empty(ENGINE_ROWS, QWEN_VOCAB, device="cuda")
    # (captured_graph's warm-up run draws neutral rows: nothing is counted)
    graph = captured_graph(lambda: sampler.graph_hook(logits, ENGINE_ROWS))

    def step(requests: list) -> list[int]:
        sampler.prepare(requests, pad_to=ENGINE_ROWS)
        graph.replay()
        tokens = sampler.tokens[:ENGINE_ROWS].tolist()
        assert_rows_match_the_reference(logits[: len(requests)], requests, tokens, sampler.results(requests, tokens))
        return tokens

    logits.copy_(torch.randn(ENGINE_ROWS, QWEN_VOCAB, generator=gen, device="cuda") * 3)
    top = logits.topk(8, dim=-1).indices.tolist()
    requests = [sampler_request(i, top[i], rng) for i in range(ENGINE_ROWS)]
    assert sum(r.params.has_penalties for r in requests[256:]) >= 128
    tokens = step(requests)
    for r, token in zip(requests, tokens):
        r.token_ids.append(token)
    logits.copy_(torch.randn(ENGINE_ROWS, QWEN_VOCAB, generator=gen, device="cuda") * 3)
    second = requests[212:]
    tokens = step(second)
    padding = logits[len(second) :].argmax(dim=-1).tolist()
    assert tokens[len(second) :] == padding, "padding rows are not neutral greedy rows"
