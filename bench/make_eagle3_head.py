"""A random EAGLE-3 draft head in the published layout (SpecForge / AngelSlim: one Llama layer, `fc`, a draft
vocabulary with d2t / t2d) at a target checkpoint's shapes, for timing speculation with `--speculative-config
'{"method": "eagle3", "model": OUT, ...}'` on random weights (its drafts are random: pair it with
synthetic_acceptance_length). Qwen3-8B's published heads: hidden 4,096, intermediate 12,288, 32 / 8 heads of 128,
a draft vocabulary of 32,000.

    python bench/make_eagle3_head.py --target /tmp/qwen3-8b-dummy --out /tmp/qwen3-8b-eagle3
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from safetensors.torch import save_file


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="the target checkpoint's folder (its config.json)")
    p.add_argument("--out", required=True)
    p.add_argument("--draft-vocab", type=int, default=32000)
    args = p.parse_args()
    with open(os.path.join(args.target, "config.json")) as f:
        target = json.load(f)
    h, inter = target["hidden_size"], target["intermediate_size"]
    heads, kv_heads = target["num_attention_heads"], target["num_key_value_heads"]
    head_dim = target.get("head_dim", h // heads)
    vocab, dv = target["vocab_size"], args.draft_vocab
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, std=0.02):
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)

    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    subset = torch.sort(torch.randperm(vocab, generator=gen)[:dv]).values
    tensors = {
        "fc.weight": rand(h, 3 * h),
        "midlayer.input_layernorm.weight": ones(h),
        "midlayer.hidden_norm.weight": ones(h),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * h),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * h),
        "midlayer.self_attn.o_proj.weight": rand(h, heads * head_dim),
        "midlayer.post_attention_layernorm.weight": ones(h),
        "midlayer.mlp.gate_proj.weight": rand(inter, h),
        "midlayer.mlp.up_proj.weight": rand(inter, h),
        "midlayer.mlp.down_proj.weight": rand(h, inter),
        "norm.weight": ones(h),
        "lm_head.weight": rand(dv, h),
        "d2t": subset - torch.arange(dv),
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, subset, True),
    }
    os.makedirs(args.out, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(args.out, "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": target.get("rms_norm_eps", 1e-6),
        "rope_theta": target.get("rope_theta", 1000000.0),
        "vocab_size": vocab,
        "draft_vocab_size": dv,
        "max_position_embeddings": target.get("max_position_embeddings", 40960),
        "torch_dtype": "bfloat16",
    }
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    print(f"EAGLE-3 head ({h} hidden, {dv} draft tokens) written to {args.out}")


if __name__ == "__main__":
    main()
