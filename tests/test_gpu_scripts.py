"""The GPU machines' scripts are only run on a device, where a mistake costs device time. Here, on the CPU: every
bench/*.sh parses; every stage the headers of bench/gpu_check.sh and bench/gpu_check_tp.sh list has a case that runs
it (and every case is listed); every stage function the shared case calls exists; the suite's four parts (tests1..4)
hold every test file exactly once; and the mutants gpu_check_tp.sh names exist in tests/mutation_check.py."""

from __future__ import annotations

import glob
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = {"gpu_check.sh": os.path.join(ROOT, "bench", "gpu_check.sh"),
           "gpu_check_tp.sh": os.path.join(ROOT, "bench", "gpu_check_tp.sh")}  # fmt: skip


def read(name: str) -> str:
    with open(SCRIPTS[name]) as f:
        return f.read()


def header_stages(text: str) -> set[str]:
    """The stages the header comment lists: a line "#   NAME what it does" (or "#   a1 .. a4  ..."; descriptions
    continue on lines indented further), up to the first line that is not a comment."""
    names = set()
    for line in text.splitlines()[1:]:
        if not line.startswith("#"):
            break
        m = re.match(r"#   ([a-z][a-z0-9]*)(?: \.\. ([a-z]+)(\d+))?(?:,|\s+|$)", line)
        if m and m.group(1) != "bash":
            if m.group(2):  # "tests1 .. tests4"
                first = int(re.search(r"\d+$", m.group(1)).group())
                names.update(f"{m.group(2)}{k}" for k in range(first, int(m.group(3)) + 1))
            else:
                names.add(m.group(1))
    return names


def case_stages(text: str) -> set[str]:
    """The stage names of the `case "$stage" in` arms of the loop over the stages."""
    loop = text[text.index("for stage in $STAGES") :]
    loop = loop[: loop.index("\ndone")]
    names = set()
    for m in re.finditer(r"^    ([a-z0-9|]+)\)", loop, flags=re.M):
        names.update(m.group(1).split("|"))
    return names


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "bench", "*.sh"))), ids=os.path.basename)
def test_every_bench_script_parses(path):
    assert subprocess.run(["bash", "-n", path], capture_output=True).returncode == 0


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_listed_stage_has_a_case_and_every_case_is_listed(name):
    text = read(name)
    listed, cases = header_stages(text), case_stages(text)
    assert listed and cases
    assert listed == cases, f"listed only: {sorted(listed - cases)}; cases only: {sorted(cases - listed)}"


def test_the_shared_case_calls_stage_functions_that_exist():
    text = read("gpu_check.sh")
    shared = re.search(r"^    ([a-z0-9|]+)\)\n(?:.*\n)*?\s+\"stage_\$stage\" ;;", text, flags=re.M)
    assert shared is not None
    defined = set(re.findall(r"^stage_([a-z0-9]+)\(\)", text, flags=re.M))
    missing = set(shared.group(1).split("|")) - defined
    assert not missing, f"no stage_NAME function for {sorted(missing)}"


def test_the_suites_four_parts_hold_every_test_file_once():
    text = read("gpu_check.sh")
    part = text[text.index("TEST_PART_STARTS=") : text.index("stage_tests() {")]
    script = f'cd {ROOT}\n{part}\nfor k in 1 2 3 4; do test_part $k | sed "s/^/$k /"; done\n'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.split("\n")
    seen = [line.split(" ", 1) for line in out if line]
    files = sorted(os.path.relpath(f, ROOT) for f in glob.glob(os.path.join(ROOT, "tests", "test_*.py")))
    assert sorted(f for _, f in seen) == files  # each file once
    assert {k for k, _ in seen} == {"1", "2", "3", "4"}  # and no part empty


def test_the_mutants_the_scripts_name_exist():
    from mutation_check import MUTATIONS

    known = {m.name for m in MUTATIONS}
    text = read("gpu_check_tp.sh")
    named = set()
    for m in re.finditer(r"^\s+names\+?=,?([a-z0-9_,]+)$", text, flags=re.M):
        named.update(n for n in m.group(1).split(",") if n)
    assert named, "gpu_check_tp.sh's mutants stage names none"
    assert named <= known, f"not in tests/mutation_check.py: {sorted(named - known)}"
