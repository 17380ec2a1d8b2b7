"""Sampling references against independent float64 definitions, and seeded sampling through the engine."""

from __future__ import annotations

import math
import random

import pytest
import torch
from checkpoints import hf_logits, make_checkpoint
from fastqwen import LLM, InvalidRequestError, SamplingParams
from fastqwen.ops.sampling import (
    SamplingBatch,
    apply_penalties,
    block_tokens,
    compute_logprobs,
    draw_reference,
    pack_sampler_rows,
    penalty_row,
    sample_reference,
    sampler_row_layout,
    step_seed,
    top_k_top_p_min_p_mask,
    unpack_sampler_rows,
)


def kept_set_float64(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> set[int]:
    """The definition, one row at a time in float64 with plain Python."""
    scaled = [x / temperature for x in logits]
    m = max(scaled)
    exps = [math.exp(x - m) for x in scaled]
    total = sum(exps)
    probs = [e / total for e in exps]
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    k = top_k if top_k > 0 else len(probs)
    topk = order[:k]
    mass = sum(probs[i] for i in topk)
    kept, cumulative = set(), 0.0
    for i in topk:
        if cumulative < top_p or top_p >= 1.0:
            kept.add(i)
        cumulative += probs[i] / mass
    return {i for i in kept if probs[i] >= min_p * probs[order[0]]}


def batch_of(rows: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None) -> SamplingBatch:
    return SamplingBatch(
        temperatures=torch.full((rows,), temperature),
        top_k=torch.full((rows,), top_k, dtype=torch.int64),
        top_p=torch.full((rows,), top_p),
        min_p=torch.full((rows,), min_p),
        seeds=seeds or [None] * rows,
        all_greedy=temperature == 0.0,
        needs_filter=top_k > 0 or top_p < 1.0 or min_p > 0.0,
    )


@pytest.mark.parametrize("seed", range(4))
def test_filter_keeps_exactly_the_defined_set(seed):
    gen = torch.Generator().manual_seed(seed)
    rows, vocab = 64, 200
    logits = torch.randn(rows, vocab, generator=gen) * 3
    rng = random.Random(seed)
    top_k = [rng.choice([0, 1, 5, 50, 199, 200]) for _ in range(rows)]
    top_p = [rng.choice([1.0, 0.9, 0.5, 0.1, 0.01]) for _ in range(rows)]
    min_p = [rng.choice([0.0, 0.05, 0.3]) for _ in range(rows)]
    temperature = [rng.choice([0.5, 1.0, 1.7]) for _ in range(rows)]
    probs = torch.softmax(logits / torch.tensor(temperature)[:, None], dim=-1)
    mask = top_k_top_p_min_p_mask(probs, torch.tensor(top_k), torch.tensor(top_p), torch.tensor(min_p))
    for r in range(rows):
        expected = kept_set_float64(logits[r].tolist(), temperature[r], top_k[r], top_p[r], min_p[r])
        got = set(torch.nonzero(mask[r]).flatten().tolist())
        assert got == expected, f"row {r}: top_k={top_k[r]} top_p={top_p[r]} min_p={min_p[r]}"
        assert got, "a row must always keep its most likely token"


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p", [(1.0, 0, 1.0, 0.0), (0.7, 6, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 10, 0.9, 0.1)]
)
def test_sampled_frequencies_match_the_distribution(temperature, top_k, top_p, min_p):
    """N draws of one row; each token's frequency is within 5 standard errors of its kept, renormalized
    probability (a false failure has probability below 1e-5 over the 12 tokens), and dropped tokens never appear."""
    vocab, draws = 12, 40_000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(7)) * 1.5
    kept = kept_set_float64(logits.tolist(), temperature, top_k, top_p, min_p)
    p = torch.softmax(logits.double() / temperature, dim=0)
    target = torch.zeros(vocab, dtype=torch.float64)
    target[list(kept)] = p[list(kept)] / p[list(kept)].sum()
    out = torch.empty(draws, dtype=torch.int64)
    gen = torch.Generator().manual_seed(123)
    draw_reference(
        logits.expand(draws, vocab).contiguous(), batch_of(draws, temperature, top_k, top_p, min_p), out, gen
    )
    freq = torch.bincount(out, minlength=vocab).double() / draws
    for t in range(vocab):
        if t not in kept:
            assert freq[t] == 0, f"token {t} was filtered out but sampled"
        else:
            stderr = math.sqrt(target[t] * (1 - target[t]) / draws)
            assert abs(freq[t] - target[t]) <= 5 * stderr + 1e-12, (t, freq[t].item(), target[t].item())


