"""A slow grammar mask delays its own request, not the batch (issue 40, item 7).

Masks are computed on worker threads after each committed token (grammar.GrammarMatcher); a request whose mask is not
ready sits the step out. Here one request's mask computation blocks on an event: the unconstrained request in the same
engine must finish all its tokens meanwhile, and the constrained one then completes, matching its regex. The masks a
matcher computes ahead are checked, state by state, against llguidance's executor computing them on the spot.
"""

from __future__ import annotations

import os
import re
import threading

import numpy as np
import pytest
from cpu_graphs import graph_llm, plain_llm
from fastqwen import LLM, SamplingParams
from fastqwen.grammar import GrammarCompiler, GrammarMatcher, fill_bitmasks
from fastqwen.sampling_params import StructuredOutput
from test_structured_output import EOS, REGEX, VOCAB, _write_checkpoint

STALL_AT = 2  # the constrained request's mask after this many tokens blocks until the test releases it
BYSTANDER_TOKENS = 16


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("masks_off_step"))
    _write_checkpoint(path)
    return path


@pytest.mark.parametrize("path", ["eager", "graphs", "graphs-serial"])
def test_a_slow_mask_holds_only_its_own_request(folder, monkeypatch, path):
    """Eager, and on the GPU's path (cpu_graphs): with overlap, a step launched ahead drops the row from its deferred
    sampler; without ("graphs-serial"), a step whose mask is not ready at launch runs its forward graph and then the
    eager sampler, which drops the row."""
    kwargs = dict(num_pages=128, page_size=8, max_num_seqs=8)
    if path.startswith("graphs"):
        llm = graph_llm(monkeypatch, folder, disable_overlap_schedule=path == "graphs-serial", **kwargs)
    else:
        llm = LLM(folder, dtype="float32", device="cpu", **kwargs)
    release, stalled = threading.Event(), threading.Event()
    compute = GrammarMatcher._compute_mask

    def slow_mask(self, version):
        if version == STALL_AT:
            stalled.set()
            # (A safety net, not a sleep: the test sets it. With the mask computed inside the step, the step blocks
            # here until the timeout, and the request then fails.)
            assert release.wait(timeout=20), "the mask was waited for inside the step"
        compute(self, version)

    monkeypatch.setattr(GrammarMatcher, "_compute_mask", slow_mask)
    constrained = llm.add_request(
        "a", SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured=StructuredOutput("regex", REGEX))
    )
    bystander = llm.add_request(
        "b", SamplingParams(temperature=1.0, seed=4, max_tokens=BYSTANDER_TOKENS, ignore_eos=True)
    )
    tokens = {constrained: [], bystander: []}
    outputs = {}

    def step():
        for update in llm.step():
            tokens[update.request_id] += update.new_token_ids
            if update.finished:
                outputs[update.request_id] = update.output

    for _ in range(4 * BYSTANDER_TOKENS):
        if bystander in outputs:
            break
        step()
    assert stalled.is_set(), "the constrained request never reached the slow mask"
    assert bystander in outputs and len(tokens[bystander]) == BYSTANDER_TOKENS
    assert len(tokens[constrained]) == STALL_AT and constrained not in outputs  # it waited, holding its place
    release.set()
    for _ in range(200):
        if not llm.has_unfinished():
            break
        step()
    output = outputs[constrained]
    assert output.finish_reason == "stop", (output.text, output.finish_reason)
    assert re.fullmatch(REGEX, output.text), output.text
    assert llm.engine.kv_usage() == 0.0


