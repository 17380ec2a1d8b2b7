"""CUDA-graph decode against eager decode on the same engine settings: tokens, logits, padding, fallback, every
captured batch size up to 256, and the sizes up to 512 that the default batch limit takes when the pool holds them."""

from __future__ import annotations

import random

import pytest
import torch
from checkpoints import make_checkpoint, record_result
from fastqwen import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MAX_GRAPH_BS = 16
# Graph and eager run the same kernels; only cuBLAS may pick another algorithm for a padded M, which moves a logit
# by a few bf16 rounding steps. Stated tolerance: 1% of the largest |logit|.
TOLERANCE = 0.01


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("graph"))
    make_checkpoint(
        folder,
        tied=False,
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
        hidden=256,
        intermediate=512,
        layers=4,
        dtype=torch.bfloat16,
        logit_scale=8.0,
        seed=11,
    )
    return folder


def make_llm(folder: str, graphs: bool, overlap: bool = True) -> LLM:
    return LLM(
        folder,
        dtype="bfloat16",
        device="cuda",
        page_size=16,
        num_pages=512,
        max_num_seqs=32,
        disable_cuda_graph=not graphs,
        cuda_graph_max_bs=MAX_GRAPH_BS,
        disable_overlap_schedule=not overlap,
    )


def generate_recording(llm: LLM, prompts: list[list[int]], max_tokens: list[int]):
    """Greedy outputs, plus each request's logits row at each of its sampling steps and how each step ran:
    (sampling rows, graph size replayed or 0 for eager, whether the step was pure decode)."""
    runner = llm.engine.runner
    launch, run_model = runner.launch, runner.run_model
    current = {}
    rows_by_rid: dict[int, list[torch.Tensor]] = {}
    steps = []

    def recording_launch(scheduled, after=None):
        # Every row of a step launched ahead samples (the token after the one in flight).
        current["rids"] = [c.request.rid for c in scheduled.chunks if after is not None or c.samples]
        current["decode"] = scheduled.is_decode
        return launch(scheduled, after)

    def recording_run_model(batch, graph_size=0):
        logits = run_model(batch, graph_size)
        steps.append((len(current["rids"]), graph_size, current["decode"]))
        for rid, row in zip(current["rids"], logits.float().cpu()):
            rows_by_rid.setdefault(rid, []).append(row)
        return logits

    runner.launch, runner.run_model = recording_launch, recording_run_model
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del runner.launch, runner.run_model
    return outs, [torch.stack(rows_by_rid[o.request_id]) for o in outs], steps


def workload(num_seqs: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(0, 380) for _ in range(rng.randint(3, 200))] for _ in range(num_seqs)]
    max_tokens = [rng.randint(4, 24) for _ in range(num_seqs)]  # sequences finish at different steps
    return prompts, max_tokens


def compare(graph_run, eager_run) -> int:
    """Per request: logits within the tolerance at every step compared, and identical tokens up to the first step
    whose eager top-1 margin is at most twice that step's largest logit difference (only there can the argmaxes
    differ; when the two runs agree bit for bit, that never happens and every step is compared). Returns the number of steps compared and the largest logit difference seen, relative to the largest |logit|."""
    compared, worst = 0, 0.0
    for g_out, g_logits, e_out, e_logits in zip(graph_run[0], graph_run[1], eager_run[0], eager_run[1]):
        delta = TOLERANCE * e_logits.abs().max().item()
        top2 = e_logits.topk(2, dim=-1).values
        margins = (top2[:, 0] - top2[:, 1]).tolist()
        for k, (g_tok, e_tok) in enumerate(zip(g_out.token_ids, e_out.token_ids)):
            diff = (g_logits[k] - e_logits[k]).abs().max().item()
            worst = max(worst, diff / e_logits.abs().max().item())
            assert diff <= delta, f"request {g_out.request_id} step {k}: logits differ by {diff:.4f} > {delta:.4f}"
            if diff > 0 and margins[k] <= 2 * diff:
                break  # identical logits (diff 0) give identical argmaxes even at exact bf16 ties
            assert g_tok == e_tok, f"request {g_out.request_id} step {k}: margin {margins[k]:.3f}"
            compared += 1
        else:
            assert g_out.token_ids == e_out.token_ids
    return compared, worst


