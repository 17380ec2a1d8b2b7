"""A prompt whose length alone says it cannot fit the context is refused before it is tokenized (issue 40, item 4):
a 15 MB prompt took 45-50 s of tokenizing to get its 400. The bound must never refuse a prompt that fits: checked
against the real token counts of Qwen3's tokenizer (when installed) and a byte-level BPE one."""

from __future__ import annotations

import time

import pytest
from checkpoints import qwen_tokenizer_files, write_byte_level_tokenizer
from fastqwen.engine.messages import EngineInfo
from fastqwen.errors import InvalidRequestError
from fastqwen.frontend import Frontend
from fastqwen.sampling_params import SamplingParams
from fastqwen.tokenizer import Tokenizer

QWEN_FILES = qwen_tokenizer_files()

# Texts that make few tokens for their size: whitespace runs (Qwen3's longest tokens are 128 spaces), repeated
# words, and what NFC composes (Hangul jamo, combining marks), which shrinks the text before it is tokenized.
TEXTS = [
    "hello world",
    " " * 5000,
    "\n" * 3000 + "\t" * 3000,
    "the cat sat on the mat. " * 400,
    "\u1100\u1161\u11a8" * 2000,  # jamo that NFC composes into syllables
    "e\u0301" * 3000 + "\u03b1\u0313\u0342\u0345" * 1000,
    "한국어 텍스트 " * 500 + "日本語のテキスト" * 500 + "🙂" * 500,
    "<|im_start|>user\nhi<|im_end|>" * 100,
    "\ud800 lone surrogate",
]


def tokenizers(tmp_path) -> list[Tokenizer]:
    write_byte_level_tokenizer(str(tmp_path))
    found = [Tokenizer(str(tmp_path))]
    if QWEN_FILES is not None:
        found.append(Tokenizer(QWEN_FILES))
    return found


def test_the_bound_never_exceeds_the_real_token_count(tmp_path):
    for tokenizer in tokenizers(tmp_path):
        assert tokenizer.max_token_bytes is not None
        for text in TEXTS:
            try:
                count = len(tokenizer.encode(text))
            except Exception:  # a text the tokenizer cannot take is not this bound's concern
                continue
            assert tokenizer.min_token_count(text) <= count, (text[:20], count)
    if QWEN_FILES is not None:
        assert Tokenizer(QWEN_FILES).max_token_bytes == 128  # 128 spaces


def test_no_bound_for_a_word_level_tokenizer(tmp_path):
    """A word-level tokenizer maps a word of any length to one token: no length says a prompt cannot fit."""
    from checkpoints import write_tokenizer

    write_tokenizer(str(tmp_path))
    tokenizer = Tokenizer(str(tmp_path))
    assert tokenizer.max_token_bytes is None and tokenizer.min_token_count("x" * 100_000) == 0


def test_a_prompt_far_over_the_context_is_refused_before_tokenizing(tmp_path):
    write_byte_level_tokenizer(str(tmp_path))
    info = EngineInfo(model=str(tmp_path), vocab_size=320, max_model_len=4096, num_pages=1024, page_size=16)
    frontend = Frontend(info, Tokenizer(str(tmp_path)))
    prompt = "hello world abc " * 250_000  # 4 MB: about 9 s of tokenizing on a loaded 2-core machine
    started = time.monotonic()
    with pytest.raises(InvalidRequestError) as refused:
        frontend.prepare(prompt, SamplingParams(max_tokens=4))
    took = time.monotonic() - started
    assert refused.value.param == "prompt" and "maximum context length is 4096" in str(refused.value)
    assert took < 0.5, f"refusing took {took:.2f} s: the prompt was tokenized first"
    # At the edge the bound does not decide: a prompt that fits is tokenized and served.
    ids, _ = frontend.prepare("hello " * 100, SamplingParams(max_tokens=4))
    assert 0 < len(ids) < 4096
