"""Grammar caches are bounded by bytes, not by count (issue 40, item 8).

150 distinct 633 KB regexes once took the engine core to 2.46 GB: 128 compiles kept whatever their size. Now the
engine's compile cache keeps specs by their estimated bytes (compiler.estimated_compile_bytes) under a budget
(EngineConfig.grammar_cache_mib), least recently used first out, and the frontend's verdict cache by its specs' bytes.
The expected contents are worked out here from the spec lengths alone.
"""

from __future__ import annotations

import os

from checkpoints import write_byte_level_tokenizer
from fastqwen.grammar import GrammarCompiler, check_structured, spec
from fastqwen.grammar.compiler import estimated_compile_bytes
from fastqwen.grammar.lru import ByteBudgetLRU
from fastqwen.sampling_params import StructuredOutput

VOCAB = 384


def _regex(i: int, chars: int) -> StructuredOutput:
    """A distinct regex of exactly `chars` characters."""
    head = f"x{i:05d}"
    return StructuredOutput("regex", head + "[a-z]" * ((chars - len(head)) // 5) + "b" * ((chars - len(head)) % 5))


def test_byte_budget_lru():
    lru = ByteBudgetLRU(100, lambda key, value: value)
    for key, size in (("a", 40), ("b", 40), ("c", 10)):
        lru.put(key, size)
    assert lru.get("a") == 40  # a is now the most recently used
    lru.put("d", 30)  # 120 > 100: b, the least recently used, goes
    assert "b" not in lru and all(k in lru for k in "acd") and lru.total_bytes == 80
    lru.put("huge", 101)  # larger than the whole budget: everything goes, itself included
    assert len(lru) == 0 and lru.total_bytes == 0


def test_the_compile_cache_holds_its_byte_budget(tmp_path):
    write_byte_level_tokenizer(str(tmp_path), VOCAB)
    specs = [_regex(i, 20_000) for i in range(12)]
    one = estimated_compile_bytes(specs[0])
    assert all(estimated_compile_bytes(s) == one for s in specs) and one > 20_000 * 100
    budget = 5 * one + one // 2  # room for five specs' single compiles
    compiler = GrammarCompiler(os.path.join(tmp_path, "tokenizer.json"), VOCAB, [2], lexer_groups=4, cache_bytes=budget)
    try:
        for i, s in enumerate(specs):
            compiler.matcher(compiler.submit(s))  # waits for the compile
            if i >= 1:
                compiler.matcher(compiler.submit(specs[0]))  # keeps spec 0 the most recently used but one
            assert compiler.cached_bytes <= budget
        kept = {s.spec for s in specs if compiler.compiles_of(s)}
        # Spec 0 (touched every time) and the four newest: five single compiles. Spec 0's further requests made no
        # second compile: two would pass a quarter of the budget.
        assert kept == {specs[0].spec} | {s.spec for s in specs[-4:]}
        assert compiler.cached_bytes == 5 * one
    finally:
        compiler.close()


def test_extra_compiles_of_one_spec_stay_within_a_quarter_of_the_budget(tmp_path):
    write_byte_level_tokenizer(str(tmp_path), VOCAB)
    s = _regex(0, 2_000)
    one = estimated_compile_bytes(s)
    compiler = GrammarCompiler(
        os.path.join(tmp_path, "tokenizer.json"), VOCAB, [2], lexer_groups=8, cache_bytes=12 * one
    )
    try:
        for _ in range(8):
            compiler.submit(s)
        # 3 compiles fit in a quarter of 12. (Counted in the cache: the futures handed out are fewer when a compile
        # finishes before the next submit, which then gets the finished one; that made this test fail once.)
        assert len(compiler.compiles_of(s)) == 3
    finally:
        compiler.close()


def test_the_verdict_cache_holds_its_byte_budget(monkeypatch):
    budget = 200_000
    monkeypatch.setattr(spec._verdicts, "budget_bytes", budget)
    for i in range(30):
        check_structured(_regex(1000 + i, 20_000))
        assert spec._verdicts.total_bytes <= budget
    assert 5 <= len(spec._verdicts) <= 10  # about 20 KB each
