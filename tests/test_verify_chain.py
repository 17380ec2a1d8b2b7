"""Verify steps chained on the device (engine/verify_chain.py, ops/verify_chain.py, csrc/verify_chain.cu): the next
verify step's inputs made from the draws of the one before, with the host a step behind.

The op against what the host computes for the same step (Speculator.accepted's rule and arithmetic, NgramIndex's
drafts through NgramDrafter, positions and KV slots from the page table written out here); on a GPU the kernel against
the op's CPU reference. The engine on the CPU with cpu_graphs' stand-in graphs and the reference op: greedy outputs
equal decoding without speculation, the same acceptance as the host's own drafts (so the same drafts), seeded
sampling equal to the engine without chaining (the sampler rows' steps advanced on the device), requests stopped,
aborted or at max_tokens while a chained step is in flight, and the KV invariants with every page back at the end.
"""

from __future__ import annotations

import dataclasses
import random

import fastqwen.engine.model_runner as model_runner_module
import pytest
import torch
from checkpoints import make_checkpoint
from cpu_graphs import graph_llm
from fastqwen import LLM, SamplingParams
from fastqwen.ops.verify_chain import ChainInputs, verify_chain, verify_chain_kernel_applies
from fastqwen.speculative.config import SpeculativeConfig
from fastqwen.speculative.ngram import NgramDrafter
from fastqwen.speculative.speculator import Speculator, _RequestState

K = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("chain"))
    # A sharp model (logit_scale): greedy outputs repeat themselves, so prompt lookup finds matches.
    make_checkpoint(path, tied=False, seed=5, logit_scale=4.0, max_positions=1024)
    return path


def prompts(n: int, length: int = 24, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(length)] for _ in range(n)]


def outputs(llm: LLM, prompt_list, params) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompt_list, params, use_tqdm=False)]


def chain_llm(monkeypatch, path: str, spec: dict, chained: bool = True, **kwargs) -> LLM:
    """The graph path on the CPU (stand-in graphs, the CUDA sampler's engine side) with chaining allowed (the op's
    reference standing in for the kernel) or switched off (FASTQWEN_VERIFY_CHAIN=0)."""
    monkeypatch.setattr(model_runner_module, "verify_chain_kernel_applies", lambda device: True)
    monkeypatch.setenv("FASTQWEN_VERIFY_CHAIN", "1" if chained else "0")
    kwargs.setdefault("page_size", 4)
    kwargs.setdefault("num_pages", 512)
    llm = graph_llm(monkeypatch, path, speculative_config=spec, **kwargs)
    assert (llm.engine.runner.chain is not None) == chained
    return llm


# ---- the op -----------------------------------------------------------------------------------------------------