@pytest.mark.parametrize("num_seqs", [1, 3, 5, 17])
def test_graph_decode_matches_eager(folder, num_seqs):
    """Same greedy tokens and logits as eager decode for batches that are not captured sizes (3, 5: padded), and
    for one above the largest graph (17: eager until sequences finish, then padded graphs)."""
    prompts, max_tokens = workload(num_seqs, seed=num_seqs)
    graph_run = generate_recording(make_llm(folder, graphs=True), prompts, max_tokens)
    eager_run = generate_recording(make_llm(folder, graphs=False), prompts, max_tokens)
    compared, worst = compare(graph_run, eager_run)
    print(
        f"{num_seqs} sequences: {compared} of {sum(max_tokens)} steps compared, largest logit difference "
        f"{worst:.2e} of the largest |logit|"
    )
    assert compared >= 0.8 * sum(max_tokens), f"only {compared} of {sum(max_tokens)} steps compared"

    decode_steps = [(rows, size) for rows, size, decode in graph_run[2] if decode]
    assert decode_steps and all(s == 0 for _, s, _ in eager_run[2])
    for rows, size in decode_steps:
        if rows <= MAX_GRAPH_BS:
            assert size >= rows and size in (1, 2, 4, 8, 16), (rows, size)  # replayed, padded to a captured size
        else:
            assert size == 0  # above the largest graph: eager
    if num_seqs in (3, 5):
        assert any(size > rows for rows, size in decode_steps), "no padded replay happened"
    if num_seqs == 17:
        assert any(size == 0 for _, size in decode_steps) and any(size > 0 for _, size in decode_steps)


def test_graph_decode_matches_eager_at_every_captured_size(folder):
    """One engine capturing every size up to 256 (1, 2, 4, 8 ... 64, 80 ... 256) against eager decode: 256 sequences
    that finish one step apart, so the decode batch runs through every size from 256 down to 1 and each graph is
    replayed, full and padded. Same tokens and logits within the tolerance at every step."""
    rng = random.Random(256)
    prompts = [[rng.randrange(0, 380) for _ in range(rng.randint(3, 40))] for _ in range(256)]
    max_tokens = [i + 2 for i in range(256)]  # the first decode step has 256 rows, the last one 1
    kwargs = dict(
        dtype="bfloat16", device="cuda", page_size=16, num_pages=8192, max_num_seqs=256, cuda_graph_max_bs=256
    )
    graph_llm = LLM(folder, **kwargs)
    sizes = graph_llm.engine.runner.graphs.sizes
    assert sizes[-1] == 256 and len(sizes) > 16
    graph_run = generate_recording(graph_llm, prompts, max_tokens)
    del graph_llm
    eager_run = generate_recording(LLM(folder, disable_cuda_graph=True, **kwargs), prompts, max_tokens)
    compared, worst = compare(graph_run, eager_run)
    record_result(
        "cuda_graph_every_size.json",
        "graph_vs_eager",
        {
            "sizes": sizes,
            "steps_compared": compared,
            "steps": sum(max_tokens),
            "max_logit_diff_of_largest": worst,
        },
    )
    assert compared >= 0.8 * sum(max_tokens), f"only {compared} of {sum(max_tokens)} steps compared"
    decode_steps = [(rows, size) for rows, size, decode in graph_run[2] if decode]
    assert all(size == 0 for _, size, _ in eager_run[2])
    assert all(size >= rows for rows, size in decode_steps), "a decode step ran eagerly or in too small a graph"
    assert {size for _, size in decode_steps} == set(sizes), "not every captured graph was replayed"
    assert {rows for rows, size in decode_steps if rows == size} == set(sizes), "not every graph ran full"


