"""Text <-> token ids with the checkpoint's own tokenizer.json (the `tokenizers` library, no model code)."""

from __future__ import annotations

import os

from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    def __init__(self, folder: str):
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no tokenizer.json in {folder!r}")
        self._tok = _HFTokenizer.from_file(path)

    @classmethod
    def from_folder(cls, folder: str) -> "Tokenizer | None":
        """The folder's tokenizer, or None when it has no tokenizer.json (a dummy preset, for example)."""
        if os.path.isfile(os.path.join(folder, "tokenizer.json")):
            return cls(folder)
        return None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        # Qwen3 adds no BOS token; the chat template, not the tokenizer, adds special tokens.
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
