"""Tensor parallelism on GPUs (skipped without 2): the custom all-reduce against a float64 sum and against NCCL at
every size up to its threshold (eager and replayed from a CUDA graph, 2 and 4 ranks where there are GPUs for them),
with one barrier a call and with the barrier-free kernels for the small messages;
the all-reduce fused with the residual add and RMSNorm (called directly, whatever FASTQWEN_FUSED_ALLREDUCE_NORM says)
against the float64 sum and norm and against the composition it replaces, at row counts up to the threshold, eager
and in a graph; and a TP=2 engine against TP=1 on the same machine, teacher-forced (tokens equal except where the
top-2 margin is within the observed logit difference, the rule of the CUDA graph tests), also with the fused kernel
switched on."""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing
import os
import shutil
import tempfile
import time
import traceback

import pytest
import torch
from all_reduce_norm_reference import assert_close_to_reference
from checkpoints import captured_graph, make_checkpoint, record_result
from fastqwen import LLM
from server_process import free_port
from test_cuda_graph_gpu import generate_recording, workload

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

RANKS_DEADLINE_S = 240  # one test's ranks, all of them

# Message sizes in elements: tiny, decode of 1..256 sequences of hidden 4096 and 5120, and the threshold itself.
SIZES = [8, 64, 1000 * 8, 4096, 5120, 4096 * 8, 5120 * 32, 4096 * 256, 5120 * 256]


def _connect(rank: int, world: int, port: int):
    """This rank's ParallelGroup on GPU `rank` (NVLink multicast off), with the custom all-reduce started."""
    import torch.distributed as dist
    from fastqwen.ops.collectives import ParallelGroup

    os.environ["NCCL_NVLS_ENABLE"] = "0"
    # The ranks share the host's cores: with every core as each rank's intra-op threads, four ranks oversubscribe
    # the host four times over (a suspect, not established, in the fused test at world 4 running past its deadline).
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    # A rank still running near _run_ranks' deadline prints its Python stack (a GPU hang shows as a wait in a copy to
    # the host, slow host work as the line doing it).
    faulthandler.dump_traceback_later(RANKS_DEADLINE_S - 15, exit=False)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, datetime.timedelta(seconds=120))
    group = ParallelGroup.connect(rank, world, store, device)
    assert group.custom is not None, "the custom all-reduce did not start"
    from fastqwen import env

    assert (group.custom.lamport_bytes > 0) == env.all_reduce_lamport(), "FASTQWEN_ALLREDUCE_LAMPORT not followed"
    return group, device


def _progress(rank: int, what: str) -> None:
    """The case a rank is at, in the file _run_ranks reads back if the ranks run past their deadline."""
    folder = os.environ.get("FASTQWEN_TP_TEST_PROGRESS")
    if folder:
        with open(os.path.join(folder, str(rank)), "w") as f:
            f.write(what)


def _worker(rank: int, world: int, port: int, dtype_names: tuple[str, ...], failures, check) -> None:
    """check(group, device, rank, world, dtype_name) for every dtype in one set of rank processes (starting the ranks
    and their groups costs more than the checks)."""
    try:
        group, device = _connect(rank, world, port)
        for dtype_name in dtype_names:
            check(group, device, rank, world, dtype_name)
    except BaseException:
        failures.put(f"rank {rank}: {traceback.format_exc()}")
        raise