def chain_case(device, batch: int, q: int, synthetic: float | None, seed: int):
    """Random buffers of a verify step just run for `batch` sequences, and what the host would make of them: per
    sequence (accepted, the emitted tokens, the next ids, positions, slots, kv_len, row steps, credit after)."""
    rng = random.Random(seed)
    k, page_size, width, stride, words = q - 1, 4, 24, 96, 8
    step_words = (2, 5)
    tokens = torch.zeros(batch * q + 3, dtype=torch.int64)
    input_ids = torch.zeros(batch * q + 3, dtype=torch.int64)
    positions = torch.zeros(batch * q + 3, dtype=torch.int64)
    page_table = torch.zeros(batch + 1, width, dtype=torch.int32)
    rows = torch.randint(-(2**31), 2**31 - 1, (batch * q + 2, words), dtype=torch.int32)
    history = torch.zeros(batch + 1, stride, dtype=torch.int32)
    lens = torch.zeros(batch + 1, dtype=torch.int32)
    credit = torch.zeros(batch + 1, dtype=torch.float64)
    expected = []
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=k, synthetic_acceptance_length=synthetic)
    for b in range(batch):
        length = rng.randrange(2, stride - 2 * q)
        # Few distinct tokens: tails recur and drafts are found; some rows with none.
        vocab = 3 if b % 3 else 50
        seq = [rng.randrange(vocab) for _ in range(length)]
        history[b, :length] = torch.tensor(seq, dtype=torch.int32)
        lens[b] = length
        start = length - 1 + rng.randrange(0, 3)  # (positions need not equal the history's length)
        draft = [rng.randrange(vocab) for _ in range(k)]
        draws = [rng.randrange(vocab) for _ in range(q)]
        agree = rng.randrange(0, q)
        draws[:agree] = draft[:agree]  # the target agrees with the first `agree` draft tokens, maybe more by chance
        lo = b * q
        input_ids[lo : lo + q] = torch.tensor([seq[-1], *draft])
        tokens[lo : lo + q] = torch.tensor(draws)
        positions[lo : lo + q] = torch.arange(start, start + q)
        page_table[b] = torch.tensor(rng.sample(range(1000), width), dtype=torch.int32)
        c = rng.choice([0.0, 0.25, 0.5, 0.75])
        credit[b] = c
        if b % 4 == 3:  # a step past 2**32: the high word carries
            rows[lo : lo + q, step_words[0]] = -1
        steps = [
            (int(rows[lo + i, step_words[0]]) & 0xFFFFFFFF) | ((int(rows[lo + i, step_words[1]]) & 0xFFFFFFFF) << 32)
            for i in range(q)
        ]
        # What the host does: Speculator.accepted, then NgramDrafter's draft of the tokens with the emitted ones.
        spec = Speculator(config)
        request = type("R", (), {"rid": b})()
        if synthetic is not None:
            spec._states[b] = _RequestState(synthetic_credit=c)
        n = spec.accepted(request, tuple(draft), draws)
        emitted = [*draft[:n], draws[n]]
        full = seq + emitted
        proposal, _ = NgramDrafter(k, config.prompt_lookup_min, config.prompt_lookup_max).propose(b, full, 1, k)
        ids = [full[-1], *proposal, *[full[-1]] * (k - len(proposal))]
        new_start = start + n + 1
        pos = list(range(new_start, new_start + q))
        slots = [int(page_table[b, p // page_size]) * page_size + p % page_size for p in pos]
        credit_after = spec._states[b].synthetic_credit if synthetic is not None else c
        expected.append((n, full, ids, pos, slots, new_start + q, [s + n + 1 for s in steps], credit_after))
    x = ChainInputs(
        tokens=tokens.to(device),
        input_ids=input_ids.to(device),
        positions=positions.to(device),
        out_slots=torch.full_like(positions, -7).to(device),
        kv_lens=torch.zeros(batch + 1, dtype=torch.int32).to(device),
        page_table=page_table.to(device),
        rows=rows.to(device),
        history=history.to(device),
        lens=lens.to(device),
        credit=credit.to(device),
        report=torch.zeros(batch * (q + 1) + 4, dtype=torch.int32).to(device),
    )
    config_args = (batch, q, page_size, step_words, config.prompt_lookup_min, config.prompt_lookup_max, synthetic)
    return x, config_args, expected


def check_chain(x: ChainInputs, batch: int, q: int, step_words, expected) -> None:
    x = ChainInputs(**{name: t.cpu() for name, t in dataclasses.asdict(x).items()})
    for b, (n, full, ids, pos, slots, kv_len, steps, credit) in enumerate(expected):
        lo = b * q
        assert int(x.report[b]) == n, b
        assert int(x.lens[b]) == len(full) and x.history[b, : len(full)].tolist() == full, b
        assert x.input_ids[lo : lo + q].tolist() == ids and x.report[batch + lo : batch + lo + q].tolist() == ids, b
        assert x.positions[lo : lo + q].tolist() == pos and x.out_slots[lo : lo + q].tolist() == slots, b
        assert int(x.kv_lens[b]) == kv_len, b
        got = [
            (int(x.rows[lo + i, step_words[0]]) & 0xFFFFFFFF)
            | ((int(x.rows[lo + i, step_words[1]]) & 0xFFFFFFFF) << 32)
            for i in range(q)
        ]
        assert got == steps, b
        assert float(x.credit[b]) == credit, b
    # Rows past the batch are untouched.
    assert x.out_slots[batch * q :].tolist() == [-7] * (x.out_slots.numel() - batch * q)
    assert int(x.report[batch * (q + 1)]) == 0


@pytest.mark.parametrize("synthetic", [None, 2.0, 2.75])
@pytest.mark.parametrize("q", [2, 4])
def test_the_reference_makes_what_the_host_makes(q, synthetic):
    x, args, expected = chain_case(torch.device("cpu"), 7, q, synthetic, seed=q * 10 + int(2 * (synthetic or 0)))
    verify_chain(x, *args)
    check_chain(x, args[0], q, args[3], expected)


gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and verify_chain_kernel_applies(torch.device("cuda"))), reason="needs a CUDA GPU"
)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("synthetic", [None, 2.0, 2.75])
@pytest.mark.parametrize("q", [2, 4, 9])
def test_the_kernel_makes_what_the_host_makes(q, synthetic):
    x, args, expected = chain_case(torch.device("cuda"), 13, q, synthetic, seed=q * 10 + int(2 * (synthetic or 0)))
    verify_chain(x, *args)
    torch.cuda.synchronize()
    check_chain(x, args[0], q, args[3], expected)


def test_bad_buffers_are_refused():
    x, args, _ = chain_case(torch.device("cpu"), 2, 3, None, seed=1)
    with pytest.raises(ValueError, match="credit"):
        verify_chain(dataclasses.replace(x, credit=x.credit.float()), *args)
    with pytest.raises(ValueError, match="report"):
        verify_chain(dataclasses.replace(x, report=x.report[:5]), *args)


# ---- the engine -------------------------------------------------------------------------------------------------

SPEC = {"method": "ngram", "num_speculative_tokens": K, "min_acceptance_rate": 0.0}


def test_greedy_chained_steps_make_the_hosts_drafts(checkpoint, monkeypatch):
    """Greedy requests through chained verify steps: the tokens of decoding without speculation, and the acceptance
    counts of the same engine drafting on the host (the same drafts: any other draft changes how many are accepted,
    not the tokens). Most verify steps are chained; every page comes back."""
    batch = prompts(3, seed=31)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    reference = outputs(LLM(checkpoint, dtype="float32", device="cpu", page_size=4), batch, params)
    host = chain_llm(monkeypatch, checkpoint, SPEC, chained=False)
    assert outputs(host, batch, params) == reference
    llm = chain_llm(monkeypatch, checkpoint, SPEC)
    engine = llm.engine
    check = engine.check_invariants

    def checked_step():
        output = step()
        check()
        return output

    step, engine.step = engine.step, checked_step
    update, page_size, q = engine.scheduler.update, 4, K + 1

    def reserving_update(scheduled, sampled, ahead=False):
        # With a chained step in flight, each running request keeps the pages of its reservation, which covers
        # that step's longest reach (its last token's position + q).
        advanced = update(scheduled, sampled, ahead)
        if ahead:
            for r in engine.scheduler.running:
                assert r.reserved_len >= len(r.token_ids) - 1 + q, (r.reserved_len, len(r.token_ids))
                assert len(r.pages) * page_size >= r.reserved_len
        return advanced

    engine.scheduler.update = reserving_update
    assert outputs(llm, batch, params) == reference
    mine, theirs = engine.stats(), host.engine.stats()
    assert mine.spec_num_accepted_tokens == theirs.spec_num_accepted_tokens > 20
    assert mine.spec_num_drafts == theirs.spec_num_drafts
    assert engine.num_chained_steps >= 0.7 * mine.spec_num_drafts / len(batch), (engine.num_chained_steps, mine)
    allocator = engine.kv.allocator
    assert allocator.num_free() + engine.cache.evictable_pages() == allocator.num_total()


def test_seeded_sampling_is_the_same_when_chained(checkpoint, monkeypatch):
    """Seeded sampling draws each position with its request's seed and step: the chained rows' steps, advanced on the
    device, give the draws of the engine that prepares every row on the host."""
    batch = prompts(3, seed=32)
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, seed=200 + i, max_tokens=50, ignore_eos=True) for i in range(3)
    ]
    reference = outputs(chain_llm(monkeypatch, checkpoint, SPEC, chained=False), batch, params)
    llm = chain_llm(monkeypatch, checkpoint, SPEC)
    assert outputs(llm, batch, params) == reference
    assert llm.engine.num_chained_steps >= 10