def test_greedy_rows_mixed_with_sampled_rows():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    batch = batch_of(6, temperature=1.0)
    batch.temperatures = torch.tensor([0.0, 1.0, 0.0, 2.0, 0.0, 1.0])
    out = torch.empty(6, dtype=torch.int64)
    draw_reference(logits, batch, out, torch.Generator().manual_seed(0))
    argmax = logits.argmax(-1)
    assert out[0] == argmax[0] and out[2] == argmax[2] and out[4] == argmax[4]


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    gen = torch.Generator().manual_seed(3)
    row = torch.randn(1, 300, generator=gen)
    others = torch.randn(7, 300, generator=gen)
    seed = step_seed(42, 5)
    alone = torch.empty(1, dtype=torch.int64)
    draw_reference(row.clone(), batch_of(1, seeds=[seed]), alone, torch.Generator().manual_seed(0))
    mixed_logits = torch.cat([others[:3], row, others[3:]])
    mixed = torch.empty(8, dtype=torch.int64)
    draw_reference(
        mixed_logits,
        batch_of(8, seeds=[None, 9, None, seed, None, None, 1, None]),
        mixed,
        torch.Generator().manual_seed(99),
    )
    assert mixed[3] == alone[0]
    draws = set()
    for s in range(20):
        out = torch.empty(1, dtype=torch.int64)
        draw_reference(row.clone(), batch_of(1, seeds=[step_seed(s, 0)]), out)
        draws.add(out.item())
    assert len(draws) > 3, "different seeds should give different draws"


def test_penalties_follow_their_definitions():
    gen = torch.Generator().manual_seed(5)
    vocab = 40
    logits = torch.randn(3, vocab, generator=gen) * 2
    prompt = [torch.tensor([1, 2, 3, 3]), torch.tensor([5]), torch.tensor([7, 8])]
    output = [torch.tensor([3, 4, 4, 4, 9]), torch.tensor([5, 6, 6]), torch.tensor([], dtype=torch.int64)]
    rep, pres, freq = [1.3, 1.0, 0.7], [0.5, -0.4, 1.0], [0.25, 1.5, 2.0]
    expected = logits.double().clone()
    for r in range(3):
        counts = {t: output[r].tolist().count(t) for t in set(output[r].tolist())}
        seen = set(prompt[r].tolist()) | set(counts)
        for t in range(vocab):
            x = expected[r, t].item()
            if t in seen:
                x = x / rep[r] if x > 0 else x * rep[r]
            if t in counts:
                x -= freq[r] * counts[t] + pres[r]
            expected[r, t] = x
    got = apply_penalties(logits.clone(), [0, 1, 2], prompt, output, rep, pres, freq)
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6)
    untouched = apply_penalties(logits.clone(), [1], [prompt[1]], [output[1]], [1.0], [0.0], [0.0])
    assert torch.equal(untouched, logits), "neutral penalties must not change the logits"
    blocked = block_tokens(logits.clone(), [0, 2], [[1, 2], [5]])
    assert blocked[0, 1] == blocked[0, 2] == blocked[2, 5] == float("-inf")
    assert torch.equal(blocked[1], logits[1])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("sampling"))
    return folder, make_checkpoint(folder, tied=False, seed=11)


def test_seed_reproduces_across_batch_compositions(checkpoint):
    folder, _ = checkpoint
    rng = random.Random(4)
    prompt = [rng.randrange(380) for _ in range(12)]
    others = [[rng.randrange(380) for _ in range(rng.randint(3, 30))] for _ in range(5)]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=2024, max_tokens=24, ignore_eos=True)
    noisy = SamplingParams(temperature=1.2, max_tokens=24, ignore_eos=True)
    alone = LLM(folder, dtype="float32", device="cpu", num_pages=128, seed=1).generate([prompt], seeded, use_tqdm=False)
    crowd = LLM(folder, dtype="float32", device="cpu", num_pages=128, seed=2, max_num_batched_tokens=20).generate(
        others[:3] + [prompt] + others[3:], [noisy] * 3 + [seeded] + [noisy] * 2, use_tqdm=False
    )
    assert crowd[3].token_ids == alone[0].token_ids
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=2025, max_tokens=24, ignore_eos=True)
    again = LLM(folder, dtype="float32", device="cpu", num_pages=128).generate([prompt], other_seed, use_tqdm=False)
    assert again[0].token_ids != alone[0].token_ids


