"""Batch-1 latency: time per output token after prompts of several lengths, and time to first token of a 256-token
prompt, through the offline engine and (with --url) through a running HTTP server.

Random weights with the real shapes work: `--model Qwen3-8B --load-format dummy`. The limit printed next to the
time per output token is the weight bytes (embeddings excluded) over the device-to-device copy bandwidth measured
in the same run. --hf adds Hugging Face transformers' greedy generate on the same shapes as the baseline.

    python bench/latency.py --model Qwen3-8B --load-format dummy [--url http://127.0.0.1:8000] [--hf] [--json out]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time

import torch
from common import (
    attention_by_chunk,
    copy_bandwidth,
    family_times,
    hf_model_like,
    idle_gaps,
    per_decode_step,
    report,
)
from fastqwen import LLM, SamplingParams
from fastqwen.config import EngineConfig
from serving import chunk_tokens, request_metrics


def now() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def engine_latency(llm: LLM, prompt: list[int], new_tokens: int, output: list[int] | None = None) -> dict:
    """Time to first token (from adding the request to the step that returns it), and time per output token: the
    median gap between the returns of the steps that follow. A step returns once its token is on the host, so no
    device sync is added between steps (one would stall the decode step the engine launched ahead). output, when
    given, receives the generated token ids."""
    start = now()
    llm.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
    stamps, counts = [], []
    while llm.has_unfinished():
        updates = llm.step()
        if updates:
            stamps.append(time.perf_counter())
            counts.append(sum(len(u.new_token_ids) for u in updates))
            if output is not None:
                output.extend(t for u in updates for t in u.new_token_ids)
    return stream_times(start, stamps, counts)


def stream_times(start: float, stamps: list[float], counts: list[int] | None = None) -> dict:
    """TTFT; TPOT as the median gap between later steps per token they brought (tpot_ms) and as the mean (tpot_mean_ms:
    from the first token to the last over the tokens after the first, the way vLLM's and SGLang's benchmarks report
    TPOT). counts: tokens each stamp brought (1 each when not given; more with speculative decoding)."""
    counts = counts or [1] * len(stamps)
    gaps = [(b - a) / n for a, b, n in zip(stamps, stamps[1:], counts[1:]) if n]
    later = sum(counts[1:])
    return {
        "ttft_ms": (stamps[0] - start) * 1e3,
        "tpot_ms": statistics.median(gaps) * 1e3 if gaps else None,
        "tpot_mean_ms": (stamps[-1] - stamps[0]) / later * 1e3 if later else None,
    }


_client = None


def stream_stamps(client, url: str, prompt: list[int], new_tokens: int) -> tuple[float, list[float]]:
    """Streams one greedy /v1/completions request: when it was sent, and when each chunk carrying a choice arrived
    (the last one may also carry the finish reason)."""
    body = {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    stamps = []
    start = time.perf_counter()
    with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {") and '"choices":[{' in line.replace(" ", ""):
                stamps.append(time.perf_counter())
    return start, stamps


def http_latency(url: str, prompt: list[int], new_tokens: int) -> dict:
    """Streams one greedy /v1/completions request: TTFT to the chunk with the first token, TPOT as vLLM and SGLang
    report it ((end-to-end - TTFT) / (tokens - 1)), and the chunk gap, the median (and mean) gap between the chunks
    that carry tokens (this script's HTTP TPOT before: it leaves out the first token's lateness). Tokens per chunk are
    counted as bench/serving.py counts them, checked against the stream's usage."""
    import httpx

    global _client
    if _client is None:  # one connection for every request: a new client per request costs ~20 ms of its own
        _client = httpx.Client(timeout=600)
    body = {
        "prompt": prompt,
        "max_tokens": new_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    chunks, usage = [], None
    payload = json.dumps(body).encode()  # encoded before the clock starts, as bench/serving.py does
    start = time.perf_counter()
    with _client.stream(
        "POST", url + "/v1/completions", content=payload, headers={"content-type": "application/json"}
    ) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            now, event = time.perf_counter(), json.loads(line[6:])
            usage = event.get("usage") or usage
            chunks += chunk_tokens(now, event, chunks)
    end = time.perf_counter()
    counted = sum(n for _, n in chunks)
    if usage is None or counted != usage["completion_tokens"]:
        raise RuntimeError(f"{counted} tokens counted in the chunks, the stream's usage is {usage}")
    m = request_metrics(start, chunks, end)
    stamps = [t for t, n in chunks if n > 0]
    gaps = stream_times(start, stamps)
    return {
        "ttft_ms": m["ttft"] * 1e3,
        "tpot_ms": m["tpot"] * 1e3 if m["tpot"] is not None else None,
        "chunk_gap_ms": gaps["tpot_ms"],
        "chunk_gap_mean_ms": gaps["tpot_mean_ms"],
        "e2e_ms": m["e2e"] * 1e3,
        "output_tokens": m["output_tokens"],
        "prompt_tokens": usage["prompt_tokens"],  # as the server counted them
    }


def medians(runs: list[dict]) -> dict:
    """Each figure's median over the runs (one run: itself; None where a run has none)."""
    values = {key: [run[key] for run in runs] for key in runs[0]}
    return {key: None if None in v else statistics.median(v) for key, v in values.items()}


def hf_tpot(model_name: str, prompt: list[int], new_tokens: int, device: str) -> float:
    """Median ms per output token of transformers' greedy generate (difference of two generation lengths)."""
    model = hf_model_like(model_name, device)
    ids = torch.tensor([prompt], device=device)
    kwargs = dict(do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kwargs)
    runs = {}
    for n in (1, new_tokens + 1):
        t = now()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
        runs[n] = now() - t
    return (runs[new_tokens + 1] - runs[1]) / new_tokens * 1e3


def http_only(args, rng: random.Random) -> int:
    """Batch-1 latency through a running server alone, with prompts drawn from the model's vocabulary."""
    import httpx
    from fastqwen.config import ModelConfig

    if not args.url:
        raise SystemExit("--http-only needs --url")
    vocab = ModelConfig.from_preset(args.model).vocab_size
    http_latency(args.url, [1] * 16, 4)  # warm-up
    result = {"model": args.model, "url": args.url, "server_models": httpx.get(args.url + "/v1/models").json()}
    if torch.cuda.is_available():
        result["device"] = torch.cuda.get_device_name()
    rows = []
    for n in args.prompt_lens:
        prompt = [rng.randrange(vocab) for _ in range(n)]
        rows.append({"prompt_tokens": n, "http": http_latency(args.url, prompt, args.new_tokens)})
    ttft = [http_latency(args.url, [rng.randrange(vocab) for _ in range(256)], 1)["ttft_ms"] for _ in range(5)]
    result["ttft_256_http_ms"] = statistics.median(ttft)
    result["ttft_256_http_runs_ms"] = ttft
    result["rows"] = rows
    result["ttft_rows_http"] = []
    for n in args.ttft_lens:  # a fresh prompt each run: a repeated one would come from the prefix cache
        runs = [http_latency(args.url, [rng.randrange(vocab) for _ in range(n)], 1)["ttft_ms"] for _ in range(3)]
        result["ttft_rows_http"].append({"prompt_tokens": n, "ttft_ms": statistics.median(runs), "runs_ms": runs})
        print(f"TTFT {n:>6} tokens through HTTP: {statistics.median(runs):8.1f} ms (runs {runs})", flush=True)
    report(result, args.json)
    return 0


def matmul_tflops(iters: int = 20) -> float:
    """The bf16 tensor-core rate of this GPU, as an 8192^3 matmul runs (the prefill's compute limit)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    from common import time_fn

    return 2 * 8192**3 / (time_fn(lambda: a @ b, iters) * 1e-3) / 1e12


def ttft_rows(llm: LLM, lengths: list[int], rng: random.Random) -> list[dict]:
    """TTFT of one prompt per length (median of 3), and the limit: the prefill's FLOPs (every projection for every
    token, causal attention, the LM head for the last token) at the measured matmul rate."""
    cfg = llm.engine.config
    weights = llm.engine.model.weights
    lm_head = cfg.vocab_size * cfg.hidden_size
    linear = sum(p.weight.numel() for p in weights.projections()) + (lm_head if weights.lm_head is None else 0)
    rate = matmul_tflops()
    rows = []
    for n in lengths:
        # A new prompt each run: a repeated one would come from the prefix cache.
        runs = [engine_latency(llm, [rng.randrange(cfg.vocab_size) for _ in range(n)], 1)["ttft_ms"] for _ in range(3)]
        attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * n * (n + 1) / 2
        flops = 2 * (linear - lm_head) * n + 2 * lm_head + attention
        rows.append(
            {
                "prompt_tokens": n,
                "ttft_ms": statistics.median(runs),
                "runs_ms": runs,
                "prefill_tflop": flops / 1e12,
                "attention_share": attention / flops,
                "matmul_tflops": rate,
                "flop_limit_ms": flops / (rate * 1e12) * 1e3,
            }
        )
        print(
            f"TTFT {n:>6} tokens: {rows[-1]['ttft_ms']:8.1f} ms   limit {rows[-1]['flop_limit_ms']:7.1f} ms "
            f"({flops / 1e12:.1f} TFLOP at {rate:.0f} TFLOP/s, attention {attention / flops:.0%})",
            flush=True,
        )
    return rows


def ttft_profile(llm: LLM, n: int, rng: random.Random) -> dict:
    """One fresh prompt of n tokens to its first token under torch.profiler: the kernels' GPU time per family
    (bench/common.py's kernel_family) beside the TTFT, and the chunks it was prefilled in (max_num_batched_tokens)."""
    from torch.profiler import ProfilerActivity, profile

    vocab = llm.engine.config.vocab_size
    on_gpu = llm.engine.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]) as prof:
        ttft = engine_latency(llm, [rng.randrange(vocab) for _ in range(n)], 1)["ttft_ms"]
        if on_gpu:
            torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA" and e.device_time > 0]
    families = family_times(events)
    busy = sum(f["ms"] for f in families.values())
    chunk = llm.engine.scheduler.max_num_batched_tokens
    config = llm.engine.config
    by_chunk = attention_by_chunk(events, n, chunk, config.num_heads, config.head_dim)
    idle = idle_gaps(events)
    row = {
        "prompt_tokens": n,
        "chunk_tokens": chunk,
        "ttft_ms": ttft,
        "kernels_ms": busy,
        "families": {k: {"ms": round(v["ms"], 3), "kernels": v["kernels"]} for k, v in families.items()},
        "attention_by_chunk": by_chunk,
        "idle": idle,
    }
    shares = ", ".join(f"{k} {v['ms']:.1f}" for k, v in families.items())
    print(
        f"TTFT {n} tokens in chunks of {chunk}: {ttft:.1f} ms (profiled), kernels {busy:.1f} ms: {shares}", flush=True
    )
    for c in by_chunk:
        print(f"  attention, {c['new']} new on {c['prefix']} cached: {c['ms']:.1f} ms, {c['tflops']:.0f} TFLOP/s")
    print(
        f"  kernels span {idle['span_ms']:.1f} ms, the GPU idle {idle['idle_ms']:.1f} ms of it ({idle['gaps']} gaps of "
        f"20 us or more: {idle['gaps_ms']:.1f} ms; longest {idle['longest']})"
    )
    return row