def test_synthetic_acceptance_continues_on_the_device(checkpoint, monkeypatch):
    """A benchmark's forced acceptance (2.5: one or two draft tokens a step, by the credit's arithmetic) continues on
    the device from the host's credit: the tokens and counts of the engine without chaining."""
    spec = {"method": "ngram", "num_speculative_tokens": K, "synthetic_acceptance_length": 2.5}
    batch = prompts(2, seed=33)
    params = SamplingParams(temperature=0.0, max_tokens=70, ignore_eos=True)
    host = chain_llm(monkeypatch, checkpoint, spec, chained=False)
    reference = outputs(host, batch, params)
    llm = chain_llm(monkeypatch, checkpoint, spec)
    assert outputs(llm, batch, params) == reference
    mine, theirs = llm.engine.stats(), host.engine.stats()
    assert (mine.spec_num_drafts, mine.spec_num_accepted_tokens) == (
        theirs.spec_num_drafts,
        theirs.spec_num_accepted_tokens,
    )
    assert llm.engine.num_chained_steps >= 15


def test_stops_and_aborts_while_a_chained_step_is_in_flight(checkpoint, monkeypatch):
    """A stop id, max_tokens and a stop string (the LLM aborts the request) end requests while the step chained after
    theirs runs: their results from it are dropped, the others go on, the tokens and texts are those of decoding
    without speculation, and every page (reserved ones included) comes back."""
    batch = prompts(4, seed=34)
    long = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    base = LLM(checkpoint, dtype="float32", device="cpu", page_size=4)
    full = base.generate(batch, long, use_tqdm=False)
    first = full[0].token_ids
    stop = next(t for i, t in enumerate(first) if i >= 14 and t not in first[:i])
    params = [
        dataclasses.replace(long, stop_token_ids=[stop]),
        dataclasses.replace(long, max_tokens=29),
        dataclasses.replace(long, stop=[full[2].text[20:24]]),
        long,
    ]
    expected = base.generate(batch, params, use_tqdm=False)
    llm = chain_llm(monkeypatch, checkpoint, SPEC)
    engine = llm.engine
    abort, in_flight = engine.abort, []

    def recording_abort(rid):
        ahead = engine._ahead
        if ahead is not None and any(c.request.rid == rid for c in ahead[0].chunks):
            in_flight.append(ahead[1] is not None and engine.num_chained_steps > 0)
        return abort(rid)

    engine.abort = recording_abort
    got = llm.generate(batch, params, use_tqdm=False)
    for mine, theirs in zip(got, expected):
        assert mine.token_ids == theirs.token_ids and mine.finish_reason == theirs.finish_reason
    assert expected[2].finish_reason == "stop" and any(in_flight), in_flight
    assert engine.num_chained_steps >= 10
    engine.check_invariants()
    allocator = engine.kv.allocator
    assert allocator.num_free() + engine.cache.evictable_pages() == allocator.num_total()
    assert all(not r.reserved_len for r in engine.scheduler.running)


