"""Shared timing helpers for the GPU benchmarks (CUDA-event timing, median of many samples)."""

from __future__ import annotations

import json
import math
import statistics

import torch

# GPU clock cycles the stream spins before a queued-ahead sample (about 100 us at the H100's 1.98 GHz): longer than
# the host takes to enqueue the start event and fn's work.
QUEUE_AHEAD_CYCLES = 200_000


def time_fn(fn, iters: int, warmup: int = 5, queue_ahead: bool = False) -> float:
    """Median milliseconds of fn() over iters samples, measured with CUDA events.

    queue_ahead: the stream first spins (torch.cuda._sleep), so that the start event and fn's work are already queued
    when the GPU reaches them. Then a sample is the GPU's time alone; otherwise it also holds the time the host takes
    to submit fn's work after the start event (some microseconds: a real cost of an eager call, not of a kernel)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        if queue_ahead:
            torch.cuda._sleep(QUEUE_AHEAD_CYCLES)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def add_decode_attention_options(parser) -> None:
    """The decode attention kernel's settings an engine benchmark can change for a comparison
    (apply_decode_attention_options sets them before the engine captures its graphs)."""
    parser.add_argument(
        "--decode-min-chunk",
        type=int,
        default=0,
        help="decode attention's shortest chunk in tokens (0: the kernel's default), set before the graphs",
    )
    parser.add_argument(
        "--decode-max-splits",
        type=int,
        default=0,
        help="the most chunks decode attention cuts a sequence into at any length (0: the kernel's rule, "
        "decode_max_splits), set before the graphs",
    )
    parser.add_argument(
        "--decode-afresh",
        action="store_true",
        help="decode attention starts each work item's pipeline afresh (not run on from the item before), for comparison",
    )
    parser.add_argument(
        "--decode-search",
        action="store_true",
        help="decode attention searches the chunk offsets for each work item (not the plan's chunk records), for "
        "comparison",
    )


def apply_decode_attention_options(args) -> None:
    from fastqwen.config import resolve_kv_cache_dtype
    from fastqwen.ops._native import native
    from fastqwen.ops.kv_fp8 import is_fp8

    if args.decode_afresh:
        native().set_paged_attention_decode_prefetch_next(False)
    if args.decode_search:
        native().set_paged_attention_decode_item_records(False)
    if args.decode_max_splits:
        native().set_paged_attention_decode_max_splits(args.decode_max_splits)
    if args.decode_min_chunk:
        kv_fp8 = is_fp8(resolve_kv_cache_dtype(args.kv_cache_dtype, torch.bfloat16))  # (auto: the model's 16-bit type)
        native().set_paged_attention_decode_min_chunk(kv_fp8, args.decode_min_chunk)


def interleaved_medians(graphs: dict, iters: int, rounds: int, settle_ms: float = 0.0) -> dict:
    """Median milliseconds of each CUDA graph's replay (time_fn, queued ahead) over `rounds` rounds in which the graphs
    take turns: a drift of the GPU's clock during the run then reaches each alike, where timing one after the other
    let a kernel and its reference meet different clocks (the 16k cuDNN prefill moved 569-638 TFLOP/s between calls).

    settle_ms: before its samples, each graph replays untimed for about that long (its warm-up count from a first
    replay's time), so that the clocks settle to its own load: under the power cap, what runs right after a lighter
    kernel meets clocks that have recovered meanwhile (a prefill timed right after the tensor-core kernel gained 5-8%,
    H100, 2026-11-28)."""
    samples = {name: [] for name in graphs}
    warmups = dict.fromkeys(graphs, 5)
    if settle_ms > 0:
        for name, graph in graphs.items():
            once = time_fn(graph.replay, 1, warmup=1, queue_ahead=True)
            warmups[name] = max(5, math.ceil(settle_ms / once)) if once > 0 else 5
    for _ in range(rounds):
        for name, graph in graphs.items():
            samples[name].append(time_fn(graph.replay, iters, warmup=warmups[name], queue_ahead=True))
    return {name: statistics.median(values) for name, values in samples.items()}


def copy_bandwidth(iters: int, queue_ahead: bool = True) -> float:
    """GB/s of a 1 GiB device-to-device copy, counting read + write (GPU time: queued ahead, see time_fn)."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.empty_like(src)
    ms = time_fn(lambda: dst.copy_(src), iters, queue_ahead=queue_ahead)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / (ms * 1e-3) / 1e9


def graph_of(fn) -> torch.cuda.CUDAGraph:
    """fn captured in a CUDA graph (after one warm-up run): replays time the GPU work without launch gaps."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def hf_model_like(preset: str, device: str, max_positions: int = 8192):
    """Hugging Face's Qwen3ForCausalLM with a preset's shapes and its own random bf16 weights: the baseline."""
    from fastqwen.config import ModelConfig
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = ModelConfig.from_preset(preset)
    hf_cfg = Qwen3Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        tie_word_embeddings=cfg.tie_word_embeddings,
        max_position_embeddings=max_positions,
    )
    torch.set_default_dtype(torch.bfloat16)  # build in bf16 directly: an fp32 8B model would not fit beside ours
    try:
        with torch.device(device):
            return Qwen3ForCausalLM(hf_cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)


def report(result: dict, json_path: str | None) -> None:
    """Print a benchmark's result and, if asked, write it as JSON."""
    print(json.dumps(result, indent=1))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)


