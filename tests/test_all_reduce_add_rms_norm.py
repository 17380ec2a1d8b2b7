"""ParallelGroup.all_reduce_add_rms_norm on the CPU: the composition of the all-reduce (gloo) and fused_add_rms_norm,
against the float64 sum and norm (tests/all_reduce_norm_reference.py), for 1, 2 and 3 ranks (threads of this
process, each with its own gloo group over one in-memory store), float32 and bfloat16, several row counts and hidden
sizes. The fused CUDA kernel's tests are in test_tensor_parallel_gpu.py; the engine's wiring in test_tensor_parallel.py.
"""

from __future__ import annotations

import datetime
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
from all_reduce_norm_reference import assert_close_to_reference
from fastqwen.ops.collectives import ParallelGroup

SIZES = [(1, 8), (3, 64), (17, 128), (64, 40)]  # (rows, hidden); 40: not a whole number of 16-byte packs
EPS = 1e-6


def inputs(world: int, rows: int, hidden: int, dtype: torch.dtype, seed: int):
    """Every rank's partial rows, the (replicated) residual and the norm weight, of unequal magnitudes."""
    g = torch.Generator().manual_seed(seed)
    partials = [(torch.randn(rows, hidden, generator=g) * (r + 1)).to(dtype) for r in range(world)]
    residual = (torch.randn(rows, hidden, generator=g) * 4).to(dtype)
    weight = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    return partials, residual, weight


def run_ranks(world: int, body):
    """body(group) on each of `world` ranks at once (threads), returning their results in rank order."""
    if world == 1:
        return [body(ParallelGroup())]
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=60))

    def rank(r: int):
        group = ParallelGroup.connect(r, world, store, torch.device("cpu"))
        assert group.custom is None and not group.fused_norm  # the CPU: the composition
        return body(group)

    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(rank, range(world)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_op_is_the_ranks_sum_added_to_the_residual_then_normalized(world, dtype):
    cases = [
        (rows, hidden, inputs(world, rows, hidden, dtype, seed=100 * world + n))
        for n, (rows, hidden) in enumerate(SIZES)
    ]

    def body(group: ParallelGroup):
        out = []
        for _, _, (partials, residual, weight) in cases:
            mine, res = partials[group.rank].clone(), residual.clone()
            normed, new_residual = group.all_reduce_add_rms_norm(mine, res, weight, EPS)
            assert normed is mine and new_residual is res, "in place: the partial becomes the normed rows"
            out.append((normed, new_residual))
        return out

    results = run_ranks(world, body)
    for n, (rows, hidden, (partials, residual, weight)) in enumerate(cases):
        normed, new_residual = results[0][n]
        for r in range(1, world):  # every rank holds the same rows
            assert torch.equal(results[r][n][0], normed) and torch.equal(results[r][n][1], new_residual)
        assert_close_to_reference(
            normed, new_residual, partials, residual, weight, EPS, world - 1, f"{world} ranks {rows}x{hidden}"
        )


def test_the_extension_refuses_a_send_it_cannot_take():
    """The sending GEMV (gemv.h kGemvSend) and the all-reduce after it check their arguments before anything touches a
    device: a GEMV with the SiLU epilogue, without a target or with more outputs than a receive slot holds; a sent
    message to the plain all-reduce, or to the fused one on buffers without receive areas; a send target of such
    buffers."""
    from fastqwen.ops._native import native

    m = native()
    if m is None or not m.built_with_cuda:
        pytest.skip("needs the extension built with the CUDA kernels")
    args = m.GemvArgs()
    args.out, args.x, args.w, args.m, args.n, args.k, args.dtype = 16, 16, 16, 1, 64, 64, m.DTYPE_BF16
    args.epilogue, args.send, args.send_capacity = m.GemvEpilogue.SEND, 64, 64
    args.silu_gate_up = True
    with pytest.raises(ValueError, match="no SiLU epilogue"):
        m.gemv_norm(args)
    args.silu_gate_up, args.send = False, 0
    with pytest.raises(ValueError, match="send must be"):
        m.gemv_norm(args)
    args.send, args.send_capacity = 64, 63
    with pytest.raises(ValueError, match="exceeds the send target's slots of 63"):
        m.gemv_norm(args)
    with pytest.raises(ValueError, match="gemv_norm's"):  # (gemv() takes the plain epilogue only)
        m.gemv(args)
    reduce = m.AllReduceArgs()
    reduce.buffers, reduce.rank, reduce.world, reduce.capacity_bytes = [4096, 8192], 0, 2, 1024
    reduce.data, reduce.numel, reduce.dtype, reduce.sent = 2048, 8, m.DTYPE_BF16, True
    with pytest.raises(ValueError, match="only custom_all_reduce_add_rms_norm takes a sent message"):
        m.custom_all_reduce(reduce)
    reduce.residual, reduce.weight, reduce.hidden = 2064, 2080, 8
    with pytest.raises(ValueError, match="a sent message needs the barrier-free path"):  # (lamport_bytes 0)
        m.custom_all_reduce_add_rms_norm(reduce)
    with pytest.raises(ValueError, match="no receive areas"):
        m.all_reduce_send_target(reduce, 4096)
