"""An account of the saturated decode step, as leave_out.py gives one for batch 1: at each batch size, what each kind
of work adds to the step's GPU time, next to that kind's own bound, and the whole step against the sum of the bounds.

    python bench/step_account.py --model Qwen3-8B --load-format dummy [--quantization fp8] [--kv-cache-dtype fp8_e4m3]
                                 [--batches 64 256 512] [--context 640] [--json out.json]

For each batch B: B requests of --context random prompt tokens generate --new-tokens tokens together; the last decode
step's inputs (in the staging buffer) are saved and the step's CUDA graph (forward, then the sampler) is captured
again at size B, whole and with one kind of kernel left out (leave_out.install_switches), each replayed on the saved
inputs (GPU time: CUDA events, queued ahead). Families:
  projections   the layers' qkv, o, gate/up (with its SiLU) and down: the whole step less the step without them
  lm_head       the LM head and its float32 logits, timed alone at B rows (the leave-outs keep it: the sampler needs
                finite logits)
  attention     decode attention (plan, split, merge): the whole step less the step without it
  norms_rope    the layers' RMSNorms with their residual adds, and q/k-norm + RoPE + KV write, left out together
  sampler       the sampler graph: replay of forward and sampler less the forward's alone
  graph_launch  a replay launched by the host onto an idle GPU less the same replay queued ahead of the GPU
  host          the engine's median decode step (wall clock, --new-tokens steps at batch B) less its graph's replay:
                what the overlap schedule does not hide
  rest          the whole replay less the GPU families above (embedding, final norm, gaps between kernels)
Bounds (step_work): bytes at the copy rate of a 1 GiB device-to-device copy (read + write counted), FLOPs at the
rate of a bf16 GEMM of 8192^3 (with --quantization fp8, the projections' FLOPs at an FP8 GEMM's of the same size),
each measured in this run with CUDA events; a family's bound is the larger of the two. Families with a bound: the
projections (weights once, activations in and out, the SiLU's read and write; 2 x B FLOPs per weight), the LM head
(its weight, the bf16 logits and their float32 copy), attention (K and V of every sequence at its length, q and the
output), norms_rope (every norm's rows read and written, qkv read, q and the new K and V written), the sampler (the
float32 logits read once). The step's bound is their sum.

Needs a GPU with the CUDA kernels; on the CPU it parses its arguments and prints the bounds' bytes and FLOPs (no
times) with --work-only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from common import copy_bandwidth, graph_of, report, time_fn
from fastqwen import ops
from fastqwen.config import EngineConfig, ModelConfig
from leave_out import install_switches

# Leave-out variants of the step (leave_out.install_switches's kinds) and the family each one measures.
LEFT_OUT = {
    "projections": ("projections",),
    "attention": ("attention",),
    "norms_rope": ("qk_norm_rope", "norms"),
}


def step_work(
    cfg: ModelConfig, batch: int, kv_len: int, weight_bytes: float, kv_bytes: int, act_bytes: int = 2
) -> dict[str, dict[str, float]]:
    """Bytes and FLOPs of one decode step of `batch` sequences of kv_len cached tokens, per family with a bound.
    weight_bytes: bytes per projection weight (2 for bf16, 1 for e4m3; the block scales are left out, 1/16,384 of it);
    kv_bytes: per cached K or V entry; act_bytes: per activation. The LM head is always dense (act_bytes a weight)."""
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    q, kv, vocab = cfg.q_size, cfg.kv_size, cfg.vocab_size
    # (in, out) of each projection of a layer; gate/up stacked.
    shapes = [(h, q + 2 * kv), (q, h), (h, 2 * inter), (inter, h)]
    params = layers * sum(i * o for i, o in shapes)
    activations = layers * batch * act_bytes * (sum(i + o for i, o in shapes) + 3 * inter)  # + SiLU: 2I read, I written
    lm_params = vocab * h
    norm_rows = layers * 2 * 4 * batch * h  # two fused add-norms a layer: x and residual read, both written
    rope = layers * batch * ((q + 2 * kv) + q) * act_bytes + layers * batch * 2 * kv * kv_bytes
    return {
        "projections": {"bytes": params * weight_bytes + activations, "flops": 2.0 * batch * params},
        "lm_head": {
            "bytes": lm_params * act_bytes + batch * h * act_bytes + batch * vocab * (2 * act_bytes + 4),
            "flops": 2.0 * batch * lm_params,
        },
        "attention": {
            "bytes": layers * batch * (kv_len * 2 * kv * kv_bytes + 2 * q * act_bytes),
            "flops": 4.0 * layers * batch * kv_len * q,
        },
        "norms_rope": {"bytes": norm_rows * act_bytes + rope, "flops": 0.0},
        "sampler": {"bytes": batch * vocab * 4, "flops": 0.0},
    }


def bound_ms(work: dict[str, float], copy_gbps: float, tflops: float) -> float:
    """The larger of the bytes at the copy rate and the FLOPs at the GEMM rate, in ms."""
    return max(work["bytes"] / (copy_gbps * 1e9), work["flops"] / (tflops * 1e12)) * 1e3


def gemm_tflops(iters: int, fp8: bool = False) -> float:
    """TFLOP/s of a GEMM of 8192^3: bf16, or e4m3 through torch._scaled_mm (per-tensor scales, bf16 out)."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    if fp8:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # (the second operand column-major)
        one = torch.ones((), device="cuda")
        ms = time_fn(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16), iters, queue_ahead=True)
    else:
        ms = time_fn(lambda: a @ b, iters, queue_ahead=True)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def one_size_graphs(runner, size: int):
    """The runner's decode step captured at this one size (not every captured size up to it, as DecodeGraphs would)."""
    from fastqwen.engine.cuda_graph import DecodeGraphs

    graphs = DecodeGraphs(runner.model, runner.kv, runner.staging, size, runner.sampler.graph_hook)
    graphs.sizes, graphs.max_bs = [size], size
    return graphs.capture()


