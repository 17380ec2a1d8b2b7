"""Text <-> token ids with the checkpoint's own tokenizer.json (the `tokenizers` library, no model code)."""

from __future__ import annotations

import os
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from ..errors import InvalidRequestError
from .chat_template import ChatTemplate, load_chat_template
from .detokenizer import IncrementalDetokenizer


class Tokenizer:
    def __init__(self, folder: str, chat_template: str | None = None):
        """chat_template: jinja source that replaces the folder's own template."""
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no tokenizer.json in {folder!r}")
        self._tok = _HFTokenizer.from_file(path)
        template, special = load_chat_template(folder)
        template = chat_template or template
        self.chat_template = ChatTemplate(template, special) if template else None

    @classmethod
    def from_folder(cls, folder: str, chat_template: str | None = None) -> "Tokenizer | None":
        """The folder's tokenizer, or None when it has no tokenizer.json (a dummy preset, for example)."""
        if os.path.isfile(os.path.join(folder, "tokenizer.json")):
            return cls(folder, chat_template)
        return None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        # Qwen3 adds no BOS token; the chat template, not the tokenizer, adds special tokens. encode_batch, not
        # encode: it releases the GIL while it works, so a long prompt tokenized in a worker thread does not stall
        # the server's event loop (encode holds the GIL throughout: seconds for a 10 MB prompt).
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    def token_id(self, token: str) -> int | None:
        """The id of a token of the vocabulary (added tokens included), None if it has none."""
        return self._tok.token_to_id(token)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        if self.chat_template is None:
            raise InvalidRequestError("this model has no chat template: use a text completion", "messages")
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **template_kwargs)

    def detokenizer(
        self, skip_special_tokens: bool = True, stop: list[str] | None = None, include_stop_str_in_output: bool = False
    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens, stop, include_stop_str_in_output)
