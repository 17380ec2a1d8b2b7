"""The chained verify step's inputs (csrc/verify_chain.cu): queued after a verify step, the next one's inputs made on
the device from that step's draws (acceptance, the token history, the prompt-lookup draft, positions, KV slots and
the sampler rows' steps), so the GPU goes from one verify step to the next without waiting for the host
(engine/model_runner.py's chain_verify says when). The kernel on a CUDA device; on the CPU the reference below, the
same computation written out with the speculator's and NgramIndex's own rules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._native import check_tensors, native, stream_of
from .ngram_draft import ngram_draft_reference

__all__ = ["ChainInputs", "verify_chain", "verify_chain_kernel_applies"]


def verify_chain_kernel_applies(device: torch.device) -> bool:
    m = native()
    return (
        device.type == "cuda" and m is not None and getattr(m, "built_with_cuda", False) and hasattr(m, "verify_chain")
    )


@dataclass
class ChainInputs:
    """The buffers a chained step reads and writes (csrc/verify_chain.h gives each one's role and dtype)."""

    tokens: torch.Tensor  # the last step's draws, int64 [>= batch * q]
    input_ids: torch.Tensor  # the verify graphs' inputs, int64 [>= batch * q], rewritten
    positions: torch.Tensor
    out_slots: torch.Tensor
    kv_lens: torch.Tensor  # int32 [>= batch]
    page_table: torch.Tensor  # int32 [>= batch, width]
    rows: torch.Tensor  # the sampler's rows, int32 [>= batch * q, words]
    history: torch.Tensor  # int32 [>= batch, stride]
    lens: torch.Tensor  # int32 [>= batch]
    credit: torch.Tensor  # float64 [>= batch]
    report: torch.Tensor  # int32 [>= batch * (q + 1)]


def verify_chain(
    x: ChainInputs,
    batch: int,
    q: int,
    page_size: int,
    step_words: tuple[int, int],
    n_min: int,
    n_max: int,
    synthetic: float | None,
) -> None:
    """Make the next verify step's inputs for sequences [0, batch) in place; report[:batch] = each one's accepted
    draft tokens in the last step, report[batch:batch*(q+1)] = its new input ids (the last token, then the draft)."""
    device = x.tokens.device
    int64, int32 = torch.int64, torch.int32
    check_tensors(
        "verify_chain",
        device,
        None,
        tokens=(x.tokens, int64),
        input_ids=(x.input_ids, int64),
        positions=(x.positions, int64),
        out_slots=(x.out_slots, int64),
        kv_lens=(x.kv_lens, int32),
        page_table=(x.page_table, int32),
        rows=(x.rows, int32),
        history=(x.history, int32),
        lens=(x.lens, int32),
        credit=(x.credit, torch.float64),
        report=(x.report, int32),
    )
    if min(x.tokens.numel(), x.input_ids.numel(), x.positions.numel(), x.out_slots.numel()) < batch * q:
        raise ValueError("verify_chain: tokens, input_ids, positions and out_slots need batch * q entries")
    if min(x.kv_lens.numel(), x.lens.numel(), x.credit.numel(), x.history.shape[0], x.page_table.shape[0]) < batch:
        raise ValueError("verify_chain: kv_lens, lens, credit, history and page_table need a row per sequence")
    if x.report.numel() < batch * (q + 1) or x.rows.shape[0] < batch * q:
        raise ValueError("verify_chain: report needs batch * (q + 1) entries and rows batch * q rows")
    if verify_chain_kernel_applies(device):
        m = native()
        a = m.VerifyChainArgs()
        a.tokens, a.input_ids, a.positions, a.out_slots = (
            x.tokens.data_ptr(),
            x.input_ids.data_ptr(),
            x.positions.data_ptr(),
            x.out_slots.data_ptr(),
        )
        a.kv_lens, a.page_table, a.rows = x.kv_lens.data_ptr(), x.page_table.data_ptr(), x.rows.data_ptr()
        a.history, a.lens, a.credit, a.report = (
            x.history.data_ptr(),
            x.lens.data_ptr(),
            x.credit.data_ptr(),
            x.report.data_ptr(),
        )
        a.batch, a.q, a.width, a.stride, a.page_size = batch, q, x.page_table.shape[1], x.history.shape[1], page_size
        a.row_words, (a.step_lo, a.step_hi) = x.rows.shape[1], step_words
        a.n_min, a.n_max = n_min, n_max
        a.synthetic = 0.0 if synthetic is None else float(synthetic)
        a.stream = stream_of(x.tokens)
        m.verify_chain(a)
        return
    _reference(x, batch, q, page_size, step_words, n_min, n_max, synthetic)


def _reference(x: ChainInputs, batch, q, page_size, step_words, n_min, n_max, synthetic) -> None:
    k = q - 1
    step_lo, step_hi = step_words
    words = x.rows.view(torch.int32)
    for b in range(batch):
        lo = b * q
        draws = x.tokens[lo : lo + q].tolist()
        draft = x.input_ids[lo + 1 : lo + q].tolist()
        if synthetic is not None:  # (Speculator.accepted's arithmetic, in Python floats: doubles)
            credit = float(x.credit[b]) + (synthetic - 1)
            n = min(k, int(credit))
            x.credit[b] = credit - n
        else:
            n = 0
            while n < k and draft[n] == draws[n]:
                n += 1
        length = int(x.lens[b])
        emitted = [*draft[:n], draws[n]][: x.history.shape[1] - length]
        x.history[b, length : length + len(emitted)] = torch.tensor(emitted, dtype=torch.int32)
        length += len(emitted)
        x.lens[b] = length
        history = x.history[b, :length].tolist()
        proposal = ngram_draft_reference(history, n_min, n_max, k)
        last = draws[n]
        ids = [last, *proposal, *[last] * (k - len(proposal))]
        start = int(x.positions[lo]) + n + 1
        for i in range(q):
            pos = start + i
            x.input_ids[lo + i] = ids[i]
            x.positions[lo + i] = pos
            x.out_slots[lo + i] = int(x.page_table[b, pos // page_size]) * page_size + pos % page_size
            step = (int(words[lo + i, step_lo]) & 0xFFFFFFFF) | ((int(words[lo + i, step_hi]) & 0xFFFFFFFF) << 32)
            step += n + 1
            words[lo + i, step_lo] = _as_int32(step & 0xFFFFFFFF)
            words[lo + i, step_hi] = _as_int32(step >> 32)
            x.report[batch + lo + i] = ids[i]
        x.kv_lens[b] = start + q
        x.report[b] = n


def _as_int32(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word
