"""Text <-> token ids with the checkpoint's own tokenizer.json (the `tokenizers` library, no model code)."""

from __future__ import annotations

import json
import os
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from ..errors import InvalidRequestError
from .chat_template import ChatTemplate, load_chat_template
from .detokenizer import IncrementalDetokenizer

# NFC composition shrinks UTF-8 text at most threefold (Hangul: three 3-byte jamo become one 3-byte syllable; a Latin
# or Greek letter and its combining marks, 2.5x at most).
_NFC_MAX_SHRINK = 3


def _max_token_bytes(spec: dict[str, Any]) -> int | None:
    """The most bytes of (normalized) text one token can stand for, for a byte-level BPE tokenizer (Qwen's) whose
    normalizer is none or NFC: then encoding text of B bytes gives at least B / this many tokens. None for any other
    kind of tokenizer, where no such bound holds (a word-level one maps a word of any length to one token)."""
    model = spec.get("model") or {}
    normalizer = spec.get("normalizer")
    if model.get("type") != "BPE" or model.get("unk_token") is not None:
        return None
    if normalizer is not None and normalizer.get("type") != "NFC":
        return None
    if '"ByteLevel"' not in json.dumps(spec.get("pre_tokenizer")):
        return None
    # Byte-level vocabulary entries spell one byte per character; added tokens match their content as it is.
    longest = max((len(token) for token in model.get("vocab") or {}), default=1)
    added = max((len(t["content"].encode("utf-8", "surrogatepass")) for t in spec.get("added_tokens") or []), default=1)
    return max(longest, added, 1)


class Tokenizer:
    def __init__(self, folder: str, chat_template: str | None = None):
        """chat_template: jinja source that replaces the folder's own template."""
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no tokenizer.json in {folder!r}")
        self._tok = _HFTokenizer.from_file(path)
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
        self.max_token_bytes = _max_token_bytes(spec)
        self._nfc = spec.get("normalizer") is not None
        self._token_texts: dict[int, str] = {}  # token_text's cache: at most one entry per vocabulary entry
        # A byte-level decoder maps each token to its bytes and decodes their concatenation: the text of tokens that
        # follow whole characters is then the texts of the tokens, one by one (IncrementalDetokenizer's fast path).
        self.decodes_by_concatenation = type(self._tok.decoder).__name__ == "ByteLevel"
        self._pieces: dict[tuple[int, bool], str] = {}  # piece's cache: at most two entries per vocabulary entry
        template, special = load_chat_template(folder)
        template = chat_template or template
        self.chat_template = ChatTemplate(template, special) if template else None

    @classmethod
    def from_folder(cls, folder: str, chat_template: str | None = None) -> Tokenizer | None:
        """The folder's tokenizer, or None when it has no tokenizer.json (a dummy preset, for example)."""
        if os.path.isfile(os.path.join(folder, "tokenizer.json")):
            return cls(folder, chat_template)
        return None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # Qwen3 adds no BOS token; the chat template, not the tokenizer, adds special tokens. encode_batch, not
        # encode: it releases the GIL while it works, so a long prompt tokenized in a worker thread does not stall
        # the server's event loop (encode holds the GIL throughout: seconds for a 10 MB prompt).
        # add_special_tokens: the tokenizer's own post-processor (Qwen3-Embedding's appends <|endoftext|>, the token
        # whose hidden state its model card pools), for embedding inputs.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def min_token_count(self, text: str) -> int:
        """A lower bound on len(encode(text)), in a few milliseconds for megabytes (encoding takes seconds): 0 when
        this kind of tokenizer has none. Lets a prompt far over the context be refused before it is tokenized."""
        if self.max_token_bytes is None:
            return 0
        if text.isascii():  # NFC leaves ASCII as it is
            size = len(text)
        else:
            size = len(text.encode("utf-8", "surrogatepass"))
            if self._nfc:
                size //= _NFC_MAX_SHRINK
        return -(-size // self.max_token_bytes)

    def token_text(self, token: int) -> str:
        """One token's text as logprobs show it (special tokens included), decoded once per token and kept."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self._tok.decode([token], skip_special_tokens=False)
        return text

    def token_id(self, token: str) -> int | None:
        """The id of a token of the vocabulary (added tokens included), None if it has none."""
        return self._tok.token_to_id(token)

    def piece(self, token: int, skip_special_tokens: bool) -> str:
        """decode([token]), decoded once per token and kept."""
        text = self._pieces.get((token, skip_special_tokens))
        if text is None:
            text = self._pieces[token, skip_special_tokens] = self._tok.decode([token], skip_special_tokens)
        return text

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
