"""What each stage of a batch-1 decode step costs inside the step: the step's CUDA graph is captured again with one
kind of kernel left out, and the GPU time of a replay is compared with the whole step's.

With programmatic dependent launch the kernels of a step overlap, so a kernel's own duration is not what it adds to
the step; leaving it out measures that. The outputs of a step with a stage left out are garbage (the timing is all
this is for): the replays run on the inputs of a real decode step (a prompt of --prompt-len tokens, then
--new-tokens generated), saved from the staging buffer and restored before each variant's replays.

    python bench/leave_out.py --model Qwen3-8B --load-format dummy [--quantization fp8] [--prompt-lens 128 1024]
                              [--min-chunks 128 64]

Besides the variants below: full_pdl_off (the whole step without programmatic dependent launch), per --min-chunks
value full_min_chunk_N (the whole step with decode attention cutting sequences into chunks of at least N tokens
instead of its default), per --max-splits value full_max_splits_N (into at most N chunks at any length, instead of
decode_max_splits' rule), and with --norm-kernels full_norm_kernels (the RMSNorms as their own kernels, as
FASTQWEN_NORM_IN_GEMV=0 runs the step; by default they ride on the GEMVs and no_layer_norms leaves out nothing).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from common import copy_bandwidth, report, time_fn
from fastqwen import LLM, SamplingParams, ops
from fastqwen.config import EngineConfig
from fastqwen.engine.cuda_graph import DecodeGraphs
from fastqwen.ops import attention as attention_ops
from fastqwen.ops._native import native as native_module

# Variant: the kinds of kernel it leaves out of the decode step (the final norm and the LM head always stay: they
# feed the sampler, which must see finite logits).
VARIANTS = {
    "full": (),
    "no_attention": ("attention",),  # decode attention and its split merge
    "no_qk_norm_rope": ("qk_norm_rope",),  # q/k RMSNorm + RoPE + KV write
    "no_layer_norms": ("norms",),  # the layers' RMSNorms (with their residual adds)
    "gemv_only": ("attention", "qk_norm_rope", "norms"),
    "no_projections": ("projections",),  # the layers' four projections: what the small kernels cost alone
}


def install_switches(model, left_out: set[str]) -> None:
    """Wrap the ops the model calls so that, while a CUDA graph is captured, the kinds in left_out are skipped."""
    final_norm, lm_head = model.weights.final_norm, model.weights.lm_head

    def capturing() -> bool:
        return torch.cuda.is_current_stream_capturing()

    def skip_unless(kind, fn, keep=lambda *a, **k: False, stand_in=lambda *a, **k: None):
        def wrapper(*args, **kwargs):
            if kind in left_out and capturing() and not keep(*args, **kwargs):
                return stand_in(*args, **kwargs)
            return fn(*args, **kwargs)

        return wrapper

    def rows(x, w, out=None, norm=None):  # the output a projection would have produced (uninitialized)
        return torch.empty(x.shape[0], w.out_features, dtype=x.dtype, device=x.device) if out is None else out

    def half_rows(x, w, gemv_only=False, norm=None):
        return torch.empty(x.shape[0], w.out_features // 2, dtype=x.dtype, device=x.device)

    # ops.paged_attention (the model's call) looks paged_attention_decode up in its own module: switch it there.
    attention_ops.paged_attention_decode = skip_unless("attention", attention_ops.paged_attention_decode)
    ops.qk_norm_rope_store_kv = skip_unless("qk_norm_rope", ops.qk_norm_rope_store_kv)
    ops.rms_norm = skip_unless("norms", ops.rms_norm)
    ops.fused_add_rms_norm = skip_unless("norms", ops.fused_add_rms_norm, keep=lambda h, r, w, eps: w is final_norm)
    ops.linear = skip_unless("projections", ops.linear, keep=lambda x, w, **_: w is lm_head, stand_in=rows)
    ops.linear_silu_and_mul = skip_unless("projections", ops.linear_silu_and_mul, stand_in=half_rows)
    ops.linear_add_residual = skip_unless("projections", ops.linear_add_residual)


def replay_ms(graphs: DecodeGraphs, replays: int) -> float:
    """Median GPU time of a replay of the step's graphs (the first 5 of `replays` warm up), each queued ahead."""
    return time_fn(lambda: graphs.replay(1), replays - 5, queue_ahead=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineConfig.add_cli_arguments(p, model="Qwen3-8B", load_format="dummy", max_model_len=8192)
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 1024])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--replays", type=int, default=60)
    p.add_argument("--rounds", type=int, default=2, help="the variants are measured this many times, alternating")
    p.add_argument("--min-chunks", type=int, nargs="*", default=[])
    p.add_argument("--max-splits", type=int, nargs="*", default=[])
    p.add_argument(
        "--norm-kernels",
        action="store_true",
        help="also the whole step with its RMSNorms as their own "
        "kernels instead of in the GEMVs (as FASTQWEN_NORM_IN_GEMV=0 runs it), as full_norm_kernels",
    )
    p.add_argument("--variants", nargs="+", default=[*VARIANTS, "full_pdl_off"], help="which of them to measure")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    args.cuda_graph_max_bs = 1
    llm = LLM(EngineConfig.from_cli(args))
    engine = llm.engine
    runner, model = engine.runner, engine.runner.model
    left_out: set[str] = set()
    install_switches(model, left_out)
    native = native_module()
    result = {
        "model": args.model,
        "quantization": args.quantization,
        "device": torch.cuda.get_device_name(),
        "copy_gbps": copy_bandwidth(20),
        "replay_ms": {},
    }

    for prompt_len in args.prompt_lens:
        prompt = [(7 * i + 3) % engine.config.vocab_size for i in range(prompt_len)]
        llm.generate(
            [prompt], SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True), use_tqdm=False
        )
        torch.cuda.synchronize()
        saved = runner.staging.dev.clone()  # the last decode step's inputs (batch 1)
        times: dict[str, list[float]] = {}
        # (name, kinds left out, PDL, decode's min chunk, decode's max splits; 0: the defaults)
        configs = [(name, kinds, True, 0, 0) for name, kinds in VARIANTS.items()] + [("full_pdl_off", (), False, 0, 0)]
        configs = [c for c in configs if c[0] in args.variants]
        configs += [(f"full_min_chunk_{n}", (), True, n, 0) for n in args.min_chunks]
        configs += [(f"full_max_splits_{n}", (), True, 0, n) for n in args.max_splits]
        configs += [("full_norm_kernels", (), True, 0, 0)] if args.norm_kernels else []
        norms_in_gemv = model.norms_in_gemv
        kv_fp8 = runner.kv.k(0).dtype == torch.float8_e4m3fn
        for _ in range(args.rounds):
            for name, kinds, pdl, min_chunk, splits in configs:
                left_out.clear()
                left_out.update(kinds)
                native.set_programmatic_launch(pdl)
                native.set_paged_attention_decode_min_chunk(kv_fp8, min_chunk)  # (0: the default)
                native.set_paged_attention_decode_max_splits(splits)
                model.norms_in_gemv = norms_in_gemv and name != "full_norm_kernels"
                try:
                    graphs = DecodeGraphs(model, runner.kv, runner.staging, 1, runner.sampler.graph_hook).capture()
                finally:
                    left_out.clear()
                    native.set_programmatic_launch(True)
                    native.set_paged_attention_decode_min_chunk(kv_fp8, 0)
                    native.set_paged_attention_decode_max_splits(0)
                    model.norms_in_gemv = norms_in_gemv
                runner.staging.dev.copy_(saved)
                times.setdefault(name, []).append(replay_ms(graphs, args.replays))
                graphs.close()
        row = {name: statistics.median(t) for name, t in times.items()}
        result["replay_ms"][str(prompt_len)] = {name: round(ms, 4) for name, ms in row.items()}
        print(
            f"prompt {prompt_len}: "
            + ", ".join(f"{n} {ms:.3f} ms ({ms - row.get('full', ms):+.3f})" for n, ms in row.items()),
            file=sys.stderr,
        )
    report(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