def test_graph_decode_matches_eager_at_the_sizes_above_256(folder):
    """Batches up to 512 (issue 47): a pool of 16,384 pages x 16 tokens holds 512 sequences of this checkpoint's
    whole context (512 tokens), so the engine takes the default batch limit, 512, and captures graphs up to it. Against
    eager decode: 512 sequences, 256 of which run 258 tokens while the other 256 finish one step apart, so the decode
    batch runs through every size from 512 down to 257 and each captured size above 256 (272 ... 512, every 16) is
    replayed, full and padded. Same tokens and logits within the tolerance at every step."""
    rng = random.Random(512)
    prompts = [[rng.randrange(0, 380) for _ in range(rng.randint(3, 16))] for _ in range(512)]
    max_tokens = [258] * 256 + [i + 2 for i in range(256)]  # decode step k (1..256) runs 513 - k rows
    kwargs = dict(dtype="bfloat16", device="cuda", page_size=16, num_pages=16384, max_num_batched_tokens=16384)
    graph_llm = LLM(folder, **kwargs)
    assert graph_llm.engine.max_num_seqs == 512 and graph_llm.engine.runner.sampler.max_rows >= 512
    sizes = graph_llm.engine.runner.graphs.sizes
    above = [s for s in sizes if s > 256]
    assert above == list(range(272, 513, 16)), sizes
    graph_run = generate_recording(graph_llm, prompts, max_tokens)
    del graph_llm
    eager_run = generate_recording(LLM(folder, disable_cuda_graph=True, **kwargs), prompts, max_tokens)
    compared, worst = compare(graph_run, eager_run)
    record_result(
        "cuda_graph_every_size.json",
        "graph_vs_eager_above_256",
        {"sizes": above, "steps_compared": compared, "steps": sum(max_tokens), "max_logit_diff_of_largest": worst},
    )
    assert compared >= 0.8 * sum(max_tokens), f"only {compared} of {sum(max_tokens)} steps compared"
    decode_steps = [(rows, size) for rows, size, decode in graph_run[2] if decode]
    assert all(size == 0 for _, size, _ in eager_run[2])
    assert all(size >= rows for rows, size in decode_steps), "a decode step ran eagerly or in too small a graph"
    assert max(rows for rows, _ in decode_steps) == 512, "the 512 sequences never decoded together"
    assert set(above) <= {size for rows, size in decode_steps if rows == size}, "not every graph above 256 ran full"
    assert set(above) <= {size for rows, size in decode_steps if rows < size}, "not every graph above 256 ran padded"


