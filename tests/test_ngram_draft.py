"""Prompt lookup on the device (ops/ngram_draft.py, csrc/ngram_draft.cu) drafts what the host's NgramIndex drafts:
the reference against NgramIndex on random sequences with many repeats (CPU), then the kernel against the
reference on a batch of ragged histories (GPU)."""

from __future__ import annotations

import random

import pytest
import torch
from fastqwen.ops.ngram_draft import ngram_draft, ngram_draft_kernel_applies, ngram_draft_reference
from fastqwen.speculative.ngram import NgramIndex


def sequences(count: int, seed: int, vocab: int = 6, longest: int = 60) -> list[list[int]]:
    """Short random sequences over a few token ids: most tails recur, many several times and at several lengths."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(0, longest))] for _ in range(count)]


@pytest.mark.parametrize("n_min,n_max", [(1, 1), (2, 4), (1, 6), (3, 3)])
def test_reference_drafts_what_ngram_index_drafts(n_min, n_max):
    checked = drafted = 0
    for tokens in sequences(300, seed=n_min * 10 + n_max):
        index = NgramIndex(n_min, n_max)
        for length in range(len(tokens) + 1):  # grown a token at a time, as a request's index is
            prefix = tokens[:length]
            index.extend(prefix)
            for k in (1, 3):
                want = index.lookup(prefix, k)
                assert ngram_draft_reference(prefix, n_min, n_max, k) == want, (prefix, n_min, n_max, k)
                checked += 1
                drafted += bool(want)
    assert drafted >= 1000  # (the sequences repeat enough for the comparison to mean something: 1,262 at n_min 3)


def test_cpu_op_writes_drafts_counts_and_padding():
    history = torch.full((3, 8), 7, dtype=torch.int32)
    history[0, :6] = torch.tensor([1, 2, 3, 1, 2, 3])  # tail (2, 3) at 1..3: draft 1, 2, 3 (cut to k = 2)
    history[1, :3] = torch.tensor([4, 5, 6])  # no repeat
    lens = torch.tensor([6, 3, 0], dtype=torch.int32)
    drafts = torch.zeros(3, 2, dtype=torch.int32)
    counts = torch.zeros(3, dtype=torch.int32)
    ngram_draft(history, lens, 1, 3, drafts, counts)
    assert drafts.tolist() == [[1, 2], [-1, -1], [-1, -1]] and counts.tolist() == [2, 0, 0]


gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and ngram_draft_kernel_applies(torch.device("cuda"))), reason="needs a CUDA GPU"
)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n_min,n_max,k", [(2, 4, 3), (1, 8, 5), (1, 1, 1)])
def test_kernel_drafts_what_the_reference_drafts(n_min, n_max, k):
    rng = random.Random(k)
    stride = 6000
    rows = [[rng.randrange(5) for _ in range(n)] for n in (0, 1, 2, 3, 17, 300, 5999, 6000)]
    rows += sequences(56, seed=k, vocab=4, longest=400)
    rows.append([9] * 50 + [rng.randrange(1000) for _ in range(4000)] + [9] * 3)  # one long-ago match
    history = torch.full((len(rows), stride), -5, dtype=torch.int32)
    for b, row in enumerate(rows):
        history[b, : len(row)] = torch.tensor(row, dtype=torch.int32)
    lens = torch.tensor([len(r) for r in rows], dtype=torch.int32)
    device = torch.device("cuda")
    drafts = torch.zeros(len(rows), k, dtype=torch.int32, device=device)
    counts = torch.zeros(len(rows), dtype=torch.int32, device=device)
    ngram_draft(history.to(device), lens.to(device), n_min, n_max, drafts, counts)
    got_drafts, got_counts = drafts.cpu().tolist(), counts.cpu().tolist()
    for b, row in enumerate(rows):
        want = ngram_draft_reference(row, n_min, n_max, k)
        assert got_counts[b] == len(want) and got_drafts[b] == want + [-1] * (k - len(want)), (b, len(row))
    assert sum(c > 0 for c in got_counts) > len(rows) // 2


@pytest.mark.gpu
@gpu
def test_kernel_refuses_bad_arguments():
    device = torch.device("cuda")
    history = torch.zeros(2, 8, dtype=torch.int32, device=device)
    lens = torch.zeros(2, dtype=torch.int32, device=device)
    counts = torch.zeros(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError):  # n_min above n_max
        ngram_draft(history, lens, 3, 2, torch.zeros(2, 3, dtype=torch.int32, device=device), counts)
    with pytest.raises(ValueError):  # k above the kernel's limit
        ngram_draft(history, lens, 1, 2, torch.zeros(2, 65, dtype=torch.int32, device=device), counts)
    with pytest.raises(ValueError):  # int64 history
        ngram_draft(history.long(), lens, 1, 2, torch.zeros(2, 3, dtype=torch.int32, device=device), counts)
