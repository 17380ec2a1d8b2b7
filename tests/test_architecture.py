"""The package's levels, checked on its imports: each part imports only what the design lets it know about.

DESIGN.md, section 1: entry points -> server (frontend) -> engine -> model, scheduler -> ops. The server talks to the
engine only through its client interface and typed messages, and never sees the scheduler, the model, the KV pool or
the kernels; the engine never sees text.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "python" / "fastqwen"


def imports_of(path: pathlib.Path) -> set[str]:
    """Every fastqwen module a file imports, as a dotted name relative to the package ("engine.client")."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(parts[: len(parts) - node.level])
                name = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("fastqwen"):
                name = node.module.removeprefix("fastqwen").lstrip(".")
            else:
                continue
            found.add(name)
            if not node.module:  # from . import x
                found.update(f"{name}.{alias.name}".lstrip(".") for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name.removeprefix("fastqwen.") for a in node.names if a.name.startswith("fastqwen."))
    return found


def files(part: str) -> list[pathlib.Path]:
    target = PACKAGE / part
    return sorted(target.rglob("*.py")) if target.is_dir() else [target.with_suffix(".py")]


# part -> the parts of the package it must not import (a prefix matches every module under it).
FORBIDDEN = {
    "server": ["scheduler", "model", "kvcache", "ops", "weights", "engine.llm_engine", "engine.model_runner",
               "engine.sampler", "engine.cuda_graph", "engine.staging"],
    "frontend": ["scheduler", "model", "kvcache", "ops", "server", "engine.llm_engine", "engine.model_runner"],
    "engine": ["server", "tokenizer", "frontend", "llm"],
    "scheduler": ["engine", "server", "model", "ops", "tokenizer", "frontend"],
    "model": ["engine", "server", "scheduler", "tokenizer", "frontend"],
    "kvcache": ["engine", "server", "model", "scheduler", "frontend"],
    "ops": ["engine", "server", "model", "scheduler", "kvcache", "tokenizer", "frontend"],
    "tokenizer": ["engine", "server", "model", "scheduler", "kvcache", "ops", "frontend"],
    "grammar": ["engine", "server", "model", "scheduler", "kvcache", "ops", "tokenizer", "frontend"],
    # Resolved before anything loads, from the entry points and the engine: it knows files, not the machinery.
    "model_source": ["engine", "server", "model", "scheduler", "kvcache", "ops", "tokenizer", "frontend", "llm"],
    # A client of the offline LLM or of a server's HTTP API, never of the server's internals.
    "chat": ["server", "engine", "scheduler", "model", "kvcache", "ops"],
}  # fmt: skip


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_levels_import_one_way(part):
    violations = []
    for path in files(part):
        for name in imports_of(path):
            for banned in FORBIDDEN[part]:
                if name == banned or name.startswith(banned + "."):
                    violations.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert not violations, "\n".join(violations)


def test_the_checker_sees_relative_imports():
    """The checker itself: a known import of the engine's client from the server is found."""
    assert "engine.client" in imports_of(PACKAGE / "server" / "async_engine.py")
    assert "scheduler" in imports_of(PACKAGE / "engine" / "llm_engine.py")
