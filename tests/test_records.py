"""The benchmark records stay what the README says they are: bench/results/ holds one folder, current/, whose files are
exactly the records the README cites; every bench/ script is documented in bench/README.md; and every
`git show <commit>:<path>` that a record or docs/experiments.md gives for a dropped experiment resolves."""

import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
CURRENT = os.path.join(RESULTS, "current")


def _read(*parts: str) -> str:
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def _records() -> list[str]:
    return sorted(name for name in os.listdir(CURRENT) if name != "README.md")


def test_results_hold_only_the_current_records():
    assert os.listdir(RESULTS) == ["current"], "bench/results/ keeps one folder; older records live in git history"
    assert all(name.endswith(".md") for name in _records())


def test_every_record_is_cited_by_the_readme_and_every_citation_exists():
    readme = _read("README.md")
    uncited = [name for name in _records() if f"`{name}`" not in readme and f"current/{name}" not in readme]
    assert not uncited, f"records no README figure cites: {uncited}"
    cited = set(re.findall(r"bench/results/([\w./-]+)", readme))
    missing = [path for path in cited if not os.path.exists(os.path.join(RESULTS, path))]
    assert not missing, f"README cites records that do not exist: {missing}"
    index = _read("bench", "results", "current", "README.md")
    assert [name for name in _records() if f"`{name}`" not in index] == []


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(CURRENT) if n != "README.md"))
def test_a_record_states_device_date_command_and_commit(name):
    text = _read("bench", "results", "current", name)
    for field in ("Device:", "Date:", "ommand"):
        assert field in text, f"{name} does not state {field!r}"
    assert re.search(r"\b[0-9a-f]{7,40}\b", text), f"{name} names no commit"


def test_bench_readme_documents_every_script():
    readme = _read("bench", "README.md")
    scripts = [n for n in os.listdir(os.path.join(ROOT, "bench")) if os.path.isfile(os.path.join(ROOT, "bench", n))]
    undocumented = [n for n in scripts if n != "README.md" and f"`{n}" not in readme]
    assert not undocumented, f"bench/README.md does not say what these do: {undocumented}"


def test_git_show_references_resolve():
    if shutil.which("git") is None or not os.path.exists(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout")
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True, text=True)
    if shallow.stdout.strip() == "true":
        pytest.skip("a shallow clone: the commits that hold the dropped experiments are not here")
    texts = [_read("docs", "experiments.md")] + [_read("bench", "results", "current", n) for n in _records()]
    refs = sorted({m for text in texts for m in re.findall(r"git show ([0-9a-f]{7,40}:[\w./<>-]+)", text)})
    refs = [ref for ref in refs if "<" not in ref]  # the template `git show 1274b3f:bench/results/<folder>/...`
    assert len(refs) > 20
    check = subprocess.run(
        ["git", "cat-file", "--batch-check"],
        input="\n".join(refs) + "\n",
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    missing = [ref for ref, line in zip(refs, check.stdout.splitlines()) if line.endswith("missing")]
    assert not missing, f"these commits do not hold these paths: {missing}"