def decode_step_ms(llm, prompts: list[list[int]], new_tokens: int) -> tuple[float, torch.Tensor, float]:
    """Generate new_tokens for every prompt at once. Returns the median wall time between the ends of consecutive
    engine steps that both decoded every prompt, the staging buffer's inputs of the first such step (copied once it
    was launched: the one device sync of the run, so the other steps keep their overlap) and that step's mean KV
    length. Chunked prefill admits the prompts over several steps, so the first
    requests finish first: new_tokens must outlast the admission (RuntimeError if no step decoded every prompt, or
    the pool holds too few sequences of this length)."""
    from fastqwen import SamplingParams

    engine, runner = llm.engine, llm.engine.runner
    steps: list[tuple[float, int]] = []  # (end of the step() call, decode batch it launched; 0: not all decode)
    launched = [0]
    full: dict = {}
    step, launch = engine.step, runner.launch

    def timed_step():
        launched[0] = 0
        out = step()
        steps.append((time.perf_counter(), launched[0]))
        return out

    def recording_launch(scheduled, after=None):
        out = launch(scheduled, after)
        launched[0] = len(scheduled.chunks) if scheduled.is_decode else 0
        if launched[0] == len(prompts) and "inputs" not in full:  # once: a sync every step would undo the overlap
            if torch.cuda.is_available():  # (the upload into the staging buffer is queued: wait for it)
                torch.cuda.synchronize()
            full["inputs"] = runner.staging.dev.clone()
            full["kv_len"] = statistics.mean(c.end for c in scheduled.chunks)
        return out

    engine.step, runner.launch = timed_step, recording_launch
    try:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        del engine.step, runner.launch
    gaps = [b[0] - a[0] for a, b in zip(steps, steps[1:]) if a[1] == b[1] == len(prompts)]
    if len(gaps) < 4 or "inputs" not in full:
        raise RuntimeError(
            f"{len(gaps)} consecutive steps decoded all {len(prompts)} sequences (at least 4 needed): give it more "
            "--new-tokens, or the KV pool more room (--num-pages, --kv-cache-memory-fraction) or a shorter --context"
        )
    return statistics.median(gaps[len(gaps) // 4 :]) * 1e3, full["inputs"], full["kv_len"]


def account(llm, batch: int, args, left_out: set[str], copy_gbps: float, tflops: dict[str, float]) -> dict:
    """One batch size's account (see the module's docstring); left_out: the set install_switches reads."""
    engine = llm.engine
    runner, model = engine.runner, engine.runner.model
    vocab = engine.config.vocab_size
    prompts = [[(7 * i + 13 * b + 1) % vocab for i in range(args.context)] for b in range(batch)]
    host_step_ms, saved, kv_len = decode_step_ms(llm, prompts, args.new_tokens)  # saved: a full step's inputs
    kv_len = round(kv_len)
    times: dict[str, list[float]] = {}

    def replays(name: str, fn, queue_ahead: bool = True) -> None:
        runner.staging.dev.copy_(saved)
        times.setdefault(name, []).append(time_fn(fn, args.replays, queue_ahead=queue_ahead))

    for _ in range(args.rounds):
        for family, kinds in [("full", ()), *LEFT_OUT.items()]:
            left_out.clear()
            left_out.update(kinds)
            try:
                graphs = one_size_graphs(runner, batch)
            finally:
                left_out.clear()
            if family == "full":
                replays("full", lambda: graphs.replay(batch))
                replays("forward", lambda: graphs.replay_forward(batch))
                replays("full_launched", lambda: graphs.replay(batch), queue_ahead=False)
            else:
                replays(f"no_{family}", lambda: graphs.replay(batch))
            graphs.close()
    ms = {name: statistics.median(t) for name, t in times.items()}

    hidden = torch.randn(batch, engine.config.hidden_size, device="cuda", dtype=model.dtype)
    logits = torch.empty(batch, vocab, device="cuda", dtype=torch.float32)
    lm_head = graph_of(lambda: logits.copy_(ops.linear(hidden, model.weights.lm_head)))  # (one GPU: no gather)
    measured = {
        "projections": ms["full"] - ms["no_projections"],
        "lm_head": time_fn(lm_head.replay, args.replays, queue_ahead=True),
        "attention": ms["full"] - ms["no_attention"],
        "norms_rope": ms["full"] - ms["no_norms_rope"],
        "sampler": ms["full"] - ms["forward"],
    }
    measured["rest"] = ms["full"] - sum(measured.values())
    measured["graph_launch"] = ms["full_launched"] - ms["full"]
    measured["host"] = max(0.0, host_step_ms - ms["full_launched"])

    fp8_weights = model.weights.layers[0].qkv.is_fp8
    kv_bytes = runner.kv.k(0).element_size()
    work = step_work(engine.rank_config, batch, kv_len, 1 if fp8_weights else 2, kv_bytes)
    families = {}
    for name, value in measured.items():
        row = {"ms": round(value, 4)}
        if name in work:
            rate = tflops["fp8" if fp8_weights and name == "projections" else "bf16"]
            row.update(work[name], bound_ms=round(bound_ms(work[name], copy_gbps, rate), 4))
            row["of_bound"] = round(value / row["bound_ms"], 3) if row["bound_ms"] else None
        families[name] = row
    step_bound = sum(f["bound_ms"] for f in families.values() if "bound_ms" in f)
    result = {
        "kv_len": kv_len,
        "step_ms": round(ms["full"], 4),
        "step_bound_ms": round(step_bound, 4),
        "step_of_bound": round(ms["full"] / step_bound, 3),
        "engine_step_ms": round(host_step_ms, 4),
        "families": families,
    }
    print(
        f"batch {batch}: step {ms['full']:.3f} ms = {ms['full'] / step_bound:.2f} x its bound {step_bound:.3f} ms; "
        + ", ".join(
            f"{n} {f['ms']:.3f}" + (f"/{f['bound_ms']:.3f}" if "bound_ms" in f else "") for n, f in families.items()
        ),
        file=sys.stderr,
    )
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineConfig.add_cli_arguments(p, model="Qwen3-8B", load_format="dummy", max_model_len=4096)
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256, 512])
    p.add_argument("--context", type=int, default=640, help="prompt tokens of every sequence (issue 47: ~640)")
    p.add_argument(
        "--new-tokens",
        type=int,
        default=64,
        help="tokens each sequence generates (the steps that decode all "
        "of them are timed; the prompts' admission over several chunked-prefill steps comes first)",
    )
    p.add_argument("--replays", type=int, default=40)
    p.add_argument("--rounds", type=int, default=2, help="the variants are captured and timed this many times")
    p.add_argument("--work-only", action="store_true", help="print each family's bytes and FLOPs, time nothing")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.max_num_seqs is None:
        args.max_num_seqs = max(args.batches)  # every batch asked for runs at once, whatever the pool's default
    if args.cuda_graph_max_bs is None:
        args.cuda_graph_max_bs = max(args.batches)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = EngineConfig.from_cli(args)
    if args.work_only:
        from fastqwen.config import load_model_config

        cfg, _ = load_model_config(config.model)
        weight_bytes = 1 if args.quantization == "fp8" else 2
        kv_bytes = 1 if args.kv_cache_dtype.startswith("fp8") else 2
        kv_len = args.context + args.new_tokens - 1
        work = {b: step_work(cfg, b, kv_len, weight_bytes, kv_bytes) for b in args.batches}
        report({"model": args.model, "kv_len": kv_len, "work": work}, args.json)
        return 0
    from fastqwen import LLM

    llm = LLM(config)
    left_out: set[str] = set()
    install_switches(llm.engine.runner.model, left_out)
    copy_gbps = copy_bandwidth(20)
    tflops = {"bf16": gemm_tflops(20)}
    if llm.engine.model.weights.layers[0].qkv.is_fp8:
        tflops["fp8"] = gemm_tflops(20, fp8=True)
    result = {
        "model": args.model,
        "quantization": args.quantization,
        "kv_cache_dtype": str(llm.engine.kv.k(0).dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name(),
        "copy_gbps": round(copy_gbps, 1),
        "gemm_tflops": {k: round(v, 1) for k, v in tflops.items()},
        "context": args.context,
        "batches": {},
    }
    for batch in args.batches:
        result["batches"][str(batch)] = account(llm, batch, args, left_out, copy_gbps, tflops)
    report(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