def test_a_chain_is_not_started_for_what_the_kernel_cannot_do(checkpoint, monkeypatch):
    """Rows the kernel does not make (penalties) and arrivals waiting to be admitted keep the host's launches: no
    chained step, the same tokens."""
    batch = prompts(2, seed=35)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3)
    reference = outputs(chain_llm(monkeypatch, checkpoint, SPEC, chained=False), batch, params)
    llm = chain_llm(monkeypatch, checkpoint, SPEC)
    assert outputs(llm, batch, params) == reference
    assert llm.engine.num_chained_steps == 0


@pytest.mark.gpu
@gpu
def test_chained_steps_on_the_gpu_draw_what_the_host_launches_draw(tmp_path, monkeypatch):
    """On the GPU (the kernel, the verify CUDA graphs, the CUDA sampler): greedy and seeded sampled requests through
    chained verify steps draw exactly the tokens of the same engine launching every verify step from the host (the
    same graphs on the same inputs), most verify steps are chained, and the KV invariants hold."""
    folder = str(tmp_path)
    make_checkpoint(folder, tied=False, num_heads=8, num_kv_heads=2, head_dim=128, hidden=256, intermediate=512,
                    layers=4, dtype=torch.bfloat16, logit_scale=8.0, seed=13)  # fmt: skip
    batch = prompts(5, length=30, seed=36)
    params = [SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)] * 3 + [
        SamplingParams(temperature=0.9, top_k=50, seed=300 + i, max_tokens=80, ignore_eos=True) for i in range(2)
    ]

    def run(chained: bool):
        monkeypatch.setenv("FASTQWEN_VERIFY_CHAIN", "1" if chained else "0")
        llm = LLM(folder, dtype="bfloat16", device="cuda", page_size=16, num_pages=1024, max_num_seqs=8,
                  cuda_graph_max_bs=8, speculative_config=SPEC)  # fmt: skip
        out = outputs(llm, batch, params)
        llm.engine.check_invariants()
        return llm.engine, out

    host, reference = run(False)
    engine, out = run(True)
    assert out == reference
    assert host.num_chained_steps == 0 and engine.runner.chain is not None
    assert engine.num_chained_steps >= 0.5 * engine.stats().spec_num_drafts / len(batch), engine.num_chained_steps