def test_masks_computed_ahead_match_the_executor(folder):
    compiler = GrammarCompiler(os.path.join(folder, "tokenizer.json"), VOCAB, [EOS])
    try:
        compiled = compiler.submit(StructuredOutput("regex", REGEX))
        ahead, reference = compiler.matcher(compiled, ahead=True), compiler.matcher(compiled)
        rng = np.random.default_rng(0)
        words = compiler.mask_words
        for _ in range(12):
            mine, theirs = np.zeros(words, np.int32), np.zeros((1, words), np.int32)
            ahead.copy_mask(mine)
            fill_bitmasks([(reference, 0)], theirs)
            assert np.array_equal(mine, theirs[0])
            allowed = [t for t in range(VOCAB) if theirs[0, t // 32] >> (t % 32) & 1]
            token = int(rng.choice(allowed))
            assert ahead.advance(token) == reference.advance(token)
            if reference.matcher.is_stopped():
                break
        assert ahead.version == reference.version
    finally:
        compiler.close()


def test_rows_skipped_in_a_deferred_step_are_neutral(monkeypatch):
    """A step launched ahead drops the rows whose mask is not ready (llm_engine.rows_without_masks): GpuSampler.prepare
    packs them as neutral greedy rows (no mask, no counts slot, no bans), never reads their grammar, and leaves the
    other rows as a step without skips packs them. Checked on the CPU (the buffers are plain tensors there)."""
    import fastqwen.engine.sampler as sampler_module
    import torch
    from fastqwen.config import GenerationDefaults
    from fastqwen.engine.sampler import GpuSampler
    from fastqwen.ops.sampling import sampler_row_layout
    from fastqwen.scheduler import Request

    monkeypatch.setattr(sampler_module, "sampler_workspace", lambda rows, vocab, device: torch.empty(1))
    monkeypatch.setattr(sampler_module, "penalty_row", lambda prompt, output, vocab, device: torch.zeros(vocab))

    class Grammar:
        def __init__(self, word: int):
            self.word, self.ready, self.error = word, word != 0, None

        def copy_mask(self, out):
            assert self.ready, "a skipped row's mask was read"
            out[:] = self.word

    defaults = GenerationDefaults()
    params = [
        SamplingParams(temperature=0.7, max_tokens=9, repetition_penalty=1.2, min_tokens=2, stop_token_ids=[9]),
        SamplingParams(temperature=0.7, max_tokens=9),
        SamplingParams(temperature=0.0, max_tokens=9),
    ]
    requests = [
        Request(rid=i, prompt_ids=[1, 2], params=p.with_defaults(defaults), arrival=i) for i, p in enumerate(params)
    ]
    requests[0].grammar, requests[1].grammar = Grammar(0), Grammar(5)  # row 0's mask is not ready: skipped
    sampler = GpuSampler(vocab=64, max_rows=4, device=torch.device("cpu"), eos_token_ids=[7], seed=3)
    sampler.prepare(requests, skip=frozenset({0}))
    rows, layout = sampler.rows_host.numpy(), sampler_row_layout()
    assert (rows[0] == sampler._neutral_row).all() and requests[0].sampler.slot is None
    assert rows[1, layout.word("masked")] == 1 and (sampler.mask_host.numpy()[1] == 5).all()
    unskipped = rows[1:3].copy()
    requests[0].grammar.ready = True
    sampler.prepare(requests)
    assert (sampler.rows_host.numpy()[1:3] == unskipped).all()  # the other rows as without the skip
    again = sampler.rows_host.numpy()
    assert (
        again[0, layout.word("masked")] == 1 and again[0, layout.word("num_blocked")] == 2
    )  # row 0 as it is unskipped


def _run(llm, prompts, params) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("overlap", [True, False])
def test_graph_decode_steps_sample_in_their_graph(folder, monkeypatch, overlap):
    """On the GPU's path (cpu_graphs), no grammar: a decode step replays the forward graph, then the sampler's graph,
    and reads back the tokens that one drew; seeded, penalised and greedy rows get the tokens of the engine without
    graphs (the same sampler). Fails when a graph step replays its forward only: the read-back takes the tokens of
    the step before."""
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 else 0.9,
            seed=10 + i,
            max_tokens=10,
            ignore_eos=True,
            repetition_penalty=1.3 if i == 2 else 1.0,
        )
        for i in range(3)
    ]
    prompts = ["ab", "cde", "f"]
    llm = graph_llm(
        monkeypatch, folder, num_pages=64, page_size=8, max_num_seqs=4, disable_overlap_schedule=not overlap
    )
    got = _run(llm, prompts, params)
    assert got == _run(plain_llm(monkeypatch, folder, num_pages=64, page_size=8, max_num_seqs=4), prompts, params)
    assert len(llm.engine.runner.graphs.forwards) >= 8  # the decode steps replayed graphs
    assert (llm.engine.num_ahead_steps > 0) == overlap


def test_graph_path_with_grammars(folder, monkeypatch):
    """On the GPU's path (cpu_graphs) with overlap: steps holding grammar rows launch their forward ahead and sample
    once the step before is recorded (sample_deferred), or replay the graph with the sampler; every constrained
    output matches its regex, and every token equals the engine's without graphs."""
    params = [
        SamplingParams(
            temperature=1.0,
            seed=20 + i,
            max_tokens=40,
            structured=StructuredOutput("regex", REGEX) if i % 2 == 0 else None,
        )
        for i in range(4)
    ]
    prompts = ["a", "b", "c", "d"]
    llm = graph_llm(monkeypatch, folder, num_pages=64, page_size=8, max_num_seqs=4)
    runner = llm.engine.runner
    deferred = []
    sample_deferred = runner.sample_deferred
    runner.sample_deferred = lambda pending, skip=frozenset(): deferred.append(skip) or sample_deferred(pending, skip)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i in (0, 2):
        assert outs[i].finish_reason == "stop" and re.fullmatch(REGEX, outs[i].text), (outs[i].text, outs[i].error)
    want = _run(plain_llm(monkeypatch, folder, num_pages=64, page_size=8, max_num_seqs=4), prompts, params)
    assert [o.token_ids for o in outs] == want
    assert deferred and runner.graphs.forwards  # both graph paths were taken


def test_a_dropped_engine_goes_without_the_garbage_collector(folder):
    """The engine and its model runner hold no reference cycle (the runner's mask gate is not a bound method of the
    engine): a dropped engine, with its CUDA graphs and events, is freed at once. Otherwise the collector frees it
    later, maybe in the middle of another engine's graph capture, whose CUDA calls then invalidate the capture (seen
    on the GPU: cuBLAS failing "due to a previous error during capture")."""
    import gc
    import weakref

    llm = LLM(folder, dtype="float32", device="cpu", num_pages=32, page_size=8)
    llm.generate(["a"], SamplingParams(max_tokens=3, structured=StructuredOutput("regex", REGEX)), use_tqdm=False)
    engine = weakref.ref(llm.engine)
    gc.collect()
    gc.disable()
    try:
        del llm
        assert engine() is None
    finally:
        gc.enable()
