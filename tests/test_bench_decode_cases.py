"""bench/kernels.py's decode cases on the CPU (issue 47: 256 to 512 sequences of 100 to 1,200 tokens): the case parser
(BATCH:TOKENS, BATCH:LO-HI), the bytes a decode-attention row is measured against, worked out by hand, and the
scattered page tables. Its timings need a GPU."""

from __future__ import annotations

import argparse
import os
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)
import kernels  # noqa: E402
from kernels import decode_bytes, parse_decode_case, scattered_page_tables  # noqa: E402


def test_uniform_and_mixed_cases():
    case = parse_decode_case("256:640")
    assert (case.batch, set(case.lengths), case.uniform) == (256, {640}, True)
    assert sorted(parse_decode_case("5:100-200").lengths) == [100, 125, 150, 175, 200]
    mixed = parse_decode_case("512:100-1200")
    assert (mixed.batch, mixed.uniform, mixed.label) == (512, False, "512:100-1200")
    assert (min(mixed.lengths), max(mixed.lengths)) == (100, 1200)
    # Spread evenly: 512 lengths 1100 / 511 apart (2 or 3 once rounded), paired around the middle: mean exactly 650.
    assert sum(mixed.lengths) == 512 * 650
    steps = {b - a for a, b in zip(sorted(mixed.lengths), sorted(mixed.lengths)[1:])}
    assert steps == {2, 3}
    # Shuffled, and the same order every time (a fixed seed).
    assert list(mixed.lengths) != sorted(mixed.lengths)
    assert parse_decode_case("512:100-1200").lengths == mixed.lengths
    assert parse_decode_case("3:7-7").lengths == (7, 7, 7)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("512", "expected BATCH:TOKENS"),
        ("a:100", "expected BATCH:TOKENS"),
        ("4:100-", "expected BATCH:TOKENS"),
        ("4:1-2-3", "expected BATCH:TOKENS"),
        ("0:100", "BATCH >= 1"),
        ("4:0", "1 <= LO <= HI"),
        ("4:1200-100", "1 <= LO <= HI"),
        ("1:100-1200", "need BATCH >= 2"),
    ],
)
def test_a_bad_case_is_refused_with_its_reason(spec, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        parse_decode_case(spec)


def test_the_command_line_names_the_bad_case(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["kernels.py", "--ops", "decode", "--decode-cases", "256:640", "512:1200-100"])
    with pytest.raises(SystemExit) as exit_:
        kernels.main()
    assert exit_.value.code == 2 and "'512:1200-100'" in capsys.readouterr().err


def test_decode_bytes_by_hand():
    # K and V of 8 heads of 128 per token: 4,096 bytes in bf16, 2,048 in e4m3; q read and out written: 2 x 32 x 128 x 2
    # = 16,384 bytes a sequence.
    assert decode_bytes([100, 1200], "bf16") == 1300 * 4096 + 2 * 16384 == 5_357_568
    assert decode_bytes([100, 1200], "fp8") == 1300 * 2048 + 2 * 16384 == 2_695_168
    # 512 sequences of 100..1,200 tokens: 332,800 tokens, 1.36 GB of K and V a layer in bf16.
    assert decode_bytes(parse_decode_case("512:100-1200").lengths, "bf16") == 1_363_148_800 + 8_388_608


def test_scattered_page_tables():
    torch.manual_seed(0)
    tables, pool = scattered_page_tables([20, 40, 3], copies=2)  # 2, 3 and 1 pages of 16 tokens
    assert pool == 12 and tables.shape == (2, 3, 3) and tables.dtype == torch.int32
    used = [tables[c, b, :pages] for c in range(2) for b, pages in enumerate([2, 3, 1])]
    assert sorted(torch.cat(used).tolist()) == list(range(12))  # every page of the pool once
    assert tables[:, 0, 2].tolist() == [0, 0] and tables[:, 2, 1:].eq(0).all()  # past a sequence's pages: 0