def _check_all_reduce(group, device, rank: int, world: int, dtype_name: str) -> None:
    dtype = getattr(torch, dtype_name)
    limit = group.custom.max_bytes // torch.empty((), dtype=dtype).element_size()
    for numel in [n for n in SIZES if n <= limit] + [limit]:
        inputs = [
            torch.randn(numel, generator=torch.Generator().manual_seed(1000 * r + numel)).to(dtype)
            for r in range(world)
        ]
        _progress(rank, f"{dtype_name} {numel}")
        reference = torch.stack([x.double() for x in inputs]).sum(0)
        mine = inputs[rank].to(device)
        custom = mine.clone()
        assert group.custom.applies(custom)
        group.custom(custom)
        nccl = mine.clone()
        group.device_group.allreduce([nccl]).wait()
        # Float32 accumulation: for bf16/fp16 one rounding that counts, within one unit in the last place of the
        # result. Float32 inputs are summed in float32 itself: world - 1 additions, each off by at most half a
        # unit of its partial sum, so the classic bound (world - 1) * eps / 2 * sum |x| is added (two ranks make
        # one addition and stay within one unit; the float32 case at four ranks failed on four H200s, its message
        # lost to the stage's time limit: this check is the one three additions can break).
        ulp = torch.finfo(dtype).eps * reference.abs().clamp_min(torch.finfo(dtype).tiny)
        if dtype == torch.float32:
            magnitude = torch.stack([x.double().abs() for x in inputs]).sum(0)
            ulp = ulp + (world - 1) * torch.finfo(dtype).eps / 2 * magnitude
        err = (custom.double().cpu() - reference).abs()
        assert (err <= ulp).all(), f"{dtype_name} {numel}: custom off the float64 sum by {(err / ulp).max():.2f} ulp"
        err_nccl = (nccl.double().cpu() - reference).abs()
        assert (err <= err_nccl + ulp).all(), f"{dtype_name} {numel}: custom further from the sum than NCCL"
        # Every rank holds bitwise the same result.
        everyone = torch.empty(world * numel, dtype=dtype, device=device)
        group.device_group._allgather_base(everyone, custom).wait()
        assert all(torch.equal(chunk, custom) for chunk in everyone.view(world, numel)), "ranks disagree"
    # Captured in a CUDA graph and replayed with new inputs each time (the round counters live on the device).
    numel = 5120 * 4
    static = torch.zeros(numel, dtype=dtype, device=device)
    graph = captured_graph(lambda: group.all_reduce(static))
    for replay in range(5):
        values = [torch.full((numel,), float(r + replay), dtype=dtype) for r in range(world)]
        static.copy_(values[rank].to(device))
        graph.replay()
        torch.cuda.synchronize()
        expected = sum(float(r + replay) for r in range(world))
        assert torch.all(static.float().cpu() == expected), f"replay {replay}: {static[:4].tolist()} != {expected}"
    # Back to back with the ranks out of step: rank 1 spins before every other call, so rank 0 arrives a round ahead
    # (one barrier a round: the flag waited for may already hold the next round's number, and the halves keep a
    # round's copy from overwriting what the slower rank still reads of the round before).
    chain = [torch.zeros(5120 * 16, dtype=dtype, device=device) for _ in range(16)]

    def calls():
        for i, buffer in enumerate(chain):
            if rank == 1 and i % 2 == 0:
                torch.cuda._sleep(20_000)
            group.all_reduce(buffer)

    graph = captured_graph(calls)
    for replay in range(3):
        _progress(rank, f"{dtype_name} out of step, replay {replay}")
        for i, buffer in enumerate(chain):  # (small integers: exact sums in every dtype)
            buffer.fill_(float(rank + 10 * (i % 8) + replay))
        graph.replay()
        torch.cuda.synchronize()
        for i, buffer in enumerate(chain):
            expected = sum(float(r + 10 * (i % 8) + replay) for r in range(world))
            assert torch.all(buffer.float().cpu() == expected), f"out of step, replay {replay}, call {i}"
    group.barrier()


# The fused kernel's cases: (hidden, rows). Hidden sizes of one 16-byte pack, of one, two and four packs a thread
# (4096, 5120, 16384: its largest), of Qwen3-8B and -32B; row counts below, at and past the 36 blocks (rows a block),
# up to 256 sequences and to the threshold (added per hidden in the worker).
FUSED_HIDDEN = [8, 128, 4096, 5120, 16384]
FUSED_ROWS = [1, 2, 3, 5, 8, 16, 35, 36, 37, 64, 128, 256]
EPS = 1e-6