def test_logprobs_are_the_log_softmax_of_the_reference_logits(checkpoint):
    folder, hf_model = checkpoint
    prompt = list(range(10, 30))
    llm = LLM(folder, dtype="float32", device="cpu", num_pages=64)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True, logprobs=5, repetition_penalty=1.2)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    reference = torch.log_softmax(hf_logits(hf_model, prompt, out.token_ids).double(), dim=-1)
    assert len(out.logprobs) == len(out.token_ids) == 10
    for step, entry in enumerate(out.logprobs):
        assert entry.token == out.token_ids[step]
        assert entry.logprob == pytest.approx(reference[step, entry.token].item(), abs=1e-4)
        top_ref = reference[step].topk(5)
        assert [t for t, _ in entry.top] == top_ref.indices.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(top_ref.values.tolist(), abs=1e-4)


def test_min_tokens_blocks_stop_tokens(checkpoint):
    folder, _ = checkpoint
    llm = LLM(folder, dtype="float32", device="cpu", num_pages=64)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    greedy = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    stop_id = greedy.token_ids[1]
    stopped = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id]), use_tqdm=False
    )[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_id
    assert stopped.token_ids == greedy.token_ids[: greedy.token_ids.index(stop_id) + 1]
    held = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id], min_tokens=6), use_tqdm=False
    )[0]
    assert len(held.token_ids) > 6 or held.finish_reason == "length"
    assert stop_id not in held.token_ids[:6]


def test_gpu_sampler_prepare_packs_what_the_kernel_expects(monkeypatch):
    """GpuSampler.prepare caches each request's packed row and patches only the per-step words (step, counts slot,
    number of bans): the rows it uploads must equal pack_sampler_rows of the full per-row parameters, and padding
    rows must be neutral greedy rows. Checked on the CPU (the buffers are plain tensors there)."""
    import fastqwen.engine.sampler as sampler_module
    from fastqwen.engine.sampler import GpuSampler
    from fastqwen.ops.sampling import pack_sampler_rows
    from fastqwen.sampling_params import SamplingParams
    from fastqwen.scheduler import Request

    monkeypatch.setattr(sampler_module, "sampler_workspace", lambda rows, vocab, device: torch.empty(1))
    monkeypatch.setattr(sampler_module, "penalty_row", lambda prompt, output, vocab, device: torch.zeros(vocab))
    eos = [7, 8]
    sampler = GpuSampler(vocab=50, max_rows=16, device=torch.device("cpu"), eos_token_ids=eos, seed=3)
    rng = random.Random(0)
    requests = []
    for i in range(6):
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.7, 1.3]),
            top_k=rng.choice([0, 5]),
            top_p=rng.choice([1.0, 0.8]),
            min_p=rng.choice([0.0, 0.1]),
            seed=rng.choice([None, 11 + i]),
            repetition_penalty=rng.choice([1.0, 1.2]),
            presence_penalty=rng.choice([0.0, 0.5]),
            min_tokens=rng.choice([0, 3]),
            ignore_eos=rng.random() < 0.5,
            stop_token_ids=rng.choice([[], [9]]),
            logprobs=rng.choice([None, 0, 2]),
            max_tokens=20,
        )
        request = Request(rid=i, prompt_ids=[1, 2, 3], params=params, arrival=i)
        request.token_ids += [4] * rng.randint(0, 5)
        requests.append(request)
    for step in range(2):
        sampler.prepare(requests, pad_to=8)
        slots = [r.sampler.slot if r.params.has_penalties else -1 for r in requests]
        bans = [
            len(r.params.stop_token_ids) + (0 if r.params.ignore_eos else len(eos))
            if r.num_output_tokens < r.params.min_tokens
            else 0
            for r in requests
        ]
        want = pack_sampler_rows(
            [r.params.temperature for r in requests],
            [r.params.top_k for r in requests],
            [r.params.top_p for r in requests],
            [r.params.min_p for r in requests],
            seed=[sampler._seed(r) for r in requests],
            step=[r.num_output_tokens for r in requests],
            slot=slots,
            repetition=[r.params.repetition_penalty for r in requests],
            presence=[r.params.presence_penalty for r in requests],
            frequency=[r.params.frequency_penalty for r in requests],
            num_blocked=bans,
            top_n=[-1 if r.params.logprobs is None else r.params.logprobs for r in requests],
        )
        assert torch.equal(sampler.rows[:6], want)
        assert torch.equal(sampler.rows[6:8], pack_sampler_rows([0.0, 0.0]))
        for r in requests:  # the next step: one more output token each
            r.token_ids.append(5)


