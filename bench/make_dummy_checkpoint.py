"""Write a checkpoint folder without weights for a Qwen3 preset: config.json, generation_config.json, a byte-level
BPE tokenizer.json (trained here on a few sentences, with Qwen3's chat special tokens) and a ChatML chat template.
Serve it with --load-format dummy to exercise text and chat endpoints with the real model shapes:

    python bench/make_dummy_checkpoint.py --preset Qwen3-8B --out /tmp/qwen3-8b-dummy
    python -m fastqwen.serve --model /tmp/qwen3-8b-dummy --load-format dummy
"""

from __future__ import annotations

import argparse
import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from fastqwen.config import PRESETS, ModelConfig

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello, how are you today?",
    "A language model predicts the next token. Serving engines batch many requests together.",
    "敏捷的棕色狐狸跳过了懒狗。 素早い茶色の狐。 🦊🐶",
]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="Qwen3-8B", choices=PRESETS)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    cfg = ModelConfig.from_preset(args.preset)
    os.makedirs(args.out, exist_ok=True)
    config = {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "torch_dtype": "bfloat16", "hidden_act": "silu",
        "eos_token_id": cfg.eos_token_ids[0], "bos_token_id": cfg.bos_token_id,
    }  # fmt: skip
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(args.out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": cfg.eos_token_ids, "temperature": 0.6, "top_k": 20, "top_p": 0.95}, f, indent=1)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=SPECIAL)
    tok.train_from_iterator(CORPUS * 8, trainer)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>"}, f, indent=1)
    print(f"wrote {args.preset} config, tokenizer and chat template to {args.out} (serve with --load-format dummy)")


if __name__ == "__main__":
    main()