def _norm_inputs(world: int, rows: int, hidden: int, dtype, seed: int):
    """Every rank's partial rows, the residual (the same on every rank, as in the model) and the norm weight."""
    g = torch.Generator().manual_seed(seed)
    partials = [(torch.randn(rows, hidden, generator=g) * (r + 1)).to(dtype) for r in range(world)]
    residual = (torch.randn(rows, hidden, generator=g) * 4).to(dtype)
    weight = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    return partials, residual, weight


def _check_fused(group, device, rank: int, world: int, dtype_name: str) -> None:
    from fastqwen import ops

    custom = group.custom
    dtype = getattr(torch, dtype_name)
    size = torch.empty((), dtype=dtype).element_size()

    def gathered(t: torch.Tensor) -> torch.Tensor:
        everyone = torch.empty(world * t.numel(), dtype=t.dtype, device=device)
        group.device_group._allgather_base(everyone, t.reshape(-1)).wait()
        return everyone.view(world, *t.shape)

    for hidden in FUSED_HIDDEN:
        limit = custom.max_bytes // (hidden * size)
        for rows in sorted({r for r in FUSED_ROWS if r <= limit} | {limit}):
            what = f"{dtype_name} {rows}x{hidden}"
            _progress(rank, what)
            partials, residual, weight = _norm_inputs(world, rows, hidden, dtype, seed=rows * 100003 + hidden)
            x, res, w = partials[rank].to(device), residual.to(device), weight.to(device)
            assert custom.applies_with_norm(x, res, w), what
            normed, new_residual = custom.all_reduce_add_rms_norm(x.clone(), res.clone(), w, EPS)
            assert_close_to_reference(normed, new_residual, partials, residual, weight, EPS, 1, what)
            # The composition it replaces: the same new residual bit for bit; normed rows within one unit in
            # the last place (the same arithmetic and layout; only the compiler's choices may differ).
            composed, composed_residual = ops.fused_add_rms_norm(custom(x.clone()), res.clone(), w, EPS)
            assert torch.equal(new_residual, composed_residual), f"{what}: the new residual is not the composition's"
            ulp = torch.finfo(dtype).eps * composed.float().abs()
            assert ((normed.float() - composed.float()).abs() <= ulp).all(), f"{what}: normed off the composition"
            for t in (normed, new_residual):
                assert all(torch.equal(mine, t) for mine in gathered(t)), f"{what}: ranks disagree"
    # Past the threshold (and in float32) ParallelGroup composes NCCL's all-reduce with fused_add_rms_norm.
    group.fused_norm = True
    hidden = 5120
    rows = custom.max_bytes // (hidden * size) + 1
    _progress(rank, f"{dtype_name} past the threshold")
    partials, residual, weight = _norm_inputs(world, rows, hidden, dtype, seed=7)
    x, res, w = partials[rank].to(device), residual.to(device), weight.to(device)
    assert not custom.applies_with_norm(x, res, w)
    normed, new_residual = group.all_reduce_add_rms_norm(x, res, w, EPS)
    assert_close_to_reference(normed, new_residual, partials, residual, weight, EPS, world - 1, "past the threshold")
    assert not custom.applies_with_norm(x.float(), res.float(), w.float())
    # Captured in a CUDA graph with a plain all-reduce between two fused ones (they share the round counters),
    # and replayed with new inputs each time.
    shapes = [(4, 5120), (40, 4096)]  # 4 rows: one a block; 40: past the 36 blocks
    xs = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
    residuals = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
    ws = [torch.ones(shape[1], dtype=dtype, device=device) for shape in shapes]
    plain = torch.zeros(5120 * 4, dtype=dtype, device=device)

    def step():
        custom.all_reduce_add_rms_norm(xs[0], residuals[0], ws[0], EPS)
        group.all_reduce(plain)
        custom.all_reduce_add_rms_norm(xs[1], residuals[1], ws[1], EPS)

    _progress(rank, f"{dtype_name} captured")
    graph = captured_graph(step)
    for replay in range(5):
        _progress(rank, f"{dtype_name} replay {replay}")
        cases = [_norm_inputs(world, *shape, dtype, seed=1000 + 10 * replay + n) for n, shape in enumerate(shapes)]
        for n, (partials, residual, weight) in enumerate(cases):
            xs[n].copy_(partials[rank].to(device))
            residuals[n].copy_(residual.to(device))
            ws[n].copy_(weight.to(device))
        plain.copy_(torch.full_like(plain, float(rank + replay)))
        graph.replay()
        torch.cuda.synchronize()
        for n, (partials, residual, weight) in enumerate(cases):
            what = f"replay {replay} {shapes[n]}"
            assert_close_to_reference(xs[n], residuals[n], partials, residual, weight, EPS, 1, what)
        expected = sum(float(r + replay) for r in range(world))
        assert torch.all(plain.float().cpu() == expected), f"replay {replay}: the plain all-reduce between"
    group.barrier()


