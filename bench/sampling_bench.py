"""The sampler cases of bench/kernels.py (--ops sample): the CUDA sampler against the PyTorch reference (softmax,
sort-based top-k/top-p/min-p mask, exponential race: ops.sample's sampled-row path) and its torch.compile form, at
V = 151,936 over batch sizes, each timed in a CUDA graph over rotating logits larger than twice the L2."""

from __future__ import annotations

import math

import torch
from common import graph_of, time_fn
from fastqwen.ops.sampling import pack_sampler_rows, sample, sampler_workspace, top_k_top_p_min_p_mask

VOCAB = 151_936
L2_BYTES = 50 * 1024 * 1024
BATCHES = [1, 8, 64, 256, 512]


def reference_sample(logits, temps, top_k, top_p, min_p, out):
    """ops.draw_reference for sampled rows with no seeds: softmax(logits / T), the reference mask, argmax(p / E)."""
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    probs = probs * top_k_top_p_min_p_mask(probs, top_k, top_p, min_p)
    noise = torch.empty_like(probs).exponential_()
    out.copy_((probs / noise).argmax(dim=-1))


def _time(fn, nbuf, iters):
    """Per-call microseconds: in a CUDA graph when it captures, else eagerly (said in the result)."""
    try:
        graph = graph_of(fn)
        us = time_fn(graph.replay, iters, queue_ahead=True) / nbuf * 1e3
        del graph
        return us, "graph"
    except Exception as e:  # noqa: BLE001 - some torch versions cannot capture compiled RNG
        torch.cuda.synchronize()
        return time_fn(fn, max(5, iters // 5)) / nbuf * 1e3, f"eager ({type(e).__name__})"


def bench_sample(
    batch: int, copy_gbs: float, iters: int, top_k: int = 20, top_p: float = 0.95, temperature: float = 0.7
) -> dict:
    per = batch * VOCAB * 4  # one fp32 read of the logits: the compulsory traffic
    nbuf = min(256, max(2, math.ceil(2 * L2_BYTES / per)))
    dev = torch.device("cuda")
    logits = torch.randn(nbuf, batch, VOCAB, device=dev) * 3
    rows = pack_sampler_rows([temperature] * batch, top_k, top_p, seed=list(range(batch)), step=1).to(dev)
    tokens = torch.empty(nbuf, batch, dtype=torch.int64, device=dev)
    ws = sampler_workspace(batch, VOCAB, dev)
    temps = torch.full((batch,), temperature, device=dev)
    ks = torch.full((batch,), top_k, dtype=torch.int64, device=dev)
    ps = torch.full((batch,), top_p, device=dev)
    ms = torch.zeros(batch, device=dev)
    # The kernel draws inside the reference's kept set.
    sample(logits[0], rows, tokens[0], ws)
    probs = torch.softmax(logits[0] / temps[:, None], dim=-1)
    mask = top_k_top_p_min_p_mask(probs, ks, ps, ms)
    assert mask.gather(1, tokens[0][:, None]).all(), "kernel drew outside the reference set"
    del probs, mask
    torch._dynamo.reset()  # a fresh static-shape compile per batch size
    compiled = torch.compile(reference_sample, dynamic=False)
    ref_nbuf = min(nbuf, 8)  # the reference allocates per call; a few buffers keep its graph pool small
    row = {
        "op": "sample",
        "batch": batch,
        "vocab": VOCAB,
        "top_k": top_k,
        "top_p": top_p,
        "temperature": temperature,
        "buffers": nbuf,
        "bytes_per_call": per,
    }
    us, how = _time(lambda: [sample(logits[i], rows, tokens[i], ws) for i in range(nbuf)], nbuf, iters)
    row["ours_us"], row["ours_timing"] = us, how
    row["ours_gbs"] = per / (us * 1e-6) / 1e9
    row["ours_frac_copy"] = row["ours_gbs"] / copy_gbs
    for label, fn in (("eager", reference_sample), ("compiled", compiled)):
        try:
            us, how = _time(
                lambda: [fn(logits[i], temps, ks, ps, ms, tokens[i]) for i in range(ref_nbuf)],
                ref_nbuf,
                max(10, iters // 2),
            )
            row[f"{label}_us"], row[f"{label}_timing"] = us, how
            row[f"speedup_vs_{label}"] = us / row["ours_us"]
        except Exception as e:  # noqa: BLE001
            row[f"{label}_error"] = f"{type(e).__name__}: {e}"[:300]
        torch.cuda.empty_cache()
    del logits, tokens
    torch.cuda.empty_cache()
    return row


def bench_sample_cases(copy_gbs: float, iters: int) -> list[dict]:
    return [bench_sample(b, copy_gbs, iters) for b in BATCHES]


def print_sample_rows(rows: list[dict]) -> None:
    for r in rows:
        ref = "  ".join(
            f"{k} {r[k + '_us']:>9.1f} us ({r['speedup_vs_' + k]:.1f}x, {r[k + '_timing']})"
            if k + "_us" in r
            else f"{k}: {r.get(k + '_error')}"
            for k in ("eager", "compiled")
        )
        print(
            f"sample B={r['batch']:<4} V={r['vocab']} top_k={r['top_k']} top_p={r['top_p']} | ours {r['ours_us']:>8.1f} us "
            f"{r['ours_gbs']:>6.0f} GB/s {r['ours_frac_copy']:>6.1%} of copy | {ref}"
        )