def test_chains_start_again_after_an_arrival(checkpoint, monkeypatch):
    """An arrival stops the chain (it waits for the chained step in flight, then is admitted); the next verify steps
    chain again, also where the host gate queued one meanwhile (a gated step is never chained behind: its gate may
    time out and the step run on padding). Requests arriving every sixth step: the tokens of the engine with neither,
    and a chain started again after most arrivals."""
    from test_speculative import arrivals_every

    batch = prompts(5, seed=37)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": K, "synthetic_acceptance_length": 2.0}
    reference = arrivals_every(chain_llm(monkeypatch, checkpoint, spec, chained=False), batch, params, 6)
    monkeypatch.setenv("FASTQWEN_VERIFY_CHAIN", "1")
    monkeypatch.setattr(model_runner_module, "verify_chain_kernel_applies", lambda device: True)
    llm = graph_llm(monkeypatch, checkpoint, host_gate=True, speculative_config=spec, page_size=4, num_pages=512)
    runner = llm.engine.runner
    assert runner.chain is not None and runner._gate is not None
    assert arrivals_every(llm, batch, params, 6) == reference
    assert runner.chain.num_starts >= len(batch), (runner.chain.num_starts, runner.num_gated_launches)
    assert llm.engine.num_chained_steps >= 20


def test_a_chain_follows_the_host_gate_again(checkpoint, monkeypatch):
    """Where a chain cannot start (here: its first pages refused, as in a shortage) the host gate queues the next verify
    step instead. A step is never chained behind a gated one (the gate may time out and run it on padding), so once a
    gated step's batch could chain, the next verify step is launched the ordinary way and the chain starts behind it,
    instead of gate after gate. The tokens of the engine with neither."""
    batch = prompts(3, seed=38)
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": K, "synthetic_acceptance_length": 2.0}
    reference = outputs(chain_llm(monkeypatch, checkpoint, spec, chained=False), batch, params)
    monkeypatch.setenv("FASTQWEN_VERIFY_CHAIN", "1")
    monkeypatch.setattr(model_runner_module, "verify_chain_kernel_applies", lambda device: True)
    llm = graph_llm(monkeypatch, checkpoint, host_gate=True, speculative_config=spec, page_size=4, num_pages=512)
    engine, runner = llm.engine, llm.engine.runner
    reserve, calls = engine.scheduler.reserve_ahead, [0]

    def refused_once(requests, num_tokens):
        calls[0] += 1
        return calls[0] != 1 and reserve(requests, num_tokens)

    engine.scheduler.reserve_ahead = refused_once
    launches = []  # (gated, the batch could chain) of each verify step the host launched
    launch_replay = runner.launch_replay

    def recording(scheduled):
        launched = launch_replay(scheduled)
        if launched is not None and scheduled.has_drafts:
            launches.append((bool(launched.gate), engine._chainable(scheduled)))
        return launched

    runner.launch_replay = recording
    assert outputs(llm, batch, params) == reference
    gated_chainable = [i for i, (gated, chainable) in enumerate(launches) if gated and chainable]
    assert gated_chainable, str(launches)  # (the case arises)
    assert all(i + 1 == len(launches) or not launches[i + 1][0] for i in gated_chainable), str(launches)
    assert runner.chain.num_starts == 1 and engine.num_chained_steps >= 20, (engine.num_chained_steps, launches)