# Kernel families of a prefill or decode step, by the names the profiler gives kernels (ours from csrc/, cuBLAS's
# GEMMs, PyTorch's own): the first family whose words the name holds.
# (The all-reduce before the norms: one_shot_add_rms_norm_kernel is the all-reduce fused with the norm.)
KERNEL_FAMILIES = [
    ("attention", ("prefill_hopper_kernel", "prefill_kernel", "decode_kernel", "merge_kernel", "plan_kernel")),
    ("projections", ("gemm", "gemv", "nvjet", "xmma", "cutlass", "cublas", "quantize_kernel")),
    ("all-reduce", ("one_shot", "lamport_kernel", "nccl")),
    ("norms + rope/kv", ("rms_norm", "qk_norm_rope")),
    ("activation", ("silu_and_mul",)),
    ("sampler", ("scan_kernel", "finish_kernel")),
]


def kernel_family(name: str) -> str:
    """The family of a kernel by its profiler name (KERNEL_FAMILIES), or "other" (copies, fills, elementwise ops)."""
    lowered = name.lower()
    for family, words in KERNEL_FAMILIES:
        if any(word in lowered for word in words):
            return family
    return "other"


def family_times(events) -> dict[str, dict]:
    """GPU milliseconds and kernel counts per family of profiler CUDA events (each with .name and .device_time in us),
    largest first."""
    families: dict[str, dict] = {}
    for e in events:
        entry = families.setdefault(kernel_family(e.name), {"ms": 0.0, "kernels": 0})
        entry["ms"] += e.device_time / 1e3
        entry["kernels"] += 1
    return dict(sorted(families.items(), key=lambda item: -item[1]["ms"]))


def idle_gaps(events, least_us: float = 20.0) -> dict:
    """Where the GPU ran no kernel between the first kernel's start and the last one's end, from profiler CUDA events
    (.time_range.start / .end in us): the idle milliseconds in all, and the gaps of least_us or more (count, sum,
    the five longest with how far into the span each began)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    if not spans:
        return {"span_ms": 0.0, "idle_ms": 0.0, "gaps": 0, "gaps_ms": 0.0, "longest": []}
    gaps, reach = [], spans[0][1]
    for start, end in spans[1:]:
        if start > reach:
            gaps.append((start - reach, reach - spans[0][0]))
        reach = max(reach, end)
    long_gaps = sorted((g for g in gaps if g[0] >= least_us), reverse=True)
    return {
        "span_ms": round((reach - spans[0][0]) / 1e3, 3),
        "idle_ms": round(sum(g[0] for g in gaps) / 1e3, 3),
        "gaps": len(long_gaps),
        "gaps_ms": round(sum(g[0] for g in long_gaps) / 1e3, 3),
        "longest": [{"us": round(g, 1), "at_ms": round(at / 1e3, 3)} for g, at in long_gaps[:5]],
    }


def per_decode_step(whole: dict[str, dict], prefill_only: dict[str, dict], steps: int) -> dict[str, dict]:
    """Each family's GPU microseconds and kernels per decode step (family_times of a request that decoded `steps`
    tokens after its first, less those of a request of the same prompt length that stopped at its first token: what
    the prefill and the first token cost drops out), largest first."""
    rows = {}
    for family, entry in whole.items():
        before = prefill_only.get(family, {"ms": 0.0, "kernels": 0})
        rows[family] = {
            "us": round((entry["ms"] - before["ms"]) * 1e3 / steps, 2),
            "kernels": round((entry["kernels"] - before["kernels"]) / steps, 2),
        }
    return dict(sorted(rows.items(), key=lambda item: -item[1]["us"]))


def attention_by_chunk(events, prompt: int, chunk: int, heads: int, head_dim: int) -> list[dict]:
    """The attention kernels of one chunked causal prefill of `prompt` tokens in chunks of `chunk`, per chunk: GPU
    milliseconds and TFLOP/s. events: profiler CUDA events (.name, .device_time in us, .time_range.start), in any
    order; a chunk's layers launch one attention kernel each, one chunk after the other, so the attention events in
    launch order split into equal groups. Chunk i holds c new queries on p cached keys: 4 * heads * head_dim * (c * p +
    c * (c + 1) / 2) FLOPs a layer. Only the prefill kernels count: the last layer attends for the sampling rows
    alone, with the decode kernel, or not at all (model/qwen3.py), so a chunk has a prefill kernel per layer but that
    one."""
    calls = sorted((e for e in events if "prefill" in e.name), key=lambda e: e.time_range.start)
    n_chunks = -(-prompt // chunk)
    if not calls or len(calls) % n_chunks:
        return []
    layers = len(calls) // n_chunks
    rows = []
    for i in range(n_chunks):
        prefix, new = i * chunk, min(chunk, prompt - i * chunk)
        ms = sum(e.device_time for e in calls[i * layers : (i + 1) * layers]) / 1e3
        flops = layers * 4 * heads * head_dim * (new * prefix + new * (new + 1) / 2)
        rows.append({"prefix": prefix, "new": new, "ms": round(ms, 3), "tflops": round(flops / (ms * 1e9), 1)})
    return rows