def test_packed_rows_round_trip_through_the_exported_layout():
    """pack_sampler_rows writes each field where csrc/sampling.h puts it (offsets read from fastqwen._C), and
    unpacking gives the values back; top_k past int32 is stored as off."""
    from fastqwen.ops._native import native

    layout = sampler_row_layout()
    m = native()
    assert layout.words == m.SAMPLER_ROW_WORDS and layout.fields == dict(m.SAMPLER_ROW_FIELDS)
    assert len({offset for offset, _ in layout.fields.values()}) == len(layout.fields) <= layout.words
    rows = pack_sampler_rows(
        [0.5, 0.0],
        [7, 2**40],
        [0.9, 1.0],
        [0.0, 0.25],
        seed=[2**64 - 3, 5],
        step=[2**33, 0],
        slot=[3, -1],
        repetition=[1.5, 1.0],
        presence=[0.25, -1.0],
        frequency=[0.0, 2.0],
        num_blocked=[0, 4],
        top_n=[-1, 20],
    )
    assert rows.shape == (2, layout.words) and rows.dtype == torch.int32
    f = unpack_sampler_rows(rows)
    assert f["temperature"].tolist() == [0.5, 0.0] and f["top_k"].tolist() == [7, 0]
    assert f["seed"].tolist() == [2**64 - 3, 5] and f["step"].tolist() == [2**33, 0]
    assert f["slot"].tolist() == [3, -1] and f["num_blocked"].tolist() == [0, 4] and f["top_n"].tolist() == [-1, 20]
    assert f["repetition"].tolist() == [1.5, 1.0] and f["presence"].tolist() == [0.25, -1.0]
    assert f["min_p"].tolist() == [0.0, 0.25] and f["frequency"].tolist() == [0.0, 2.0]
    with pytest.raises(ValueError):
        pack_sampler_rows([1.0], top_n=layout.max_top_n + 1)


def test_dtype_codes_come_from_the_extension():
    from fastqwen.ops._native import dtype_code, native

    m = native()
    assert dtype_code(torch.float32) == m.DTYPE_F32 and dtype_code(torch.bfloat16) == m.DTYPE_BF16
    assert dtype_code(torch.float16) == m.DTYPE_F16 and dtype_code(torch.float64) is None
    assert set(m.KERNEL_DTYPES["sample"]) <= set(m.DTYPE_CODES.values())


def test_sample_op_falls_back_to_the_reference_of_the_kernel_contract():
    """ops.sample on CPU tensors runs sample_reference over the packed rows, counts table and bans: greedy rows equal
    the independent references (penalties from token lists, then bans, then argmax), logprobs are those of the raw
    logits, and each drawn token of a row with a slot is counted in its table row."""
    from fastqwen import ops

    gen = torch.Generator().manual_seed(8)
    rows_n, vocab = 4, 60
    logits = torch.randn(rows_n, vocab, generator=gen) * 2
    prompts = [[1, 2, 3], [4], [5, 5, 6], [7]]
    outputs = [[3, 3, 9], [10, 11], [], [12]]
    counts = torch.zeros(6, vocab, dtype=torch.int32)
    slots = [4, -1, 0, 2]
    for r, slot in enumerate(slots):
        if slot >= 0:
            counts[slot] = penalty_row(prompts[r], outputs[r], vocab, torch.device("cpu"))
    rep, pres, freq = [1.4, 1.0, 0.8, 1.0], [0.3, 0.0, 0.0, 1.0], [0.2, 0.0, 0.5, 0.0]
    top = logits.topk(3, dim=-1).indices.tolist()
    blocked = torch.full((rows_n, 3), -1, dtype=torch.int32)
    blocked[1, :2] = torch.tensor(top[1][:2])
    blocked[3, 0] = top[3][0]
    rows = pack_sampler_rows(
        [0.0] * rows_n,
        slot=slots,
        repetition=rep,
        presence=pres,
        frequency=freq,
        num_blocked=[0, 2, 0, 1],
        top_n=[3, -1, 0, 2],
    )
    tokens = torch.full((rows_n,), -1, dtype=torch.int64)
    logprobs = torch.full((rows_n,), float("nan"))
    top_ids = torch.full((rows_n, 3), -1, dtype=torch.int64)
    top_lps = torch.full((rows_n, 3), float("nan"))
    before = counts.clone()
    ops.sample(logits, rows, tokens, None, logprobs, top_ids, top_lps, counts=counts, blocked=blocked)
    want = logits.clone()
    pen = [r for r in range(rows_n) if slots[r] >= 0]
    apply_penalties(
        want,
        pen,
        [torch.tensor(prompts[r]) for r in pen],
        [torch.tensor(outputs[r], dtype=torch.int64) for r in pen],
        [rep[r] for r in pen],
        [pres[r] for r in pen],
        [freq[r] for r in pen],
    )
    block_tokens(want, [1, 3], [top[1][:2], top[3][:1]])
    assert tokens.tolist() == want.argmax(dim=-1).tolist()
    chosen, ids, lps = compute_logprobs(logits, tokens, 3)
    for r, n in enumerate([3, -1, 0, 2]):
        if n < 0:
            assert logprobs[r].isnan() and (top_ids[r] == -1).all()
            continue
        assert logprobs[r].item() == pytest.approx(chosen[r].item())
        assert top_ids[r, :n].tolist() == ids[r, :n].tolist() and (top_ids[r, n:] == -1).all()
    expect = before.clone()
    for r, slot in enumerate(slots):
        if slot >= 0:
            expect[slot, tokens[r]] += 1
    assert torch.equal(counts, expect)
    # Sampled rows: each draw inside its reference kept set, and the same (seed, step) gives the same token.
    n = 64
    many = logits[0].expand(n, vocab).contiguous()
    sampled_rows = pack_sampler_rows([0.9] * n, 5, 0.8, seed=3, step=list(range(n)))
    first, second = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
    sample_reference(many, sampled_rows, first)
    sample_reference(many, sampled_rows, second)
    assert torch.equal(first, second) and len(set(first.tolist())) > 1
    mask = top_k_top_p_min_p_mask(
        torch.softmax(many[:1] / 0.9, -1), torch.tensor([5]), torch.tensor([0.8]), torch.tensor([0.0])
    )[0]
    assert mask[first].all()


