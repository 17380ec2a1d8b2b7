"""The `fastqwen` command as a user meets it: help text, where the model may go on the command line, and a port
already in use (what real clients tripped on, issue 44)."""

from __future__ import annotations

import re

import pytest


def _help(capsys, main, argv) -> str:
    with pytest.raises(SystemExit):
        main(argv)
    return capsys.readouterr().out


def test_help_says_each_default_once(capsys):
    from fastqwen.cli import main

    text = _help(capsys, main, ["serve", "--help"])
    # One entry per option: from its flag at the start of a line to the next one.
    entries = [" ".join(e.split()) for e in re.split(r"\n  (?=-)", text.split("options:", 1)[1])]
    assert len(entries) > 40
    doubled = [e for e in entries if e.count("(default:") > 1]
    assert not doubled, doubled
    assert "(default: None)" not in " ".join(text.split())
    assert "(default: 8000)" in text and "(default: 0)" in " ".join(text.split())  # --port, --seed still say theirs
