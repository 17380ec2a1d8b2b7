"""pyproject.toml's dependency floors are the versions tests/check_floors.sh ran the tests with (tests/floors.txt),
none is below a release known to break fastqwen, and the installed packages meet them (cheap: no installs)."""

from __future__ import annotations

import importlib.metadata
import os
import re

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11 on

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Releases that fail fastqwen's tests, with why: a floor must be above each.
KNOWN_BAD = {
    "llguidance": ("1.6.1", "LLTokenizer(eos_token=[...]) fails: 'list' object cannot be interpreted as an integer"),
}


def _version(text: str) -> tuple[int, ...]:
    """(major, minor, micro): "1.7" is 1.7.0."""
    parts = [int(part) for part in re.findall(r"\d+", text)[:3]]
    return tuple(parts + [0] * (3 - len(parts)))


def _floors() -> dict[str, str]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    floors = {}
    for requirement in dependencies:
        found = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9.]+)", requirement)
        if found:
            floors[found[1].lower()] = found[2]
    return floors


def _pinned() -> dict[str, str]:
    with open(os.path.join(ROOT, "tests", "floors.txt")) as f:
        lines = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    return {name.lower(): version for name, version in (line.split("==") for line in lines)}


def test_every_checked_floor_is_the_declared_one():
    floors = _floors()
    for name, version in _pinned().items():
        assert name in floors, f"tests/floors.txt checks {name}, but pyproject.toml declares no floor for it"
        assert _version(floors[name]) == _version(version), (
            f"pyproject.toml says {name}>={floors[name]}, tests/check_floors.sh runs {version}"
        )


def test_no_floor_admits_a_release_known_to_fail():
    floors = _floors()
    for name, (bad, why) in KNOWN_BAD.items():
        assert _version(floors[name]) > _version(bad), f"{name}>={floors[name]} admits {bad}: {why}"


def test_the_installed_packages_meet_the_floors():
    for name, floor in _floors().items():
        installed = importlib.metadata.version(name)
        assert _version(installed) >= _version(floor), f"{name} {installed} is below its floor {floor}"
