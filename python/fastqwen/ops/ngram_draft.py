"""Prompt lookup on the GPU (csrc/ngram_draft.cu): the `ngram` method's drafts for a batch of token histories held on
the device, so that a verify step's next draft need not wait for the host. The same drafts as
speculative/ngram.py's NgramIndex: for n from min(n_max, len - 1) down to n_min, the tokens after the latest earlier
occurrence of the sequence's last n tokens.
"""

from __future__ import annotations

import torch

from ._native import check_tensors, native, stream_of

__all__ = ["ngram_draft", "ngram_draft_reference", "ngram_draft_kernel_applies"]


def ngram_draft_kernel_applies(device: torch.device) -> bool:
    m = native()
    return (
        device.type == "cuda" and m is not None and getattr(m, "built_with_cuda", False) and hasattr(m, "ngram_draft")
    )


def ngram_draft_reference(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """One sequence's draft, straight from the definition (a scan per n, latest occurrence first)."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        tail = tokens[length - n :]
        for end in range(length - 1, n - 1, -1):  # occurrences ending before the last token, latest first
            if tokens[end - n : end] == tail:
                return tokens[end : end + k]
    return []


def ngram_draft(
    history: torch.Tensor,
    lens: torch.Tensor,
    n_min: int,
    n_max: int,
    drafts: torch.Tensor,
    counts: torch.Tensor,
) -> None:
    """drafts [B, k] (int32, -1 past each row's count) and counts [B] (int32) for the int32 histories [B, stride]
    whose first lens[b] tokens are sequence b's. The kernel on a CUDA device, the reference otherwise."""
    batch, k = drafts.shape
    if history.dim() != 2 or history.shape[0] < batch or lens.shape[0] < batch or counts.shape[0] < batch:
        raise ValueError("ngram_draft: history [B, stride], lens [B], drafts [B, k] and counts [B]")
    device = history.device
    check_tensors("ngram_draft", device, torch.int32, history=history, lens=lens, drafts=drafts, counts=counts)
    if ngram_draft_kernel_applies(device):
        m = native()
        args = m.NgramDraftArgs()
        args.history, args.lens = history.data_ptr(), lens.data_ptr()
        args.drafts, args.counts = drafts.data_ptr(), counts.data_ptr()
        args.batch, args.stride = batch, history.shape[1]
        args.n_min, args.n_max, args.k = n_min, n_max, k
        args.stream = stream_of(history)
        m.ngram_draft(args)
        return
    if not (1 <= n_min <= n_max) or k < 1:
        raise ValueError("ngram_draft: need 1 <= n_min <= n_max and k >= 1")
    drafts.fill_(-1)
    for b in range(batch):
        length = max(0, min(int(lens[b]), history.shape[1]))
        draft = ngram_draft_reference(history[b, :length].tolist(), n_min, n_max, k)
        drafts[b, : len(draft)] = torch.tensor(draft, dtype=torch.int32)
        counts[b] = len(draft)
