"""Text a grammar forces that spells one of the tokenizer's added tokens (`</think>`, `<tool_call>`, `<|im_end|>`).

Where a grammar leaves only one way on (forced bytes), llguidance offers a single token: the first of the forced
bytes tokenized by the Hugging Face tokenizer. That tokenizer cuts its added tokens out of any text that spells them,
while llguidance's parser gives those tokens special bytes (a marker and the token's name), never their text: a
regex that spells `</think>` is offered the `</think>` token and then refuses it, and the request fails.

The repair: a one-token mask whose token the grammar itself refuses is replaced by the first token of the forced
text tokenized greedily over the vocabulary's text tokens (llguidance's trie, where special tokens cannot match
text), so the text comes out as ordinary tokens. Every other mask is left as llguidance computed it.
"""

from __future__ import annotations

import llguidance
import numpy as np


def repair_forced_mask(matcher: llguidance.LLMatcher, tokenizer: llguidance.LLTokenizer, mask: np.ndarray) -> None:
    """Fix mask (the matcher's current state, int32 [ceil(vocab / 32)]) in place when it offers only a token the
    grammar refuses (see the module's doc)."""
    token = _only_token(mask)
    if token is None or matcher.validate_tokens([token]) == 1:
        return
    # (The forced bytes are whole characters but at most their end; a cut character is left to the next step.)
    text = matcher.compute_ff_bytes().decode("utf-8", "ignore")
    greedy = tokenizer.greedy_tokenize(text) if text else []
    if greedy and matcher.validate_tokens(greedy[:1]) == 1:
        mask[:] = 0
        mask.view(np.uint32)[greedy[0] >> 5] = np.uint32(1 << (greedy[0] & 31))


def _only_token(mask: np.ndarray) -> int | None:
    """The token of a mask that allows exactly one, else None."""
    if np.count_nonzero(mask) != 1:  # (a few microseconds for Qwen3's vocabulary: every mask is checked)
        return None
    index = int(np.argmax(mask != 0))
    word = int(mask.view(np.uint32)[index])
    if word & (word - 1):
        return None
    return index * 32 + word.bit_length() - 1
