"""The `fastqwen` command as a user meets it: help text, where the model may go on the command line, and a port
already in use (what real clients tripped on, issue 44)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys

import pytest
from checkpoints import make_checkpoint


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


@pytest.mark.parametrize(
    "argv",
    [
        ["Qwen/Qwen3-8B", "--port", "9"],
        ["--port", "9", "Qwen/Qwen3-8B"],
        ["--port", "9", "Qwen/Qwen3-8B", "--device", "cpu"],
        ["--model", "Qwen/Qwen3-8B", "--port", "9"],
        ["Qwen/Qwen3-8B", "--model", "Qwen/Qwen3-8B", "--port", "9"],
    ],
)
def test_serve_takes_the_model_before_or_after_the_flags(argv):
    from fastqwen.serve import parse_args

    args = parse_args(argv, prog="fastqwen serve")
    assert args.model == "Qwen/Qwen3-8B" and args.port == 9
    assert "model_positional" not in vars(args)


def test_chat_takes_the_model_after_the_flags():
    from fastqwen.chat import parse_args

    assert parse_args(["--max-tokens", "7", "Qwen/Qwen3-8B"]).model == "Qwen/Qwen3-8B"


@pytest.mark.parametrize("argv", [["--port", "9"], ["a", "--model", "b"]])
def test_serve_refuses_no_model_or_two(capsys, argv):
    from fastqwen.serve import parse_args

    with pytest.raises(SystemExit) as exit:
        parse_args(argv, prog="fastqwen serve")
    assert exit.value.code == 2 and "model" in capsys.readouterr().err


def test_serve_on_a_port_in_use_exits_before_loading(tmp_path):
    """The port is bound before the model loads: the error comes at once, names the port, and no engine started."""
    make_checkpoint(str(tmp_path), tied=True, seed=3)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "fastqwen", "serve", "--port", str(port), "--device", "cpu", str(tmp_path)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 1, done.stderr
    assert (
        lines[-1]
        == f"fastqwen serve: error: cannot listen on 127.0.0.1:{port}: Address already in use (--host, --port)"
    )
    assert len(lines) == 1, lines  # nothing loaded, nothing logged: the one line
