"""GPU microbenchmarks of the norm and RoPE/KV kernels at Qwen3-8B sizes, against the PyTorch references.

For each op and token count: the median time per call of our kernel, of the reference in eager PyTorch and of the
reference under torch.compile, each captured in a CUDA graph over enough rotating buffers that the inputs exceed
twice the L2 (so the figure is HBM traffic, not cache hits, and launch gaps are out), plus our kernel launched from
Python one call at a time. Bandwidth counts each compulsory byte once (inputs read, outputs written) and is
compared with a device-to-device copy measured in the same run. The attention rows run on a bf16 and on an FP8 (e4m3)
KV pool (--kv-dtypes); an FP8 row counts the bytes it actually reads, one per cached entry. A decode case is
BATCH:TOKENS, or BATCH:LO-HI for sequences of lengths spread evenly over LO..HI (parse_decode_case), the shape of a
saturated server's batch (issue 47: 256 to 512 sequences of 100 to 1,200 tokens).

    python bench/kernels.py [--tokens 1 16 256 4096 16384] [--json out.json]
    python bench/kernels.py --ops decode --decode-cases 256:640 512:100-1200 [--kv-dtypes bf16 fp8]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from dataclasses import dataclass

import torch
from common import copy_bandwidth, graph_of, interleaved_medians, time_fn
from fastqwen.ops import (
    decode_workspace,
    fused_add_rms_norm,
    paged_attention_decode,
    paged_attention_prefill,
    plan_decode,
    qk_norm_rope_store_kv,
    rms_norm,
    rope_cos_sin_cache,
)
from fastqwen.ops._native import has_cuda_kernels, native
from fastqwen.ops.attention import (
    paged_attention_decode_reference,
    paged_attention_prefill_reference,
    prefill_uses_hopper_kernel,
    set_hopper_prefill,
)
from fastqwen.ops.kv_fp8 import quantize_kv
from fastqwen.ops.norm import rms_norm_reference
from fastqwen.ops.rope_kv import apply_rope_reference
from sampling_bench import bench_sample_cases, print_sample_rows

L2_BYTES = 50 * 1024 * 1024
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, PAGE = 4096, 32, 8, 128, 16  # Qwen3-8B
EPS = 1e-6
DT = torch.bfloat16


def fused_reference(x, residual, weight):
    residual.add_(x)
    x.copy_(rms_norm_reference(residual, weight, EPS))


def qk_reference(qkv, qw, kw, cos_sin, positions, k_flat, v_flat, slots, q_out):
    """The reference without the padding mask (every slot valid), so that torch.compile sees static shapes."""
    t = qkv.shape[0]
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=1)
    rows = cos_sin[positions]
    q_out.copy_(apply_rope_reference(rms_norm_reference(q.reshape(t, HEADS, HEAD_DIM), qw, EPS), rows))
    k = apply_rope_reference(rms_norm_reference(k.reshape(t, KV_HEADS, HEAD_DIM), kw, EPS), rows)
    k_flat.index_copy_(0, slots, k)
    v_flat.index_copy_(0, slots, v.reshape(t, KV_HEADS, HEAD_DIM))


def buffers_needed(bytes_per_call: int) -> int:
    # Capped: at a few tokens a call is launch-bound, and 1024 launches per graph replay already average it well.
    return min(1024, max(2, math.ceil(2 * L2_BYTES / bytes_per_call)))


def measure(name: str, tokens: int, bytes_per_call: int, nbuf: int, variants: dict, copy_gbs: float, iters: int):
    row = {"op": name, "tokens": tokens, "bytes_per_call": bytes_per_call, "buffers": nbuf}
    for label, fn in variants.items():
        graph = graph_of(fn)
        us = time_fn(graph.replay, iters, queue_ahead=True) / nbuf * 1e3
        del graph
        row[f"{label}_us"] = us
        row[f"{label}_gbs"] = bytes_per_call / (us * 1e-6) / 1e9
        row[f"{label}_frac_copy"] = row[f"{label}_gbs"] / copy_gbs
    row["ours_eager_us"] = time_fn(variants["ours"], max(10, iters // 5)) / nbuf * 1e3
    row["speedup_vs_compiled"] = row["compiled_us"] / row["ours_us"]
    return row


def bench_norms(tokens: int, copy_gbs: float, iters: int) -> list[dict]:
    weight = torch.randn(HIDDEN, device="cuda", dtype=DT)
    out_rows = []
    compiled_norm = torch.compile(rms_norm_reference)
    compiled_fused = torch.compile(fused_reference)
    # rms_norm: read x, write out (the weight stays in L2 and is not counted).
    per = 2 * tokens * HIDDEN * 2
    nbuf = buffers_needed(per)
    xs = torch.randn(nbuf, tokens, HIDDEN, device="cuda", dtype=DT)
    outs = torch.empty_like(xs)
    rms_norm(xs[0], weight, EPS, out=outs[0])
    torch.testing.assert_close(outs[0], rms_norm_reference(xs[0], weight, EPS), rtol=2e-2, atol=2e-2)
    variants = {
        "ours": lambda: [rms_norm(xs[i], weight, EPS, out=outs[i]) for i in range(nbuf)],
        "eager": lambda: [outs[i].copy_(rms_norm_reference(xs[i], weight, EPS)) for i in range(nbuf)],
        "compiled": lambda: [outs[i].copy_(compiled_norm(xs[i], weight, EPS)) for i in range(nbuf)],
    }
    out_rows.append(measure("rms_norm", tokens, per, nbuf, variants, copy_gbs, iters))
    del xs, outs
    # fused_add_rms_norm: read x and residual, write both.
    per = 4 * tokens * HIDDEN * 2
    nbuf = buffers_needed(per)
    xs = torch.randn(nbuf, tokens, HIDDEN, device="cuda", dtype=DT)
    res = torch.randn(nbuf, tokens, HIDDEN, device="cuda", dtype=DT)
    variants = {
        "ours": lambda: [fused_add_rms_norm(xs[i], res[i], weight, EPS) for i in range(nbuf)],
        "eager": lambda: [fused_reference(xs[i], res[i], weight) for i in range(nbuf)],
        "compiled": lambda: [compiled_fused(xs[i], res[i], weight) for i in range(nbuf)],
    }
    out_rows.append(measure("fused_add_rms_norm", tokens, per, nbuf, variants, copy_gbs, iters))
    del xs, res
    torch.cuda.empty_cache()
    return out_rows


def bench_qk(tokens: int, copy_gbs: float, iters: int) -> dict:
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    # Read qkv, the cos/sin row, position and slot; write q, k and v.
    per = tokens * (width * 2 * 2 + HEAD_DIM * 4 + 16)
    nbuf = buffers_needed(per)
    qkv = torch.randn(nbuf, tokens, width, device="cuda", dtype=DT)
    q_out = torch.empty(nbuf, tokens, HEADS, HEAD_DIM, device="cuda", dtype=DT)
    cos_sin = rope_cos_sin_cache(HEAD_DIM, 40960, 1e6, torch.device("cuda"))
    positions = torch.randint(0, 40960, (nbuf, tokens), device="cuda")
    pages = -(-tokens // PAGE) * nbuf
    k_cache = torch.zeros(pages, PAGE, KV_HEADS, HEAD_DIM, device="cuda", dtype=DT)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(pages * PAGE, device="cuda")[: nbuf * tokens].view(nbuf, tokens)
    qw = 1 + 0.1 * torch.randn(HEAD_DIM, device="cuda", dtype=DT)
    kw = 1 + 0.1 * torch.randn(HEAD_DIM, device="cuda", dtype=DT)
    k_flat, v_flat = k_cache.view(-1, KV_HEADS, HEAD_DIM), v_cache.view(-1, KV_HEADS, HEAD_DIM)
    compiled = torch.compile(qk_reference)

    def ours():
        for i in range(nbuf):
            qk_norm_rope_store_kv(qkv[i], qw, kw, cos_sin, positions[i], k_cache, v_cache, slots[i], EPS, q_out[i])

    variants = {
        "ours": ours,
        "eager": lambda: [
            qk_reference(qkv[i], qw, kw, cos_sin, positions[i], k_flat, v_flat, slots[i], q_out[i]) for i in range(nbuf)
        ],
        "compiled": lambda: [
            compiled(qkv[i], qw, kw, cos_sin, positions[i], k_flat, v_flat, slots[i], q_out[i]) for i in range(nbuf)
        ],
    }
    row = measure("qk_norm_rope_store_kv", tokens, per, nbuf, variants, copy_gbs, iters)
    del qkv, q_out, k_cache, v_cache
    torch.cuda.empty_cache()
    return row


# A decode case: "BATCH:TOKENS" (every sequence TOKENS long) or "BATCH:LO-HI" (lengths spread evenly over LO..HI,
# mean (LO + HI) / 2, in a shuffled order fixed by DECODE_LENGTH_SEED): what a saturated server holds once requests
# of one prompt and output length arrive continuously, each at its own point of generation.
DECODE_CASES = ["64:4096", "1:16384", "256:512", "1:128", "16:4096"]
DECODE_LENGTH_SEED = 0
KV_DTYPES = ("bf16", "fp8")  # the KV pool: the model's bf16, or e4m3 (one byte an entry)


@dataclass(frozen=True)
class DecodeCase:
    label: str  # as written on the command line
    lengths: tuple[int, ...]  # cached tokens of each sequence, in batch order

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def uniform(self) -> bool:
        return min(self.lengths) == max(self.lengths)


def parse_decode_case(spec: str) -> DecodeCase:
    """A case from BATCH:TOKENS or BATCH:LO-HI (see DECODE_CASES); argparse.ArgumentTypeError says what is wrong."""
    batch_text, sep, tokens_text = spec.partition(":")
    lo_text, dash, hi_text = tokens_text.partition("-")
    try:
        batch, lo = int(batch_text), int(lo_text)
        hi = int(hi_text) if dash else lo
    except ValueError:
        batch = lo = hi = None
    if not sep or batch is None:
        raise argparse.ArgumentTypeError(f"decode case {spec!r}: expected BATCH:TOKENS or BATCH:LO-HI (integers)")
    if batch < 1 or lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"decode case {spec!r}: needs BATCH >= 1 and 1 <= LO <= HI")
    if lo == hi:
        return DecodeCase(spec, (lo,) * batch)
    if batch < 2:
        raise argparse.ArgumentTypeError(f"decode case {spec!r}: lengths spread over LO-HI need BATCH >= 2")
    # Evenly spread: sequence i of the sorted batch holds lo + round((hi - lo) * i / (batch - 1)) tokens.
    lengths = [lo + round((hi - lo) * i / (batch - 1)) for i in range(batch)]
    random.Random(DECODE_LENGTH_SEED).shuffle(lengths)
    return DecodeCase(spec, tuple(lengths))


def decode_bytes(lengths, kv: str) -> int:
    """Bytes one decode-attention call must move: K and V of every cached token at the pool's width (2 bytes an
    entry, 1 for FP8), q read and the output written in bf16."""
    kv_bytes = sum(lengths) * KV_HEADS * HEAD_DIM * 2 * (1 if kv == "fp8" else 2)
    return kv_bytes + 2 * len(lengths) * HEADS * HEAD_DIM * 2


def scattered_page_tables(lengths, copies: int) -> tuple[torch.Tensor, int]:
    """Page tables of `copies` batches of sequences of these lengths over one pool that holds exactly their pages, in
    a random order: int32 [copies, batch, most pages of a sequence] (entries past a sequence's pages stay 0, never
    read), and the pool's page count."""
    pages_of = torch.tensor([-(-n // PAGE) for n in lengths])
    pool_pages = copies * int(pages_of.sum())
    order = torch.randperm(pool_pages).to(torch.int32)
    tables = torch.zeros(copies, len(lengths), int(pages_of.max()), dtype=torch.int32)
    tables[:, torch.arange(tables.shape[2])[None, :] < pages_of[:, None]] = order.view(copies, -1)
    return tables, pool_pages


def kv_pool(pages: int, kv: str) -> tuple[torch.Tensor, torch.Tensor]:
    k_cache = torch.randn(pages, PAGE, KV_HEADS, HEAD_DIM, device="cuda", dtype=DT)
    v_cache = torch.randn_like(k_cache)
    if kv == "fp8":
        k_cache, v_cache = quantize_kv(k_cache, 1.0), quantize_kv(v_cache, 1.0)
    return k_cache, v_cache


# Settings of the decode kernel a row can be timed with beside the default (--decode-compare): each is a setter of
# the extension, the value that differs from the default (set while the other graph is planned and captured) and the
# default it is set back to.
DECODE_SETTINGS = {
    "afresh": ("set_paged_attention_decode_prefetch_next", False, True),  # each item's pipeline started afresh
    "search": ("set_paged_attention_decode_item_records", False, True),  # each item searched in the offsets
    "splits32": ("set_paged_attention_decode_max_splits", 32, 0),  # up to 32 chunks a sequence, not SMs / KV heads
}


def bench_decode(case: DecodeCase, copy_gbs: float, iters: int, kv: str = "bf16", compare: str | None = None) -> dict:
    """Paged decode attention, Qwen3-8B heads, page 16, each sequence's pages scattered over the pool (which holds
    just the pages the sequences use). Bandwidth counts the bytes actually read and written (decode_bytes).
    compare: also time the kernel with that setting of DECODE_SETTINGS (planned and captured with it), the two in
    turns over three rounds (medians; keys <compare>_*)."""
    batch = case.batch
    per = decode_bytes(case.lengths, kv)
    nbuf = buffers_needed(per)
    tables, pool_pages = scattered_page_tables(case.lengths, nbuf)
    k_cache, v_cache = kv_pool(pool_pages, kv)
    tables = tables.cuda()
    lens = torch.tensor(case.lengths, dtype=torch.int32, device="cuda")
    qs = torch.randn(nbuf, batch, HEADS, HEAD_DIM, device="cuda", dtype=DT)
    outs = torch.empty_like(qs)
    # The engine plans the split once per step for all layers: planned outside the timed calls.
    workspace = decode_workspace(batch, HEADS, torch.device("cuda"))
    plan_decode(lens, workspace, k_cache)
    chunks = workspace.split_offsets[: batch + 1].tolist()
    scale = HEAD_DIM**-0.5
    paged_attention_decode(qs[0], k_cache, v_cache, tables[0], lens, scale, outs[0], workspace, planned=True)
    want = paged_attention_decode_reference(qs[0], k_cache, v_cache, tables[0], lens, scale)
    torch.testing.assert_close(outs[0].float(), want.float(), rtol=2e-2, atol=2e-2)
    del want
    ref_buffers = min(nbuf, 4)  # the reference gathers every page into fresh tensors: far slower, fewer calls
    variants = {
        "ours": lambda: [
            paged_attention_decode(qs[i], k_cache, v_cache, tables[i], lens, scale, outs[i], workspace, planned=True)
            for i in range(nbuf)
        ],
    }
    total = sum(case.lengths)
    row = {
        "op": "paged_attention_decode",
        "kv_dtype": kv,
        "case": case.label,
        "batch": batch,
        "tokens": case.lengths[0] if case.uniform else None,  # every sequence's length; None where they differ
        "min_tokens": min(case.lengths),
        "max_tokens": max(case.lengths),
        "mean_tokens": total / batch,
        "splits": max(b - a for a, b in zip(chunks, chunks[1:])),  # the most chunks of one sequence
        "chunks": chunks[-1] - chunks[0],  # of all sequences
        "buffers": nbuf,
        "bytes_per_call": per,
    }
    if compare:
        graphs = {"ours": graph_of(variants["ours"])}
        setter, value, default = DECODE_SETTINGS[compare]
        other = decode_workspace(batch, HEADS, torch.device("cuda"))
        getattr(native(), setter)(value)  # read at planning and at launch: the graph keeps it
        try:
            plan_decode(lens, other, k_cache)
            graphs[compare] = graph_of(
                lambda: [
                    paged_attention_decode(
                        qs[i], k_cache, v_cache, tables[i], lens, scale, outs[i], other, planned=True
                    )
                    for i in range(nbuf)
                ]
            )
        finally:
            getattr(native(), setter)(default)
        times = {name: [] for name in graphs}
        for _ in range(3):
            for name, g in graphs.items():
                times[name].append(time_fn(g.replay, iters, queue_ahead=True) / nbuf * 1e3)
        del graphs
        us = statistics.median(times["ours"])
        row[f"{compare}_us"] = statistics.median(times[compare])
        row[f"{compare}_frac_copy"] = per / (row[f"{compare}_us"] * 1e-6) / 1e9 / copy_gbs
        row["rounds_us"] = times
    else:
        graph = graph_of(variants["ours"])
        us = time_fn(graph.replay, iters, queue_ahead=True) / nbuf * 1e3
        del graph
    row["ours_us"] = us
    row["ours_gbs"] = per / (us * 1e-6) / 1e9
    row["ours_frac_copy"] = row["ours_gbs"] / copy_gbs

    def ref():
        return [
            paged_attention_decode_reference(qs[i], k_cache, v_cache, tables[i], lens, scale)
            for i in range(ref_buffers)
        ]

    row["reference_us"] = time_fn(ref, max(5, iters // 10)) / ref_buffers * 1e3
    del k_cache, v_cache, qs, outs
    torch.cuda.empty_cache()
    return row


# (sequences, new tokens, cached prefix): single prompts of 4k to 32k, 4 x 4k, extends (512 on 4k; 2k on 30k, a
# multi-turn agent's turn), and a batch of short prompts.
PREFILL_CASES = [
    (1, 4096, 0),
    (1, 8192, 0),
    (1, 16384, 0),
    (1, 32768, 0),
    (4, 4096, 0),
    (1, 512, 4096),
    (1, 2048, 30720),
    (8, 512, 0),
]


def parse_prefill_case(spec: str) -> tuple[int, int, int]:
    """SEQUENCES:NEW[:PREFIX], e.g. 1:16384 or 1:2048:30720."""
    parts = spec.split(":")
    try:
        numbers = [int(x) for x in parts]
    except ValueError:
        numbers = []
    if len(numbers) not in (2, 3) or min(numbers) < 0 or numbers[0] < 1 or numbers[1] < 1:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected SEQUENCES:NEW[:PREFIX], e.g. 1:16384 or 1:2048:30720")
    return numbers[0], numbers[1], numbers[2] if len(numbers) == 3 else 0


# The best kernels on the same GPU, through PyTorch's scaled_dot_product_attention: FlashAttention-2 and cuDNN's.
SDPA_BACKENDS = ("flash", "cudnn")
# csrc/attention_prefill_hopper.cu: set_paged_attention_prefill_hopper_variant 0..HOPPER_VARIANTS - 1 (none without it)
HOPPER_VARIANTS = getattr(native(), "PREFILL_HOPPER_VARIANTS", 0)


@dataclass
class PrefillCase:
    """A prefill case's paged inputs over `nbuf` buffers (pages of 16, scattered over one pool): `run()` calls the
    kernel on each buffer, `flops` counts 4 * H * D * (keys each query sees, summed)."""

    batch: int
    new: int
    prefix: int
    nbuf: int
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    tables: torch.Tensor
    lens: torch.Tensor
    starts: torch.Tensor
    qs: torch.Tensor
    outs: torch.Tensor
    scale: float = HEAD_DIM**-0.5

    @property
    def flops(self) -> int:
        return 4 * HEADS * HEAD_DIM * self.batch * sum(self.prefix + i + 1 for i in range(self.new))

    def call(self, i: int) -> None:
        paged_attention_prefill(
            self.qs[i],
            self.k_cache,
            self.v_cache,
            self.starts,
            self.tables[i],
            self.lens,
            self.scale,
            self.outs[i],
            self.new,
        )

    def run(self) -> None:
        for i in range(self.nbuf):
            self.call(i)


def prefill_case(batch: int, new: int, prefix: int, kv: str = "bf16", nbuf: int = 2) -> PrefillCase:
    total = prefix + new
    pages_each = -(-total // PAGE)
    pool_pages = nbuf * batch * pages_each
    k_cache, v_cache = kv_pool(pool_pages, kv)
    qs = torch.randn(nbuf, batch * new, HEADS, HEAD_DIM, device="cuda", dtype=DT)
    return PrefillCase(
        batch,
        new,
        prefix,
        nbuf,
        k_cache,
        v_cache,
        tables=torch.randperm(pool_pages, device="cuda").to(torch.int32).view(nbuf, batch, pages_each),
        lens=torch.full((batch,), total, dtype=torch.int32, device="cuda"),
        starts=torch.arange(batch + 1, dtype=torch.int32, device="cuda") * new,
        qs=qs,
        outs=torch.empty_like(qs),
    )


def sdpa_prefill_graphs(case: PrefillCase, names=SDPA_BACKENDS) -> tuple[dict, dict, tuple]:
    """The same attention through PyTorch SDPA's backends (`names` of SDPA_BACKENDS), contiguous [B, H, S, D] with K/V
    expanded to all heads, bottom-right causal for an extend: {name: CUDA graph of nbuf calls}, and {name: error} for
    a backend that refuses the shape or mask, and the graphs' inputs, which the caller keeps while it replays them."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    total = case.prefix + case.new
    q = torch.randn(case.nbuf, case.batch, HEADS, case.new, HEAD_DIM, device="cuda", dtype=DT)
    k = torch.randn(case.nbuf, case.batch, HEADS, total, HEAD_DIM, device="cuda", dtype=DT)
    v = torch.randn_like(k)
    if case.prefix == 0:
        mask_kw = {"is_causal": True}
    else:
        from torch.nn.attention.bias import causal_lower_right

        mask_kw = {"attn_mask": causal_lower_right(case.new, total)}
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    graphs, errors = {}, {}
    for name in names:
        try:
            with sdpa_kernel(backends[name]):
                graphs[name] = graph_of(
                    lambda: [
                        torch.nn.functional.scaled_dot_product_attention(q[i], k[i], v[i], **mask_kw)
                        for i in range(case.nbuf)
                    ]
                )
        except RuntimeError as e:
            errors[name] = str(e)[:200]
    return graphs, errors, (q, k, v, mask_kw)


def bench_prefill(
    batch: int,
    new: int,
    prefix: int,
    iters: int,
    kv: str = "bf16",
    variants: list[int] | None = None,
    rounds: int = 3,
    settle_ms: float = 200.0,
) -> dict:
    """Causal prefill / extend attention, Qwen3-8B heads, page 16, pages scattered (prefill_case); against PyTorch's
    scaled_dot_product_attention (flash and cuDNN backends, sdpa_prefill_graphs) on the bf16 rows. Compute-bound:
    TFLOP/s of PrefillCase.flops. Our default, the references and the comparison rows (the tensor-core kernel, one
    block per work item, the pipelines) take turns over `rounds` rounds, each settled for settle_ms before its
    samples, each figure their median (common.interleaved_medians). variants: the Hopper kernel's pipelines to time
    (default: all; an FP8 cache times those of 0, 2, 8, 10 it runs)."""
    case = prefill_case(batch, new, prefix, kv)
    nbuf, flops, total = case.nbuf, case.flops, prefix + new
    want = torch.empty_like(case.qs[0])
    case.call(0)
    checked = batch * new * total <= 8 * 4096 * 4096
    if checked:
        paged_attention_prefill_reference(
            case.qs[0], case.k_cache, case.v_cache, case.starts, case.tables[0], case.lens, case.scale, want
        )
        torch.testing.assert_close(case.outs[0].float(), want.float(), rtol=2e-2, atol=2e-2)

    def captured_with(switch, value, restore=None) -> torch.cuda.CUDAGraph:
        """case.run's graph captured with a process-wide kernel switch set to value (the graph keeps the kernel it was
        captured with), then the switch back (to restore, or to what it returned)."""
        previous = switch(value)
        try:
            return graph_of(case.run)
        finally:
            switch(previous if restore is None else restore)

    # Every figure of the row takes turns with the others (interleaved_medians, each graph settled first): the
    # comparison rows timed one after the other, outside the turns, met other clocks (the one timed right after the
    # tensor-core kernel gained 5-8% on an H100).
    graphs = {"ours": graph_of(case.run)}
    errors: dict[str, str] = {}
    sdpa_inputs: tuple = ()  # (kept alive while the graphs replay)
    if kv == "bf16":
        sdpa_graphs, errors, sdpa_inputs = sdpa_prefill_graphs(case)
        graphs.update(sdpa_graphs)
    hopper = prefill_uses_hopper_kernel(case.qs[0], case.k_cache)
    default_variant = None
    if hopper:  # the tensor-core kernel (csrc/attention_prefill.cu) on the same inputs, and one block per work item
        graphs["tensor_cores"] = captured_with(set_hopper_prefill, False)
        # (the persistent switch's setter returns nothing: back to persistent)
        graphs["one_block_per_tile"] = captured_with(
            native().set_paged_attention_prefill_hopper_persistent, False, restore=True
        )
        # The pipelines: bit 0 softmax overlapped with the previous P V, bit 1 warpgroups taking turns, bit 2 three
        # K/V stages, bit 3 a dynamic schedule, bit 4 Q copied by the producer. Each one's output is checked against
        # the reference before it is captured.
        default_variant = native().set_paged_attention_prefill_hopper_variant(0)
        try:
            # An FP8 cache runs the 2-stage pipelines without overlap whatever the variant (bits 1 and 3 only).
            runs = range(HOPPER_VARIANTS) if kv == "bf16" else (0, 2, 8, 10)
            for variant in [v for v in runs if variants is None or v in variants]:
                native().set_paged_attention_prefill_hopper_variant(variant)
                if checked:
                    case.outs[0].fill_(float("nan"))
                    case.call(0)
                    torch.testing.assert_close(case.outs[0].float(), want.float(), rtol=2e-2, atol=2e-2)
                graphs[f"variant{variant}"] = graph_of(case.run)
        finally:
            native().set_paged_attention_prefill_hopper_variant(default_variant)
    medians = interleaved_medians(graphs, iters, rounds, settle_ms)
    graphs.clear()
    del sdpa_inputs
    torch.cuda.empty_cache()
    us = medians["ours"] / nbuf * 1e3
    row = {
        "op": "paged_attention_prefill",
        "kv_dtype": kv,
        "batch": batch,
        "new_tokens": new,
        "prefix": prefix,
        "flops": flops,
        "rounds": rounds,
        "kernel": "hopper" if prefill_uses_hopper_kernel(case.qs[0], case.k_cache) else "tensor_cores",
        "ours_us": us,
        "ours_tflops": flops / (us * 1e-6) / 1e12,
    }
    for name in SDPA_BACKENDS:
        if kv != "bf16":
            row[f"sdpa_{name}_error"] = "compared on the bf16 rows only"
        elif name in errors:
            row[f"sdpa_{name}_error"] = errors[name]
        else:
            sdpa_us = medians[name] / nbuf * 1e3
            row[f"sdpa_{name}_us"] = sdpa_us
            row[f"sdpa_{name}_tflops"] = flops / (sdpa_us * 1e-6) / 1e12
            row[f"ours_vs_{name}"] = row["ours_tflops"] / row[f"sdpa_{name}_tflops"]
    if hopper:
        for name, key in [("tensor_cores", "tensor_cores"), ("one_block_per_tile", "hopper_one_block_per_tile")]:
            row[f"{key}_us"] = medians[name] / nbuf * 1e3
            row[f"{key}_tflops"] = flops / (row[f"{key}_us"] * 1e-6) / 1e12
        for name in [n for n in medians if n.startswith("variant")]:
            row[f"hopper_{name}_tflops"] = flops / (medians[name] / nbuf * 1e-3) / 1e12
        row["hopper_default_variant"] = default_variant
    del case, want
    torch.cuda.empty_cache()
    return row


def matmul_tflops(iters: int) -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=DT)
    b = torch.randn(8192, 8192, device="cuda", dtype=DT)
    ms = time_fn(lambda: a @ b, iters)
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 4096, 8192, 16384])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument(
        "--ops",
        nargs="+",
        default=["norms", "qk", "decode", "prefill", "sample"],
        choices=["norms", "qk", "decode", "prefill", "sample"],
    )
    ap.add_argument(
        "--kv-dtypes", nargs="+", default=list(KV_DTYPES), choices=KV_DTYPES, help="KV pools of the attention rows"
    )
    ap.add_argument(
        "--min-chunks",
        type=int,
        nargs="*",
        default=[],
        help="also time the decode rows with these shortest chunks (tokens), for each KV pool",
    )
    ap.add_argument(
        "--decode-compare",
        choices=sorted(DECODE_SETTINGS),
        default=None,
        help="also time each decode row with this setting of the kernel (DECODE_SETTINGS), in turns with the default",
    )
    ap.add_argument(
        "--decode-cases",
        nargs="+",
        type=parse_decode_case,
        default=None,
        metavar="BATCH:TOKENS|BATCH:LO-HI",
        help="the decode rows' shapes: BATCH sequences of TOKENS cached tokens, or of lengths spread evenly over "
        f"LO..HI in a fixed shuffled order (default {' '.join(DECODE_CASES)})",
    )
    ap.add_argument(
        "--prefill-cases",
        nargs="+",
        type=parse_prefill_case,
        default=None,
        metavar="SEQUENCES:NEW[:PREFIX]",
        help="the prefill rows' shapes (default: " + " ".join(f"{b}:{n}:{p}" for b, n, p in PREFILL_CASES) + ")",
    )
    ap.add_argument(
        "--prefill-variants",
        type=int,
        nargs="+",
        choices=range(HOPPER_VARIANTS),
        default=None,
        metavar="N",
        help="time only these pipelines of the Hopper prefill kernel (default: all 32)",
    )
    ap.add_argument(
        "--prefill-rounds",
        type=int,
        default=3,
        help="rounds in which the prefill default, SDPA's backends and the comparison rows take turns (their medians "
        "are reported)",
    )
    ap.add_argument(
        "--settle-ms",
        type=float,
        default=200.0,
        help="untimed replays of each prefill graph before its samples in a round, about this long (0: 5 replays): "
        "the clocks settle to its own load under the power cap",
    )
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not has_cuda_kernels():
        print("kernels.py: needs a CUDA device and the CUDA kernels", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name()
    copy_gbs = copy_bandwidth(args.iters)
    rows = []
    for tokens in args.tokens:
        if "norms" in args.ops:
            rows += bench_norms(tokens, copy_gbs, args.iters)
        if "qk" in args.ops:
            rows.append(bench_qk(tokens, copy_gbs, args.iters))
    cases = args.decode_cases or [parse_decode_case(c) for c in DECODE_CASES]
    decode_rows = (
        [bench_decode(case, copy_gbs, args.iters, kv, args.decode_compare) for case in cases for kv in args.kv_dtypes]
        if "decode" in args.ops
        else []
    )
    if "decode" in args.ops:
        from fastqwen.ops._native import native

        for kv in args.kv_dtypes:
            for chunk in args.min_chunks:
                native().set_paged_attention_decode_min_chunk(kv == "fp8", chunk)
                for case in cases:
                    decode_rows.append({**bench_decode(case, copy_gbs, args.iters, kv), "min_chunk": chunk})
            native().set_paged_attention_decode_min_chunk(kv == "fp8", 0)  # the default
    prefill_rows = (
        [
            bench_prefill(b, n, p, args.iters, kv, args.prefill_variants, args.prefill_rounds, args.settle_ms)
            for b, n, p in args.prefill_cases or PREFILL_CASES
            for kv in args.kv_dtypes
        ]
        if "prefill" in args.ops
        else []
    )
    sample_rows = bench_sample_cases(copy_gbs, args.iters) if "sample" in args.ops else []
    tflops = matmul_tflops(args.iters)
    print(
        f"device: {device}   torch {torch.__version__}   d2d copy (read+write): {copy_gbs:.0f} GB/s   "
        f"bf16 matmul 8192^3: {tflops:.0f} TFLOP/s   bf16, Qwen3-8B sizes"
    )
    print(
        f"{'op':<22} {'tokens':>6} | {'ours us':>8} {'GB/s':>6} {'%copy':>6} {'eager1':>7} | {'eager us':>8} {'compiled us':>11} | {'vs compiled':>11}"
    )
    for r in rows:
        print(
            f"{r['op']:<22} {r['tokens']:>6} | {r['ours_us']:>8.2f} {r['ours_gbs']:>6.0f} {r['ours_frac_copy']:>6.1%} "
            f"{r['ours_eager_us']:>7.2f} | {r['eager_us']:>8.2f} {r['compiled_us']:>11.2f} | {r['speedup_vs_compiled']:>10.2f}x"
        )
    for r in decode_rows:
        print(
            f"paged_attention_decode {r['kv_dtype']:<4}{r.get('min_chunk', ''):>5} {r['case']:<13} splits {r['splits']:<3} "
            f"chunks {r['chunks']:<5} | {r['ours_us']:>8.2f} us "
            f"{r['ours_gbs']:>6.0f} GB/s {r['ours_frac_copy']:>6.1%} of copy | reference {r['reference_us']:>9.1f} us"
            + "".join(
                f" | {name} {r[f'{name}_us']:>8.2f} us {r[f'{name}_frac_copy']:>6.1%}"
                for name in DECODE_SETTINGS
                if f"{name}_us" in r
            )
        )
    for r in prefill_rows:
        sdpa = " | ".join(
            f"SDPA {name} {r[f'sdpa_{name}_us']:>8.1f} us {r[f'sdpa_{name}_tflops']:>5.0f} TFLOP/s, ours/{name} "
            f"{r[f'ours_vs_{name}']:.2f}"
            if f"sdpa_{name}_us" in r
            else f"SDPA {name}: {r.get(f'sdpa_{name}_error')}"
            for name in SDPA_BACKENDS
        )
        variants = " ".join(format(r.get(f"hopper_variant{v}_tflops", 0), ".0f") for v in range(HOPPER_VARIANTS))
        previous_kernel = (
            f" (variants {variants}, "
            f"not persistent {r['hopper_one_block_per_tile_tflops']:>4.0f}, "
            f"tensor-core kernel {r['tensor_cores_tflops']:>4.0f})"
            if "tensor_cores_tflops" in r
            else ""
        )
        print(
            f"paged_attention_prefill {r['kv_dtype']:<4} B={r['batch']:<2} new={r['new_tokens']:<5} prefix={r['prefix']:<5} | "
            f"{r['kernel']:<12} {r['ours_us']:>8.1f} us {r['ours_tflops']:>5.0f} TFLOP/s{previous_kernel} | {sdpa}"
        )
    print_sample_rows(sample_rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "bench": "kernels",
                    "device": device,
                    "torch": torch.__version__,
                    "copy_gbs": copy_gbs,
                    "matmul_tflops": tflops,
                    "rows": rows,
                    "decode": decode_rows,
                    "prefill": prefill_rows,
                    "sample": sample_rows,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
