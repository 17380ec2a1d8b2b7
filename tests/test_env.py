"""The environment is read in one place: env.py, each variable through a function that documents it."""

from __future__ import annotations

import pathlib
import re

import pytest
from fastqwen import env

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "python" / "fastqwen"

# file -> (what may appear there, why). Writes for other libraries are not switches of ours.
ALLOWED = {
    "env.py": ("", "the one place that reads the environment"),
    "engine/tensor_parallel.py": (
        'os.environ["NCCL_NVLS_ENABLE"] = "0"',
        "a write: NCCL's own variable, set for the ranks' collectives",
    ),
}

READS_THE_ENVIRONMENT = re.compile(r"\benviron\b|\bgetenv\b|\bputenv\b")


def test_only_env_py_reads_the_environment():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not READS_THE_ENVIRONMENT.search(line):
                continue
            allowed = ALLOWED.get(name)
            if allowed is not None and allowed[0] in line:
                continue
            found.append(f"{name}:{number}: {line.strip()}")
    assert not found, "read the environment through env.py:\n" + "\n".join(found)


def test_the_checker_sees_a_read():
    assert READS_THE_ENVIRONMENT.search('key = os.environ.get("FASTQWEN_API_KEY")')
    assert READS_THE_ENVIRONMENT.search('os.getenv("X")')
    assert not READS_THE_ENVIRONMENT.search("a sandboxed environment with trim_blocks")


SWITCHES = [  # (variable, its reader, its default)
    ("FASTQWEN_ALLOW_REFERENCE_ON_GPU", env.allow_reference_on_gpu, False),
    ("FASTQWEN_DISABLE_CUDA_KERNELS", env.disable_cuda_kernels, False),
    ("FASTQWEN_CHECK_INVARIANTS", env.check_invariants_every_step, False),
    ("FASTQWEN_ALLREDUCE_END_BARRIER", env.all_reduce_end_barrier, False),
    ("FASTQWEN_ALLREDUCE_LAMPORT", env.all_reduce_lamport, True),
    ("FASTQWEN_GEMV_TENSOR_CORES", env.gemv_tensor_cores, True),
    ("FASTQWEN_GEMV_FIVE_ROWS", env.gemv_five_rows, True),
    ("FASTQWEN_GEMV_SENDS", env.gemv_sends, False),
    ("FASTQWEN_FP8_FUSED_QUANT", env.fp8_fused_quant, True),
]


@pytest.mark.parametrize(
    "value, expected",  # expected None: the switch's default
    [
        (None, None),
        ("", None),
        ("1", True),
        ("yes", True),
        ("0", False),
        ("false", False),
        ("False", False),
        ("no", False),
        ("off", False),
    ],
)
def test_every_switch_has_one_rule(monkeypatch, value, expected):
    for name, read, default in SWITCHES:
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        assert read() is (default if expected is None else expected), (name, value)


def test_the_fused_all_reduce_norm_is_on_at_two_ranks_unless_set(monkeypatch):
    """Unset, the all-reduce fused with the norm runs at two ranks only (measured faster there, slower at four);
    =1 and =0 set it at every world size, with _flag's spellings."""
    for value in (None, ""):
        if value is None:
            monkeypatch.delenv("FASTQWEN_FUSED_ALLREDUCE_NORM", raising=False)
        else:
            monkeypatch.setenv("FASTQWEN_FUSED_ALLREDUCE_NORM", value)
        assert [env.fused_all_reduce_norm(world) for world in (2, 4, 8)] == [True, False, False], value
    for value, expected in (("1", True), ("yes", True), ("0", False), ("off", False)):
        monkeypatch.setenv("FASTQWEN_FUSED_ALLREDUCE_NORM", value)
        assert [env.fused_all_reduce_norm(world) for world in (2, 4, 8)] == [expected] * 3, value


def test_gemv_tc_fp8_variant_takes_a_pipeline_and_names_itself_otherwise(monkeypatch):
    monkeypatch.delenv("FASTQWEN_GEMV_TC_FP8_VARIANT", raising=False)
    assert env.gemv_tc_fp8_variant() is None  # unset: the kernel's own default
    for value in ("0", "3", "6", "7"):  # (the range is the extension's: _native checks it)
        monkeypatch.setenv("FASTQWEN_GEMV_TC_FP8_VARIANT", value)
        assert env.gemv_tc_fp8_variant() == int(value)
    for value in ("-1", "one", "1.0", " 1"):
        monkeypatch.setenv("FASTQWEN_GEMV_TC_FP8_VARIANT", value)
        with pytest.raises(ValueError, match="FASTQWEN_GEMV_TC_FP8_VARIANT"):
            env.gemv_tc_fp8_variant()


def test_the_chat_client_key_and_no_color(monkeypatch):
    monkeypatch.delenv("FASTQWEN_API_KEY", raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai")
    assert env.client_api_key() == "sk-openai"
    monkeypatch.setenv("FASTQWEN_API_KEY", "sk-ours")
    assert env.client_api_key() == "sk-ours"  # ours first
    monkeypatch.setenv("NO_COLOR", "0")
    assert env.no_color()  # no-color.org: any non-empty value
    monkeypatch.setenv("NO_COLOR", "")
    assert not env.no_color()
