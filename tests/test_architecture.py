"""The package's levels, checked on its imports: each part imports only what the design lets it know about.

DESIGN.md, section 1: entry points -> server (frontend) -> engine -> model, scheduler -> ops. The server talks to the
engine only through its client interface and typed messages, and never sees the scheduler, the model, the KV pool or
the kernels; the engine never sees text.
"""

from __future__ import annotations

import ast
import functools
import json
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "python" / "fastqwen"


def imports_of(path: pathlib.Path, tree: ast.AST | None = None) -> set[str]:
    """Every fastqwen module a file imports (or the part of it in `tree`), as a dotted name relative to the package
    ("engine.client")."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    found = set()
    for node in ast.walk(tree or ast.parse(path.read_text())):
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
    "server": [
        "scheduler",
        "model",
        "kvcache",
        "ops",
        "weights",
        "engine.llm_engine",
        "engine.model_runner",
        "engine.sampler",
        "engine.cuda_graph",
        "engine.staging",
    ],
    "frontend": ["scheduler", "model", "kvcache", "ops", "server", "engine.llm_engine", "engine.model_runner"],
    "engine": ["server", "tokenizer", "frontend", "llm"],
    "scheduler": ["engine", "server", "model", "ops", "tokenizer", "frontend"],
    "model": ["engine", "server", "scheduler", "tokenizer", "frontend"],
    "kvcache": ["engine", "server", "model", "scheduler", "frontend"],
    "ops": ["engine", "server", "model", "scheduler", "kvcache", "tokenizer", "frontend"],
    "tokenizer": ["engine", "server", "model", "scheduler", "kvcache", "ops", "frontend"],
    "grammar": ["engine", "server", "model", "scheduler", "kvcache", "ops", "tokenizer", "frontend"],
    # Drafters and the acceptance rule see token ids only; the scheduler asks for drafts, the engine verifies them.
    "speculative": ["engine", "server", "model", "scheduler", "kvcache", "ops", "tokenizer", "frontend", "grammar"],
    # Resolved before anything loads, from the entry points and the engine: it knows files, not the machinery.
    "model_source": ["engine", "server", "model", "scheduler", "kvcache", "ops", "tokenizer", "frontend", "llm"],
    # The native module's loader, at the bottom beside env.py: ops and kvcache both load _C through it.
    "_native": ["engine", "server", "model", "scheduler", "kvcache", "ops", "tokenizer", "frontend", "grammar", "llm"],
    # Within the engine, one way: the factory (make_engine) above tensor parallelism, above the one-GPU engine.
    "engine/tensor_parallel": ["engine.factory"],
    "engine/llm_engine": ["engine.factory", "engine.tensor_parallel", "engine.core_process", "engine.client"],
    # A client of the offline LLM or of a server's HTTP API, never of the server's internals.
    "chat": ["server", "engine", "scheduler", "model", "kvcache", "ops"],
}


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_levels_import_one_way(part):
    violations = []
    for path in files(part):
        for name in imports_of(path):
            for banned in FORBIDDEN[part]:
                if name == banned or name.startswith(banned + "."):
                    violations.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert not violations, "\n".join(violations)


@functools.cache
def module_path(name: str) -> pathlib.Path | None:
    """The file of a fastqwen module given relative to the package ("engine.client"; "" is the package itself)."""
    base = PACKAGE.joinpath(*name.split(".")) if name else PACKAGE
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None  # a name imported from a module ("from .x import y"), or the native module


@functools.cache
def import_time_imports(path: pathlib.Path) -> set[str]:
    """The fastqwen modules a file imports when it is imported: module-level imports, not those inside functions or
    under `if TYPE_CHECKING:` (which load only when called, or never)."""
    tree = ast.parse(path.read_text())
    statements = []
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            pending.extend(node.orelse)
        elif isinstance(node, (ast.If, ast.Try)):
            pending.extend(node.body + node.orelse + getattr(node, "handlers", []) + getattr(node, "finalbody", []))
        elif isinstance(node, ast.ExceptHandler):
            pending.extend(node.body)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            statements.append(node)
    return imports_of(path, ast.Module(body=statements, type_ignores=[]))


@functools.cache
def loaded_by(name: str) -> frozenset[str]:
    """Every fastqwen module that importing `name` loads: its imports at import time, followed, and for each module
    the packages above it (importing engine.messages runs engine/__init__.py first). Not followed: fastqwen's own
    __init__.py, which every module loads (the public API: LLM and the frontend), unless `name` is "" itself."""
    seen: set[str] = set()
    pending = [name]
    while pending:
        current = pending.pop()
        parts = current.split(".") if current else []
        for i in range(0 if name == "" else 1, len(parts) + 1):
            package = ".".join(parts[:i])
            path = module_path(package)
            if package in seen or path is None:
                continue
            seen.add(package)
            pending.extend(import_time_imports(path))
    return frozenset(seen)


# The frontend's side of the boundary loads no engine core: importing the frontend, the server or the messages must
# not pull in the step, the model runner, the model, the scheduler, the KV pool or the kernels (vLLM v1's engine
# package: its messages are light to import). test_the_frontend_side_imports_no_engine_core_and_no_torch checks the same at run
# time, torch included.
LIGHT = {
    "frontend": FORBIDDEN["frontend"],
    "server": FORBIDDEN["server"],
    "engine.messages": ["engine.llm_engine", "engine.model_runner", "scheduler", "model", "kvcache", "ops"],
    "engine.client": ["engine.llm_engine", "engine.model_runner", "scheduler", "model", "kvcache", "ops"],
    "": ["engine.llm_engine", "engine.model_runner", "scheduler", "model", "kvcache", "ops"],  # import fastqwen
}


def _banned(names: set[str], banned: list[str]) -> list[str]:
    return sorted(n for n in names for b in banned if n == b or n.startswith(b + "."))


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_levels_hold_through_what_an_import_loads(part):
    """The level rules again, on everything importing a part loads (through package __init__ files and the modules
    it imports), not only on what its files name: `from ..kvcache.x import y` runs kvcache/__init__.py too."""
    violations = []
    for path in files(part):
        name = ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
        for loaded in _banned(loaded_by(name), FORBIDDEN[part]):
            violations.append(f"importing {name} loads {loaded}")
    assert not violations, "\n".join(violations)


@pytest.mark.parametrize("name", sorted(LIGHT))
def test_the_frontend_side_loads_no_engine_core(name):
    assert not _banned(loaded_by(name), LIGHT[name]), f"importing fastqwen.{name} loads the engine core"


def test_the_load_checker_follows_packages_and_imports():
    """The checker itself: importing the model runner loads the engine package and, through it, the model."""
    loaded = loaded_by("engine.model_runner")
    assert {"engine", "model", "ops"} <= loaded and "engine.model_runner" in loaded_by("engine.llm_engine")
    assert "engine.client" not in loaded_by("server.stats_log")


def test_the_checker_sees_relative_imports():
    """The checker itself: a known import of the engine's client from the server is found."""
    assert "engine.client" in imports_of(PACKAGE / "server" / "async_engine.py")
    assert "scheduler" in imports_of(PACKAGE / "engine" / "llm_engine.py")