def decode_profile(llm: LLM, prompt_len: int, new_tokens: int, rng: random.Random) -> dict:
    """Where a batch-1 decode step's GPU time goes: a fresh prompt of prompt_len tokens decoding new_tokens under
    torch.profiler, less a fresh one of the same length that stops at its first token (bench/common.py
    per_decode_step): each kernel family's microseconds per step and per layer (the step's figure over the layers,
    the LM head and sampler included), beside the profiled run's TPOT. Kernels under programmatic dependent launch
    overlap, so the families' sum may exceed the step; what it falls short of it by is time no kernel ran."""
    from torch.profiler import ProfilerActivity, profile

    vocab = llm.engine.config.vocab_size
    on_gpu = llm.engine.device.type == "cuda"

    def profiled(tokens: int) -> tuple[dict, dict]:
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        with profile(activities=[ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]) as prof:
            times = engine_latency(llm, prompt, tokens)
            if on_gpu:
                torch.cuda.synchronize()
        events = [e for e in prof.events() if e.device_type.name == "CUDA" and e.device_time > 0]
        return times, family_times(events)

    times, whole = profiled(new_tokens)
    _, first_only = profiled(1)
    steps = new_tokens - 1
    families = per_decode_step(whole, first_only, steps)
    layers = llm.engine.config.num_layers
    busy = sum(f["us"] for f in families.values())
    row = {
        "prompt_tokens": prompt_len,
        "decode_steps": steps,
        "tpot_mean_ms": times["tpot_mean_ms"],
        "kernels_us_per_step": round(busy, 2),
        "families": families,
        "per_layer_us": {k: round(v["us"] / layers, 2) for k, v in families.items()},
    }
    shares = ", ".join(f"{k} {v['us']:.1f} ({v['kernels']:g} kernels)" for k, v in families.items())
    print(
        f"decode after {prompt_len} tokens: TPOT {times['tpot_mean_ms']:.3f} ms (profiled), kernels {busy:.1f} us a "
        f"step: {shares}",
        flush=True,
    )
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineConfig.add_cli_arguments(p, model="Qwen3-8B", load_format="dummy", max_model_len=8192)
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 1024, 4096])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="requests per prompt length (a fresh prompt each): the row holds each figure's median and the runs. One "
        "128-token request with speculation moved by 0.2 ms a token between calls of the same code",
    )
    p.add_argument("--url", default=None, help="also measure through this running server")
    p.add_argument(
        "--http-only",
        action="store_true",
        help="measure only through --url (no engine in this process: the server holds the GPU memory)",
    )
    p.add_argument(
        "--ttft-lens",
        type=int,
        nargs="*",
        default=[],
        help="also the TTFT of one prompt of each length (median of 3 fresh prompts): offline beside the FLOP limit of "
        "its prefill, or through --url with --http-only",
    )
    p.add_argument(
        "--ttft-profile",
        action="store_true",
        help="also one more fresh prompt of each --ttft-lens length under torch.profiler: the prefill's GPU time per "
        "kernel family (attention, projections, norms, ...) against its TTFT",
    )
    p.add_argument(
        "--decode-profile",
        action="store_true",
        help="also where a decode step's GPU time goes: one more request of the first --prompt-lens length under "
        "torch.profiler, its kernel families per step and per layer (less the prefill, by a second request)",
    )
    p.add_argument("--hf", action="store_true", help="also measure HF transformers (a preset --model only)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rng = random.Random(0)
    if args.http_only:
        return http_only(args, rng)
    llm = LLM(EngineConfig.from_cli(args))
    vocab = llm.engine.config.vocab_size
    weights = llm.engine.model.weights
    device = llm.engine.device
    result = {"model": args.model, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    graphs = llm.engine.runner.graphs
    result["cuda_graph"] = (
        None
        if graphs is None
        else {
            "sizes": len(graphs.sizes),
            "max_bs": graphs.max_bs,
            "capture_s": round(graphs.capture_seconds, 3),
            "memory_mib": round(graphs.memory_bytes / 2**20, 1),
            "kv_pages": llm.engine.kv.num_pages,
        }
    )
    if device.type == "cuda":
        gbs = copy_bandwidth(20)
        result["copy_gbs"] = gbs
        result["tpot_floor_ms"] = (
            (weights.num_bytes() - weights.embed.numel() * weights.embed.element_size()) / (gbs * 1e9) * 1e3
        )
    engine_latency(llm, [1] * 16, 4)  # warm-up
    if args.url:  # the client's first stream is slow (66 ms TTFT on an H100 at 2264acf): keep it out of the first row
        http_latency(args.url, [1] * 16, 4)
    rows = []
    for n in args.prompt_lens:
        offline, http = [], []
        for _ in range(max(args.repeats, 1)):
            prompt = [rng.randrange(vocab) for _ in range(n)]
            offline.append(engine_latency(llm, prompt, args.new_tokens))
            if args.url:
                http.append(http_latency(args.url, prompt, args.new_tokens))
        row = {"prompt_tokens": n, "offline": medians(offline)}
        if args.url:
            row["http"] = medians(http)
        if args.repeats > 1:
            row["offline_runs"], row["http_runs"] = offline, http
        rows.append(row)
    ttft_prompt = [rng.randrange(vocab) for _ in range(256)]
    result["ttft_256_offline_ms"] = engine_latency(llm, ttft_prompt, 1)["ttft_ms"]
    if args.url:
        result["ttft_256_http_ms"] = http_latency(args.url, ttft_prompt, 1)["ttft_ms"]
    result["rows"] = rows
    if args.ttft_lens:
        result["ttft"] = ttft_rows(llm, args.ttft_lens, rng)
        if args.ttft_profile:
            result["ttft_profile"] = [ttft_profile(llm, n, rng) for n in args.ttft_lens]
    if args.decode_profile:
        result["decode_profile"] = decode_profile(llm, args.prompt_lens[0], max(args.new_tokens, 2), rng)
    # Free the engine's GPU memory (weights, KV pool, graphs) before the baseline builds its own model.
    del llm, graphs, weights
    gc.collect()
    torch.cuda.empty_cache()
    if args.hf:
        result["hf_tpot_ms"] = hf_tpot(args.model, [rng.randrange(vocab) for _ in range(128)], 32, str(device))
    report(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