def test_the_default_limit_from_free_memory(folder):
    """No --num-pages and no --max-num-seqs: the limit comes from the pool the free memory will give
    (batch_limit.estimated_pool_pages). The memory fraction is chosen so that the estimate holds about 408 sequences
    of the context (512 tokens): the limit 400 (as the rule rounds it), graphs captured up to it, and steps that run.
    At this fraction (about 1%) the estimate moves by about 10 pages of 32 per sequence when the free memory drifts by
    50 MB between the test's reading and the engine's. The pool the engine then sized from measured memory is recorded
    next to it (for this tiny model the capture's fixed costs, which the estimate leaves out, are a large part of it)."""
    from fastqwen.config import load_model_config
    from fastqwen.engine import batch_limit
    from fastqwen.kvcache import KVPool
    from fastqwen.ops import decode_workspace_bytes

    cfg, _ = load_model_config(folder)
    assert cfg.max_position_embeddings == 512
    page_bytes = KVPool.bytes_per_page(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    largest = batch_limit.LARGEST_DEFAULT
    buffers = largest * batch_limit.per_sequence_buffer_bytes(cfg, decode_workspace_bytes(1, cfg.num_heads))
    set_aside = batch_limit.step_activation_bytes(cfg, 8192, largest) + largest * batch_limit.per_sequence_graph_bytes(
        cfg
    )
    target = 408 * 512 // 16 * page_bytes
    free = torch.cuda.mem_get_info()[0]
    utilization = (target + set_aside) / (free - buffers)
    llm = LLM(folder, dtype="bfloat16", device="cuda", page_size=16, gpu_memory_utilization=utilization)
    engine = llm.engine
    limit = engine.max_num_seqs
    tokens = engine.kv.num_pages * engine.kv.page_size
    record_result(
        "cuda_graph_every_size.json",
        "default_limit_from_free_memory",
        {"limit": limit, "pool_tokens": tokens, "limit_the_pool_holds": batch_limit.default_max_num_seqs(tokens, 512)},
    )
    assert limit == 400 and engine.runner.graphs.max_bs == limit, limit
    out = llm.generate([[1, 2, 3]] * 3, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert out[0].token_ids == out[1].token_ids == out[2].token_ids


def test_padding_rows_write_no_kv_and_logits_match_eager(folder):
    """One decode step of 5 sequences through the graph of 8, against the eager forward of the same batch: real
    rows' logits within tolerance, and the only KV slots written are the 5 real tokens' (padding writes nowhere)."""
    llm = make_llm(folder, graphs=True, overlap=False)  # no step in flight when the test schedules one itself
    engine, runner = llm.engine, llm.engine.runner
    prompts, _ = workload(5, seed=42)
    for prompt in prompts:
        llm.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    while any(r.cached_len < len(r.token_ids) - 1 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill (and, for early finishers, a few decodes) until all 5 decode together
    scheduled = engine.scheduler.schedule()
    assert scheduled.is_decode and len(scheduled.chunks) == 5

    storage = engine.kv._storage
    before = storage.clone()
    batch, size = runner._build(scheduled)
    assert size == 8
    graph_logits = runner.run_model(batch, size).clone()
    torch.cuda.synchronize()
    # Flat slots [layers, 2, pages * page_size] whose K or V changed.
    changed = (storage != before).any(-1).any(-1).flatten(2).any(1).any(0)
    page_size = engine.kv.page_size
    expected = set()
    for chunk in scheduled.chunks:
        pos = chunk.start
        expected.add(chunk.request.pages[pos // page_size] * page_size + pos % page_size)
    assert len(expected) == 5
    assert set(changed.nonzero().flatten().tolist()) == expected

    eager_batch = runner._build_eager(scheduled)
    eager_logits = runner.model.forward(eager_batch, engine.kv)
    assert graph_logits.shape == eager_logits.shape == (5, engine.config.vocab_size)
    delta = TOLERANCE * eager_logits.abs().max().item()
    assert (graph_logits - eager_logits).abs().max().item() <= delta


def test_capture_is_measured_and_can_be_disabled(folder):
    llm = make_llm(folder, graphs=True)
    graphs = llm.engine.runner.graphs
    assert graphs.sizes == [1, 2, 4, 8, 16]
    assert graphs.memory_bytes > 0 and graphs.capture_seconds > 0
    assert make_llm(folder, graphs=False).engine.runner.graphs is None
    # Sized from free memory: the dry capture is measured and set aside before the KV pool.
    sized = LLM(folder, dtype="bfloat16", device="cuda", max_num_seqs=8, gpu_memory_utilization=0.05)
    assert sized.engine.runner.graphs.sizes == [1, 2, 4, 8]
    out = sized.generate(
        [[1, 2, 3]] * 3, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False
    )
    assert out[0].token_ids == out[1].token_ids == out[2].token_ids


def test_graph_captures_the_sampler_seeded_sampling_matches_eager(folder):
    """With the CUDA sampler captured in the decode graphs: seeded top-k/top-p sampling with penalties, min_tokens
    bans and logprobs gives the same tokens as eager decode (the draws are keyed by seed and step, not by the batch
    or the graph's padding), padding rows count nothing into any request's penalty row, and logprobs agree."""
    graph_llm, eager_llm = make_llm(folder, graphs=True), make_llm(folder, graphs=False)
    if graph_llm.engine.runner.sampler.graph_hook is None:
        pytest.skip("needs the CUDA sampler")
    assert graph_llm.engine.runner.graphs is not None and graph_llm.engine.runner.graphs.post_logits is not None
    rng = random.Random(9)
    prompts = [[rng.randrange(0, 380) for _ in range(rng.randint(3, 120))] for _ in range(5)]  # pads 5 -> 8
    params = [
        SamplingParams(
            temperature=0.9,
            top_k=40,
            top_p=0.9,
            seed=100 + i,
            max_tokens=20,
            repetition_penalty=1.3,
            presence_penalty=0.4,
            frequency_penalty=0.2,
            min_tokens=6,
            ignore_eos=i % 2 == 0,
            logprobs=2 if i % 2 else None,
        )
        for i in range(5)
    ]
    graph_outs = graph_llm.generate(prompts, params, use_tqdm=False)
    eager_outs = eager_llm.generate(prompts, params, use_tqdm=False)
    for g, e in zip(graph_outs, eager_outs):
        assert g.token_ids == e.token_ids
        if e.logprobs is None:
            assert g.logprobs is None
        else:
            for a, b in zip(g.logprobs, e.logprobs):
                assert a.token == b.token and abs(a.logprob - b.logprob) < 0.05
                assert [t for t, _ in a.top] == [t for t, _ in b.top]


def run_steps(llm: LLM, prompts, params, abort_at: tuple[int, int] | None = None):
    """Drive the engine step by step (checking page ownership after each); abort_at = (step, prompt index) aborts
    that request after that step, while a step launched ahead is in flight. Outputs in prompt order."""
    engine = llm.engine
    rids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    outputs, steps, aborted_in_flight = {}, 0, False
    while engine.has_unfinished():
        for update in llm.step():
            if update.finished:
                outputs[update.request_id] = update.output
        engine.check_invariants()
        steps += 1
        if abort_at is not None and steps == abort_at[0]:
            aborted_in_flight = engine._ahead is not None
            assert llm.abort(rids[abort_at[1]])
    assert engine.kv_usage() == 0
    return [outputs.get(rid) for rid in rids], aborted_in_flight


def test_overlap_schedule_gives_the_same_tokens(folder):
    """The overlap schedule (the next decode step launched before this one's tokens are read back) against the plain
    one, both replaying the same graphs: identical tokens and finish reasons for greedy and seeded top-k/top-p rows
    with penalties and min_tokens bans, rows that stop on a stop id while the next step is in flight, rows that end
    on max_tokens, and a row with logprobs (steps with it are not launched ahead)."""
    rng = random.Random(5)
    prompts = [[rng.randrange(0, 380) for _ in range(rng.randint(3, 90))] for _ in range(7)]

    def params(stops):
        return [
            SamplingParams(
                temperature=0.0 if i % 3 == 0 else 0.8,
                top_k=0 if i % 2 else 30,
                top_p=0.9,
                seed=40 + i,
                max_tokens=[24, 9, 30, 17, 30, 12, 6][i],
                ignore_eos=True,
                stop_token_ids=stops[i],
                repetition_penalty=1.2 if i in (1, 4) else 1.0,
                frequency_penalty=0.3 if i == 4 else 0.0,
                min_tokens=4 if i == 2 else 0,
                logprobs=1 if i == 6 else None,
            )
            for i in range(7)
        ]

    # Stop ids that some rows draw midway, so they stop while a step launched ahead holds them.
    first, _ = run_steps(make_llm(folder, graphs=True, overlap=False), prompts, params([[]] * 7))

    def first_new_token(ids: list[int], k: int) -> list[int]:  # the first token from index k on not drawn before
        return next([t] for j, t in enumerate(ids) if j >= k and t not in ids[:j])

    stops = [first_new_token(first[i].token_ids, k) if k else [] for i, k in enumerate([5, 0, 7, 0, 11, 0, 0])]
    plain_llm, overlap_llm = make_llm(folder, graphs=True, overlap=False), make_llm(folder, graphs=True)
    plain, _ = run_steps(plain_llm, prompts, params(stops))
    overlapped, _ = run_steps(overlap_llm, prompts, params(stops))
    for i, (a, b) in enumerate(zip(plain, overlapped)):
        assert a.token_ids == b.token_ids, i
        assert a.finish_reason == b.finish_reason, i
    # Ahead only once the logprobs row (6 tokens) is done; the longest row runs 17 tokens or more.
    assert plain_llm.engine.num_ahead_steps == 0 and overlap_llm.engine.num_ahead_steps >= 5
    assert plain[0].finish_reason == plain[4].finish_reason == "stop", "the stop ids did not stop the rows"
    assert plain[6].logprobs is not None and len(overlapped[6].logprobs) == len(overlapped[6].token_ids)


def test_abort_while_a_step_is_in_flight(folder):
    """Aborting a request that a step launched ahead still computes: its pages are released at once (the invariant
    holds after every step), the step's result for it is dropped, and the other rows' tokens are those of the plain
    schedule with the same abort (7 and then 6 rows both replay the graph of 8, so nothing else changes)."""
    rng = random.Random(6)
    prompts = [[rng.randrange(0, 380) for _ in range(rng.randint(3, 60))] for _ in range(7)]
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 7
    plain, _ = run_steps(make_llm(folder, graphs=True, overlap=False), prompts, params, abort_at=(6, 3))
    overlapped, in_flight = run_steps(make_llm(folder, graphs=True), prompts, params, abort_at=(6, 3))
    assert in_flight, "no step was in flight when the request was aborted"
    assert plain[3] is None and overlapped[3] is None  # aborted: no finished output
    for i in (0, 1, 2, 4, 5, 6):
        assert plain[i].token_ids == overlapped[i].token_ids and len(plain[i].token_ids) == 20