def test_the_frontend_side_imports_no_engine_core_and_no_torch():
    """At run time, in a fresh interpreter: `import fastqwen`, the frontend, the server's app and the engine's client
    load neither the engine core nor torch (so no torch.cuda work either): a server whose core runs in its own
    process, and every tool that only validates or tokenizes, start without them."""
    code = (
        "import json, sys, fastqwen, fastqwen.frontend, fastqwen.engine.messages, fastqwen.engine.client, "
        "fastqwen.server.app; print(json.dumps(sorted(sys.modules)))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    loaded = set(json.loads(result.stdout))
    assert "fastqwen.server.app" in loaded  # (the modules were imported at all)
    heavy = [
        "fastqwen.engine.llm_engine",
        "fastqwen.engine.model_runner",
        "fastqwen.engine.tensor_parallel",
        "fastqwen.model",
        "fastqwen.scheduler",
        "fastqwen.kvcache",
        "fastqwen.ops",
        "torch",
        "torch.cuda",
    ]
    assert not [name for name in heavy if name in loaded], f"loaded: {[name for name in heavy if name in loaded]}"


def test_the_http_error_shape_is_written_once():
    """OpenAI's error object is built in server/http_errors.py only; everything else calls error_body/error_response."""
    writers = [
        path.relative_to(PACKAGE).as_posix()
        for path in files("server")
        if path.name != "http_errors.py" and ('{"error": {' in path.read_text() or "ERROR_TYPES" in path.read_text())
    ]
    assert not writers, writers
