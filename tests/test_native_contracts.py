"""The contracts between Python and the kernels are written once, in csrc/, and exported by fastqwen._C in every build
(the host-only one too): Python reads them and writes none of its own. Checked here on the CPU against the headers'
text (what the export must say) and against the Python sources (no constant written again, epilogues by name)."""

from __future__ import annotations

import importlib
import pathlib
import re

import pytest
from fastqwen.ops import _native

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "python" / "fastqwen"
GEMV_H = ROOT / "csrc" / "gemv.h"

C = _native.native()
pytestmark = pytest.mark.skipif(C is None, reason="fastqwen._C is not built")


def exported_constants() -> dict[str, object]:
    """_C's constants: its upper-case attributes (numbers, tuples and tables of them)."""
    return {name: getattr(C, name) for name in dir(C) if name.isupper()}


def header_text() -> str:
    return re.sub(r"//[^\n]*", "", GEMV_H.read_text())  # without comments


def camel_to_upper(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper()


def test_the_gemv_constants_exported_are_the_header_values():
    text = header_text()
    for cxx, python in (("kGemvMaxTokens", "GEMV_MAX_TOKENS"), ("kGemvFp8Block", "GEMV_FP8_BLOCK")):
        value = int(re.search(rf"constexpr int {cxx} = (\d+);", text).group(1))
        assert getattr(C, python) == value, python
    low = int(re.search(r"constexpr int kGemvTcMinTokens = (\d+);", text).group(1))
    high = int(re.search(r"constexpr int kGemvTcMaxTokens = (\d+);", text).group(1))
    assert tuple(C.GEMV_TENSOR_CORE_TOKENS) == (low, high)


def test_every_gemv_epilogue_of_the_header_is_exported_by_name():
    body = re.search(r"enum GemvEpilogue : int \{(.*?)\};", header_text(), re.S).group(1)
    kinds = {camel_to_upper(name): int(value) for name, value in re.findall(r"kGemv(\w+) = (\d+)", body)}
    # (the regex found them)
    assert kinds == {"PLAIN": 0, "ADD_RESIDUAL": 1, "NORM_X": 2, "NORM_X_FOLDED": 3, "SEND": 4}
    assert {name: int(member) for name, member in C.GemvEpilogue.__members__.items()} == kinds


def test_gemv_args_binds_every_field_of_the_struct():
    body = re.search(r"struct GemvArgs \{(.*?)\};", header_text(), re.S).group(1)
    fields = set()
    for declaration in body.split(";"):
        declaration = re.sub(r"=[^,]*", "", declaration).strip()  # defaults off
        if declaration:
            names = declaration.split(None, 1)[1]  # after the type
            fields.update(n.strip() for n in names.split(","))
    assert {"out", "x", "w", "m", "n", "k", "epilogue", "norm_weight", "eps", "stream"} <= fields
    args = C.GemvArgs()
    missing = [f for f in sorted(fields) if not hasattr(args, f)]
    assert not missing, f"GemvArgs fields of csrc/gemv.h not bound in csrc/bindings.cpp: {missing}"
    args.epilogue = C.GemvEpilogue.NORM_X
    with pytest.raises(TypeError):  # an epilogue is given by name, never as a number
        args.epilogue = 2


def test_ops_linear_takes_its_kernel_constants_from_the_native_module():
    linear = importlib.import_module("fastqwen.ops.linear")  # (fastqwen.ops.linear the attribute is the function)

    assert linear.GEMV_MAX_TOKENS == C.GEMV_MAX_TOKENS and linear.FP8_BLOCK == C.GEMV_FP8_BLOCK
    assert linear.GemvEpilogue is C.GemvEpilogue
    # The dispatch policy (Python's: which token counts go to the GEMV) stays within what the kernels take; above one
    # token only the tensor-core kernel is worth it.
    low, high = C.GEMV_TENSOR_CORE_TOKENS
    for limit in (linear.DENSE_GEMV_MAX_TOKENS, linear.FP8_GEMV_MAX_TOKENS):
        assert 1 <= limit <= C.GEMV_MAX_TOKENS and limit <= high
    assert low == 2


def python_sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(ROOT), path.read_text()


def test_no_kernel_constant_is_written_again_in_python():
    """An assignment in python/fastqwen to an exported constant's name (or that name without its kernel's prefix:
    GEMV_FP8_BLOCK -> FP8_BLOCK) must read the export, never write the value."""
    exported = exported_constants()
    names = set(exported)
    for name in exported:
        words = name.split("_")
        if len(words) >= 3:
            names.add("_".join(words[1:]))
    assignment = re.compile(r"^[ \t]*(" + "|".join(sorted(names)) + r")[ \t]*(?::[^=\n]*)?=(?!=)(.*)$", re.M)
    written = []
    for path, text in python_sources():
        for match in assignment.finditer(text):
            value = match.group(2)
            if not any(export in value for export in exported):
                written.append(f"{path}: {match.group(0).strip()}")
    assert not written, "kernel constants written in Python instead of read from _C:\n" + "\n".join(written)


def test_python_names_every_gemv_epilogue_it_uses():
    """Epilogues appear in Python as GemvEpilogue.<NAME> only (each a member of _C's), never as numbers."""
    used = set()
    for path, text in python_sources():
        used.update(re.findall(r"GemvEpilogue\.(\w+)", text))
        numbered = re.findall(r"(?:_gemv_norm\(\s*\d|\.epilogue\s*=\s*\d|epilogue=\d)", text)
        assert not numbered, f"{path}: a GEMV epilogue given as a number: {numbered}"
    assert used, "ops.linear names the epilogues it runs"
    assert used <= set(C.GemvEpilogue.__members__), used - set(C.GemvEpilogue.__members__)


@pytest.mark.skipif(not hasattr(C, "set_gemv_tc_fp8_variant"), reason="a build without the CUDA kernels")
def test_the_fp8_pipeline_variable_is_checked_against_the_extensions_count(monkeypatch):
    """FASTQWEN_GEMV_TC_FP8_VARIANT past the extension's GEMV_TC_FP8_PIPELINES is a ValueError naming the variable
    (not a missing build); the last pipeline is taken."""
    import fastqwen._native as loader

    before = C.set_gemv_tc_fp8_variant(0)  # (returns the pipeline it replaces)
    try:
        for value, error in ((C.GEMV_TC_FP8_PIPELINES, True), (C.GEMV_TC_FP8_PIPELINES - 1, False)):
            monkeypatch.setenv("FASTQWEN_GEMV_TC_FP8_VARIANT", str(value))
            monkeypatch.setattr(loader, "_tried", False)
            if error:
                with pytest.raises(ValueError, match="FASTQWEN_GEMV_TC_FP8_VARIANT"):
                    loader.native()
            else:
                assert loader.native() is C and C.set_gemv_tc_fp8_variant(before) == value
    finally:
        C.set_gemv_tc_fp8_variant(before)
        monkeypatch.setattr(loader, "_tried", True)
