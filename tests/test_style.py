"""The Python is formatted by ruff's formatter and passes ruff's linter, as pyproject.toml configures them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ruff(*args: str) -> subprocess.CompletedProcess:
    pytest.importorskip("ruff", reason="ruff comes with the test extras (pip install '.[test]')")
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)


def test_the_code_is_formatted():
    result = ruff("format", "--check", ".")
    assert result.returncode == 0, f"run `ruff format .`:\n{result.stdout}{result.stderr}"


def test_the_linter_passes():
    result = ruff("check", "--output-format", "concise", ".")
    assert result.returncode == 0, f"run `ruff check --fix .`:\n{result.stdout}{result.stderr}"
