"""The mutants of tests/mutation_check.py still apply: each edit's text occurs exactly once in the file it edits (a
mutant whose text drifted away from the code would stop the mutation run instead of testing anything), a header's
mutant recompiles sources that include it, and the tests named to catch each mutant exist: collected here (GPU tests
collect on the CPU and skip when run), so a misspelt or outdated node id, parameters included, shows before the GPU
machine does (one did: a fixture parameter renamed test_prefill_fp8's ids and the mutant's run stopped at "not found")."""

import re
import subprocess
import sys

import pytest
from mutation_check import HEADERS, MUTATIONS, REPO, mutate


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name)
def test_mutant_text_is_in_the_source(mutation):
    source = (REPO / mutation.path).read_text()
    mutant = mutate(source, mutation)  # raises RuntimeError unless every text occurs exactly once
    assert mutant != source


def includes(source: str, header: str, seen: frozenset = frozenset()) -> bool:
    """Whether csrc/<source> includes csrc/<header>, directly or through other csrc headers."""
    for name in re.findall(r'^#include "([^"]+)"', (REPO / "csrc" / source).read_text(), re.MULTILINE):
        if name == header or (
            name not in seen and (REPO / "csrc" / name).exists() and includes(name, header, seen | {name})
        ):
            return True
    return False


@pytest.mark.parametrize("mutation", [m for m in MUTATIONS if m.native], ids=lambda m: m.name)
def test_native_mutant_recompiles_what_it_changes(mutation):
    header = mutation.path.endswith(HEADERS)
    assert bool(mutation.rebuild) == header, "a header's mutant names the sources to recompile; a source's does not"
    for source in mutation.sources:
        assert source.endswith((".cu", ".cpp")) and (REPO / "csrc" / source).exists(), source
        if header:
            assert includes(source, mutation.path.removeprefix("csrc/")), f"{source} does not include {mutation.path}"


@pytest.fixture(scope="module")
def collected() -> set[str]:
    """The node ids pytest collects from every file a mutant names (one collection run, a few seconds)."""
    files = sorted({node.partition("::")[0] for m in MUTATIONS for node in m.tests})
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return {line.strip() for line in run.stdout.splitlines() if "::" in line}


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name)
def test_the_catching_tests_exist(mutation, collected):
    assert mutation.tests
    for node in mutation.tests:
        # A node names a test or one parametrization of it; either must be collected.
        assert node in collected or any(c.startswith(node + "[") for c in collected), f"{node} is not collected"