# The sending GEMV's cases: (outputs, inputs, FP8 weights). Qwen3-32B's o_proj shard at TP=2 (5,120 rows: blocks of 5
# where the rule picks them), an output count no block size divides (1,000: the last block part-filled), FP8.
SENT_CASES = [(5120, 4096, False), (1000, 512, False), (4096, 1024, True)]


def _check_sent(group, device, rank: int, world: int, dtype_name: str) -> None:
    """FASTQWEN_GEMV_SENDS=1: a one-token GEMV stores its output into the ranks' receive buffers and the fused
    all-reduce + norm only sums (ParallelGroup.linear_to_all_reduce, then all_reduce_add_rms_norm(sent=True)). Against
    the same GEMV writing its output and the fused kernel sending it: bit for bit (the same values summed in the same
    order); against float64 of the ranks' GEMV outputs; every rank alike. Mixed with barrier-free and one-barrier
    all-reduces between (one round sequence, three receive buffers), eagerly and in a CUDA graph replayed with rank 1
    running late before every other GEMV."""
    from fastqwen.ops.linear import LinearWeight, gemv, quantize_fp8

    custom = group.custom
    assert custom.send_target is not None, "FASTQWEN_GEMV_SENDS=1 made no send target"
    dtype = getattr(torch, dtype_name)

    def gathered(t: torch.Tensor) -> torch.Tensor:
        everyone = torch.empty(world * t.numel(), dtype=t.dtype, device=device)
        group.device_group._allgather_base(everyone, t.reshape(-1)).wait()
        return everyone.view(world, *t.shape)

    big = torch.zeros(custom.lamport_bytes // 2 + 8, dtype=dtype, device=device)  # past the barrier-free size
    for n, k, fp8 in SENT_CASES:
        what = f"{dtype_name} {n}x{k}{' fp8' if fp8 else ''}"
        _progress(rank, what)
        g = torch.Generator().manual_seed(n * 7 + k + 1000 * rank)  # this rank's shard and input
        dense = torch.randn(n, k, generator=g) * 0.05
        w = LinearWeight(*quantize_fp8(dense.to(device))) if fp8 else LinearWeight(dense.to(dtype).to(device))
        x = torch.randn(1, k, generator=g).to(dtype).to(device)
        shared = torch.Generator().manual_seed(n)  # the same residual and norm weight on every rank
        residual = (torch.randn(1, n, generator=shared) * 4).to(dtype).to(device)
        weight = (torch.rand(n, generator=shared) + 0.5).to(dtype).to(device)
        plain = gemv(x, w)  # this rank's partial as the GEMV writes it
        partials = [p.cpu() for p in gathered(plain)]
        for repeat in range(4):  # (each round in the next receive buffer; other kinds of round between)
            out, sent = group.linear_to_all_reduce(x, w)
            assert sent, f"{what}: the GEMV did not send"
            normed, new_residual = group.all_reduce_add_rms_norm(out, residual.clone(), weight, EPS, sent=True)
            want, want_residual = custom.all_reduce_add_rms_norm(plain.clone(), residual.clone(), weight, EPS)
            assert torch.equal(new_residual, want_residual), f"{what} #{repeat}: the new residual differs"
            assert torch.equal(normed, want), f"{what} #{repeat}: the normed row differs"
            assert_close_to_reference(normed, new_residual, partials, residual.cpu(), weight.cpu(), EPS, 1, what)
            for t in (normed, new_residual):
                assert all(torch.equal(mine, t) for mine in gathered(t)), f"{what}: ranks disagree"
            if repeat % 2:
                group.all_reduce(big)  # a one-barrier round between
    # In a graph: two sent rounds with a barrier-free all-reduce between, rank 1 late before every other GEMV.
    n, k, _ = SENT_CASES[0]
    g = torch.Generator().manual_seed(99 + rank)
    w = LinearWeight((torch.randn(n, k, generator=g) * 0.05).to(dtype).to(device))
    xs = [torch.zeros(1, k, dtype=dtype, device=device) for _ in range(2)]
    residual = torch.zeros(1, n, dtype=dtype, device=device)
    weight = torch.ones(n, dtype=dtype, device=device)
    between = torch.zeros(4096, dtype=dtype, device=device)
    outs = []

    def step():
        outs.clear()
        for i, x in enumerate(xs):
            if rank == 1 and i == 0:
                torch.cuda._sleep(20_000)
            out, sent = group.linear_to_all_reduce(x, w)
            assert sent
            outs.append(group.all_reduce_add_rms_norm(out, residual, weight, EPS, sent=True)[0])
            if i == 0:
                group.all_reduce(between)

    graph = captured_graph(step)
    for replay in range(3):
        _progress(rank, f"{dtype_name} sent, replay {replay}")
        inputs = [torch.randn(1, k, generator=torch.Generator().manual_seed(10 * replay + i + 100 * rank)).to(dtype)
                  for i in range(2)]  # fmt: skip
        start = (torch.randn(1, n, generator=torch.Generator().manual_seed(replay)) * 4).to(dtype).to(device)
        for x, values in zip(xs, inputs):
            x.copy_(values.to(device))
        residual.copy_(start)
        between.fill_(float(rank + replay))
        graph.replay()
        torch.cuda.synchronize()
        got = [o.clone() for o in outs]
        expected_residual = start.clone()  # the same eagerly, through the unsent path
        for i, x in enumerate(xs):
            want, _ = custom.all_reduce_add_rms_norm(gemv(x, w), expected_residual, weight, EPS)
            assert torch.equal(got[i], want), f"{dtype_name} graph replay {replay}, call {i}: differs from eager"
        assert torch.equal(residual, expected_residual), f"{dtype_name} graph replay {replay}: the residual differs"
        assert torch.all(between.float().cpu() == sum(float(r + replay) for r in range(world))), "the call between"
    group.barrier()


def _run_ranks(
    world: int, dtype_names: tuple[str, ...], check=_check_all_reduce, environment: dict | None = None
) -> None:
    """The ranks in processes of their own, on a port nobody holds (a fixed one could meet the store of an earlier
    test's rank still shutting down, and wait). One deadline for all; once a rank has failed, the others get a few
    seconds (they may be waiting in a collective for it) and are killed, so a failure is reported, not a hang."""
    ctx = multiprocessing.get_context("spawn")
    failures = ctx.Queue()
    port = free_port()
    progress = tempfile.mkdtemp(prefix="tp-progress-")
    procs = [ctx.Process(target=_worker, args=(r, world, port, dtype_names, failures, check)) for r in range(world)]
    environment = {"FASTQWEN_TP_TEST_PROGRESS": progress, **(environment or {})}
    saved = {name: os.environ.get(name) for name in environment}
    os.environ.update(environment)  # (the spawned ranks inherit it)
    try:
        for p in procs:
            p.start()
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
    deadline = time.monotonic() + RANKS_DEADLINE_S
    failed_at = None
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > 10:
            break
        time.sleep(0.2)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join(10)
    errors = []
    while not failures.empty():
        errors.append(failures.get())
    at = {}  # rank -> the last case it reached
    for name in os.listdir(progress):
        with open(os.path.join(progress, name)) as f:
            at[int(name)] = f.read()
    shutil.rmtree(progress, ignore_errors=True)
    assert not errors and all(p.exitcode == 0 for p in procs), (
        "\n".join(errors) or f"exit codes {[p.exitcode for p in procs]}, the ranks last at {dict(sorted(at.items()))}"
    )
    assert not hung, f"{len(hung)} ranks hung, last at {dict(sorted(at.items()))}"


@pytest.mark.parametrize("world", [2, 4])
def test_custom_all_reduce_matches_the_sum_and_nccl(world):
    """bf16, fp16 and float32 in turn (a failure names its dtype)."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    _run_ranks(world, ("bfloat16", "float16", "float32"))


@pytest.mark.parametrize("world", [2, 4])
def test_fused_all_reduce_norm_matches_float64(world):
    """bf16 and fp16 in turn (a failure names its dtype)."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    _run_ranks(world, ("bfloat16", "float16"), _check_fused)


# By default the barrier-free kernels take the messages of up to LAMPORT_MAX_BYTES of the two tests above, the larger
# ones the barrier kernels in between (the two kinds of round share counters and receive buffers). With
# FASTQWEN_ALLREDUCE_LAMPORT=0 the one-barrier kernels take them all.
ONE_BARRIER = {"FASTQWEN_ALLREDUCE_LAMPORT": "0"}


@pytest.mark.parametrize("world", [2, 4])
def test_one_barrier_all_reduce_matches_the_sum_and_nccl(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    _run_ranks(world, ("bfloat16", "float16", "float32"), environment=ONE_BARRIER)


@pytest.mark.parametrize("world", [2, 4])
def test_one_barrier_fused_all_reduce_norm_matches_float64(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    _run_ranks(world, ("bfloat16", "float16"), _check_fused, environment=ONE_BARRIER)


# A one-token GEMV sends its output into the receive buffers itself (FASTQWEN_GEMV_SENDS=1, off by default).
SENDS = {"FASTQWEN_GEMV_SENDS": "1"}


@pytest.mark.parametrize("world", [2, 4])
def test_sending_gemv_feeds_the_fused_all_reduce(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    _run_ranks(world, ("bfloat16", "float16"), _check_sent, environment=SENDS)


# TP rounds each rank's partial o_proj / down sums to bf16 before adding them: a few bf16 steps per layer. Stated
# tolerance: 5% of the largest |logit| (the graph tests' 1% is for identical arithmetic).
TOLERANCE = 0.05


def fp8_reference_logits(folder: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Each prompt's last-position logits from HF transformers in float64 (CPU), its projections replaced by their FP8
    values (128x128 blocks, amax / 448, rounded by torch's float8_e4m3fn cast): the model the FP8 engines hold, without
    their activation rounding (the FP8 GEMM quantizes activations on 1x128 groups)."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in names:
                w = module.weight.data
                rows, cols = w.shape
                blocks = w.view(rows // 128, 128, cols // 128, 128)
                scale = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp_min(1e-12) / 448.0
                module.weight.data = ((blocks / scale).to(torch.float8_e4m3fn).double() * scale).view(rows, cols)
        return [model(torch.tensor([p])).logits[0, -1] for p in prompts]


def compare(tp_run, single_run, tolerance: float = TOLERANCE) -> tuple[int, float]:
    """Per request: logits within the tolerance at every step compared, and identical tokens up to the first step
    whose TP=1 top-1 margin is at most twice that step's largest logit difference (only there may the argmaxes
    differ). Returns the steps compared and the largest logit difference relative to the largest |logit|."""
    compared, worst = 0, 0.0
    for t_out, t_logits, s_out, s_logits in zip(tp_run[0], tp_run[1], single_run[0], single_run[1]):
        scale = s_logits.abs().max().item()
        top2 = s_logits.topk(2, dim=-1).values
        margins = (top2[:, 0] - top2[:, 1]).tolist()
        for k, (t_tok, s_tok) in enumerate(zip(t_out.token_ids, s_out.token_ids)):
            diff = (t_logits[k] - s_logits[k]).abs().max().item()
            worst = max(worst, diff / scale)
            assert diff <= tolerance * scale, f"request {t_out.request_id} step {k}: logits differ by {diff:.4f}"
            if diff > 0 and margins[k] <= 2 * diff:
                break
            assert t_tok == s_tok, f"request {t_out.request_id} step {k}: margin {margins[k]:.3f}"
            compared += 1
    return compared, worst


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tp_gpu"))
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
        seed=13,
    )
    return folder


@pytest.mark.parametrize(
    "quantization, fused_norm, sends",
    [("auto", False, False), ("fp8", False, False), ("auto", True, False), ("auto", True, True)],
    ids=["auto", "fp8", "fused_norm", "gemv_sends"],
)
def test_tp2_matches_tp1_teacher_forced(folder, quantization, fused_norm, sends, monkeypatch):
    """quantization "fp8": each rank quantizes its shard on load and runs the FP8 GEMV and GEMM on it (every split of
    this shape falls on whole 128 blocks, so both runs hold the same FP8 values). fused_norm: with
    FASTQWEN_FUSED_ALLREDUCE_NORM=1 (read by every rank: rank 1 inherits the environment), so the decode steps run the
    all-reduce fused with the residual add and norm. sends: FASTQWEN_GEMV_SENDS=1 too, so the one-token steps' o_proj
    and down GEMVs store their rows into the receive buffers themselves."""
    monkeypatch.setenv("FASTQWEN_FUSED_ALLREDUCE_NORM", "1" if fused_norm else "0")
    monkeypatch.setenv("FASTQWEN_GEMV_SENDS", "1" if sends else "0")
    prompts, max_tokens = workload(24, seed=3)
    knobs = dict(
        dtype="bfloat16",
        device="cuda",
        page_size=16,
        num_pages=512,
        max_num_seqs=32,
        cuda_graph_max_bs=16,
        quantization=quantization,
    )
    single = LLM(folder, **knobs)
    one = generate_recording(single, prompts, max_tokens)
    del single
    torch.cuda.empty_cache()
    # Rank 0's row-parallel projections (its graphs' captures included): which of them sent
    from fastqwen.ops.collectives import ParallelGroup

    sent, original = [], ParallelGroup.linear_to_all_reduce

    def counted(self, x, w):
        out, was_sent = original(self, x, w)
        sent.append(was_sent)
        return out, was_sent

    monkeypatch.setattr(ParallelGroup, "linear_to_all_reduce", counted)
    llm = LLM(folder, tensor_parallel_size=2, **knobs)
    try:
        parallel = llm.engine.parallel
        assert parallel.custom is not None and parallel.fused_norm == fused_norm
        assert (parallel.custom.send_target is not None) == sends
        two = generate_recording(llm, prompts, max_tokens)
        assert any(size for _, size, _ in two[2]), "no decode step replayed a CUDA graph"
        assert any(sent) == sends, "no GEMV sent" if sends else "a GEMV sent"
    finally:
        llm.close()
    figures, tolerance = {}, TOLERANCE
    if quantization == "fp8":
        # FP8's activation rounding turns the TP partial sums' bf16 differences into whole e4m3 steps on some
        # activations, so TP=2 and TP=1 differ by more than in bf16. Each run's prefill logits against the float64
        # model of the same FP8 weights: TP=2 must be as close as TP=1 (a wrong shard or scale block is far off),
        # and the two runs may then differ by what each is off by.
        reference = fp8_reference_logits(folder, prompts)
        for name, run in (("tp1", one), ("tp2", two)):
            figures[f"{name}_prefill_vs_float64_rel"] = max(
                ((logits[0] - ref.float()).abs().max() / ref.abs().max()).item()
                for logits, ref in zip(run[1], reference)
            )
        record_result("tensor_parallel.json", "tp2_vs_tp1_fp8_prefill", dict(figures))
        assert figures["tp2_prefill_vs_float64_rel"] <= 1.5 * figures["tp1_prefill_vs_float64_rel"] + 0.01, figures
        tolerance = max(TOLERANCE, 2 * figures["tp1_prefill_vs_float64_rel"])
    compared, worst = compare(two, one, tolerance)
    # FP8's larger differences stop the margin rule sooner: 9 decisive tokens of 24 requests on two H200s, where the
    # float64 check above is the guard (bf16: 58)
    assert compared >= (len(prompts) if quantization == "auto" else len(prompts) // 6)
    key = "tp2_vs_tp1" if quantization == "auto" else f"tp2_vs_tp1_{quantization}"
    key += "_fused_norm" if fused_norm else ""
    key += "_gemv_sends" if sends else ""
    figures.update(steps_compared=compared, worst_logit_diff_rel=worst, tolerance=tolerance)
    record_result("tensor_parallel.json", key, figures)


def test_tp2_grammars_in_graphs_overlap_like_the_serial_schedule(tmp_path):
    """TP=2 with CUDA graphs and structured output: each rank compiles the grammars and applies the masks at the
    same step. With the overlap schedule on (a constrained step's forward runs ahead, its sampler once the step
    before is recorded) the tokens (seeded sampling) equal TP=2's serial schedule, but for the rows a step launched ahead may move to
    another captured batch size (test_structured_gpu's rule: at least 20 of 24 equal), and every constrained output
    is its schema's JSON."""
    import json

    from fastqwen.sampling_params import StructuredOutput
    from test_structured_gpu import _check
    from test_structured_output import SCHEMAS, _write_checkpoint

    folder = str(tmp_path)
    _write_checkpoint(folder, num_heads=8, num_kv_heads=2, head_dim=128, hidden=256, intermediate=512)
    from fastqwen import SamplingParams

    params = [
        SamplingParams(
            temperature=1.0,
            seed=300 + i,
            max_tokens=160,
            **({"structured": StructuredOutput("json_schema", json.dumps(SCHEMAS[i % len(SCHEMAS)]))} if i % 2 else {}),
        )
        for i in range(24)
    ]
    prompts = [f"request {i}" for i in range(24)]
    knobs = dict(dtype="bfloat16", device="cuda", num_pages=1024, page_size=16, max_num_seqs=32, cuda_graph_max_bs=32)
    runs = {}
    for overlap in (True, False):
        llm = LLM(folder, tensor_parallel_size=2, disable_overlap_schedule=not overlap, **knobs)
        try:
            ahead = llm.engine.num_ahead_steps
            runs[overlap] = llm.generate(prompts, params, use_tqdm=False)
            assert (llm.engine.num_ahead_steps > ahead) == overlap
        finally:
            llm.close()
    same = sum(a.token_ids == b.token_ids for a, b in zip(runs[True], runs[False]))
    assert same >= 20, same
    for i, out in enumerate(runs[True]):
        if params[i].structured is not None:
            assert out.finish_reason == "stop", out.text
            _check(out.text, SCHEMAS[i % len(SCHEMAS)])
