"""End-to-end offline engine benchmark on random weights with real Qwen3 shapes (load_format="dummy").

Measures, through LLMEngine.step() with wall-clock time after a device sync (the host work is part of the cost):
- batch-1: time to first token of a 256-token prompt, and the median time per output token of 64 greedy tokens;
- throughput: 64 requests of 128 prompt tokens and 128 output tokens, output tokens per second.
The limit for batch-1 decode is the weight bytes over the device-to-device copy bandwidth measured in the same
run. Hugging Face transformers' generate() on the same shapes (its own random weights), batch 1, is the baseline.

    python bench/bench_engine.py [--model Qwen3-8B] [--json out.json]
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

from fastqwen import LLM, SamplingParams
from fastqwen.config import ModelConfig

from common import copy_bandwidth


def sync_time() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def batch1(llm: LLM, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """(time to first token, median time per output token) in milliseconds."""
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
    t0 = sync_time()
    engine.step()
    ttft = sync_time() - t0
    steps = []
    while engine.has_unfinished():
        t = sync_time()
        engine.step()
        steps.append(sync_time() - t)
    return ttft * 1e3, statistics.median(steps) * 1e3


def hf_batch1(cfg: ModelConfig, prompt: list[int], new_tokens: int) -> float:
    """Median ms per output token of transformers' greedy generate on the same shapes, batch 1."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hf_cfg = Qwen3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, tie_word_embeddings=cfg.tie_word_embeddings, max_position_embeddings=4096,
    )  # fmt: skip
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = Qwen3ForCausalLM(hf_cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    ids = torch.tensor([prompt], device="cuda")
    kwargs = dict(do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0, eos_token_id=None)
    model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kwargs)  # warm-up
    timings = {}
    for n in (1, new_tokens + 1):
        t = sync_time()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
        timings[n] = sync_time() - t
    del model
    torch.cuda.empty_cache()
    return (timings[new_tokens + 1] - timings[1]) / new_tokens * 1e3


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="Qwen3-8B")
    parser.add_argument("--json")
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    device = torch.cuda.get_device_name()
    copy_gbs = copy_bandwidth(20)
    rng = random.Random(0)
    llm = LLM(args.model, load_format="dummy", max_model_len=4096, max_num_batched_tokens=8192, num_pages=2048)
    weight_bytes = llm.engine.model.weights.num_bytes() - llm.engine.model.weights.embed.numel() * 2
    floor_ms = weight_bytes / (copy_gbs * 1e9) * 1e3
    llm.generate([[1] * 16], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)

    prompt = [rng.randrange(0, 150000) for _ in range(256)]
    ttft_ms, tpot_ms = batch1(llm, prompt, 64)

    prompts = [[rng.randrange(0, 150000) for _ in range(128)] for _ in range(64)]
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    t = sync_time()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = sync_time() - t
    throughput = sum(len(o.token_ids) for o in outputs) / elapsed
    del llm, outputs
    gc.collect()
    torch.cuda.empty_cache()

    hf_tpot = None if args.skip_hf else hf_batch1(ModelConfig.from_preset(args.model), prompt, 32)
    result = {
        "bench": "engine",
        "device": device,
        "model": f"{args.model} (dummy weights, bf16)",
        "path": "CUDA kernels for silu_and_mul, the norms and qk-norm/RoPE/KV write; PyTorch references for "
        "attention and sampling; eager, no CUDA graphs",
        "copy_gbs": copy_gbs,
        "weight_bytes_per_decode_step": weight_bytes,
        "batch1_decode_floor_ms": floor_ms,
        "ttft_ms_256_prompt": ttft_ms,
        "tpot_ms_batch1": tpot_ms,
        "tpot_fraction_of_floor": floor_ms / tpot_ms,
        "throughput_tok_s_64x128in_128out": throughput,
        "hf_transformers_tpot_ms_batch1": hf_tpot,
    }
    print(f"device: {device}   model: {result['model']}   copy {copy_gbs:.0f} GB/s")
    print(f"batch-1 decode: {tpot_ms:.2f} ms/token (floor {floor_ms:.2f} ms, {floor_ms / tpot_ms:.0%} of it)"
          + (f"; HF transformers {hf_tpot:.2f} ms/token" if hf_tpot else ""))
    print(f"TTFT, 256-token prompt: {ttft_ms:.1f} ms")
    print(f"throughput, 64 x (128 in, 128 out): {throughput:.0f} output tok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