def test_top_k_past_the_vocabulary_is_off_in_the_engine(checkpoint):
    """top_k at or past the vocabulary, up to the largest int64, keeps every token: seeded draws equal top_k off.
    Past int64 it is refused (a 400 over HTTP), never an overflow inside the engine."""
    folder, _ = checkpoint
    llm = LLM(folder, dtype="float32", device="cpu", num_pages=64)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]

    def run_with(top_k):
        params = SamplingParams(temperature=1.0, top_k=top_k, seed=17, max_tokens=10, ignore_eos=True)
        return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    off = run_with(0)
    for k in (llm.engine.config.vocab_size, 2**31, 2**40, 2**63 - 1):
        assert run_with(k) == off, k
    with pytest.raises(InvalidRequestError):
        SamplingParams(top_k=2**70)


def test_gpu_sampler_bans_wider_than_the_graphs_run_eagerly(monkeypatch):
    """Frozen for graphs, the GPU sampler takes bans of any length on an eager step (a ban buffer of its own; the
    captured one untouched), says such a step does not fit a graph, and refuses them only for a graph step."""
    import fastqwen.engine.sampler as sampler_module
    from fastqwen.engine.sampler import GRAPH_BAN_WIDTH, GpuSampler
    from fastqwen.scheduler import Request

    monkeypatch.setattr(sampler_module, "sampler_workspace", lambda rows, vocab, device: torch.empty(1))
    sampler = GpuSampler(vocab=500, max_rows=8, device=torch.device("cpu"), eos_token_ids=[7], seed=1)
    sampler.freeze()
    captured = sampler.blocked
    stops = list(range(100, 100 + 4 * GRAPH_BAN_WIDTH))
    from fastqwen.config import GenerationDefaults

    resolved = GenerationDefaults()
    wide_params = SamplingParams(temperature=0.0, max_tokens=9, min_tokens=3, stop_token_ids=stops)
    wide = Request(rid=0, prompt_ids=[1, 2], params=wide_params.with_defaults(resolved), arrival=0)
    plain_params = SamplingParams(temperature=0.0, max_tokens=9).with_defaults(resolved)
    plain = Request(rid=1, prompt_ids=[3], params=plain_params, arrival=1)
    assert not sampler.fits_graph([plain, wide]) and sampler.fits_graph([plain])
    sampler.prepare([plain, wide])
    assert sampler.blocked is captured and (captured == -1).all()
    used = sampler._launch_blocked
    assert used.shape[1] >= len(stops) + 1 and used[1, : len(stops) + 1].tolist() == stops + [7]
    assert sampler.rows[1, sampler_row_layout().word("num_blocked")].item() == len(stops) + 1
    with pytest.raises(RuntimeError):
        sampler.prepare([plain, wide], pad_to=2)
    wide.token_ids += [11, 12, 13]  # min_tokens are out: no bans, the graphs fit again
    assert sampler.fits_graph([plain, wide])
    sampler.prepare([plain, wide], pad_to=2)
    assert sampler._launch_blocked is captured
