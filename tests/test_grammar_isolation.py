"""No structured-output spec can take the server down (issue 40, item 1).

llguidance's grammar compile overflows the stack (a segfault) on long rule / $ref chains. The specs the issue found
(2,000 chained $defs, 5,000 chained Lark rules) must come back as 400s naming the field from a real server, which
then serves the next request; the bounds (grammar/bounds.py) are checked at their edges; a spec past the bounds that
still crashes llguidance kills only a validator worker (grammar/validator.py); and what the validator passes, the
engine compiles without crashing (its threads have four times the validator's stack).
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from fastqwen import LLM, SamplingParams
from fastqwen.errors import InvalidRequestError
from fastqwen.grammar import bounds, check_structured
from fastqwen.grammar.validator import GrammarValidator, ValidatorCrashed
from fastqwen.sampling_params import StructuredOutput
from server_process import ServerProcess
from test_structured_output import _write_checkpoint


def _defs_chain(links: int) -> str:
    """The issue's schema: each $def is anyOf [the next, integer]."""
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"type": "integer"}]} for i in range(links)}
    defs[f"d{links}"] = {"type": "integer"}
    return json.dumps({"$ref": "#/$defs/d0", "$defs": defs})


def _mixed_chain(links: int) -> str:
    """The deepest-recursing shape measured: two $refs a link, under properties, anyOf and array items."""

    def link(i):
        ref = {"$ref": f"#/$defs/d{i + 1}"}
        return {
            "type": "object",
            "properties": {
                "x": {"anyOf": [ref, {"type": "null"}]},
                "y": {"type": "array", "items": {"anyOf": [ref, {"type": "integer"}]}},
            },
        }

    defs = {f"d{i}": link(i) for i in range(links)}
    defs[f"d{links}"] = {"type": "integer"}
    return json.dumps({"$ref": "#/$defs/d0", "$defs": defs})


def _lark_chain(rules: int) -> str:
    """The issue's grammar: `rN: rN+1 | "tN"`, `rules` rules in all."""
    lines = ["start: r0"] + [f'r{i}: r{i + 1} | "t{i}"' for i in range(rules - 2)] + [f'r{rules - 2}: "end"']
    return "\n".join(lines)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("isolation"))
    _write_checkpoint(path)
    return path


# ---- the bounds, at their edges ---------------------------------------------------------------------------------


def test_lark_rule_bound():
    assert _lark_chain(10).count("\n") + 1 == 10
    check_structured(StructuredOutput("grammar", _lark_chain(bounds.MAX_GRAMMAR_RULES)))
    with pytest.raises(InvalidRequestError) as e:
        check_structured(StructuredOutput("grammar", _lark_chain(bounds.MAX_GRAMMAR_RULES + 1), field="guided_grammar"))
    assert e.value.param == "guided_grammar" and f"{bounds.MAX_GRAMMAR_RULES + 1} rules" in str(e.value)
    gbnf = "root ::= r0\n" + "".join(f'r{i} ::= r{i + 1} | "t{i}"\n' for i in range(1200)) + 'r1200 ::= "end"\n'
    with pytest.raises(InvalidRequestError, match="rules"):  # counted after the conversion to Lark
        check_structured(StructuredOutput("grammar", gbnf, field="ebnf"))


def test_schema_ref_bound():
    check_structured(StructuredOutput("json_schema", _mixed_chain((bounds.MAX_SCHEMA_REFS - 1) // 2)))
    with pytest.raises(InvalidRequestError) as e:
        check_structured(
            StructuredOutput("json_schema", _defs_chain(bounds.MAX_SCHEMA_REFS + 1), field="response_format")
        )
    assert e.value.param == "response_format" and "$ref" in str(e.value)
    lark = (
        'start: %json{"$defs": {"a": {"type": "integer"}}, "anyOf": ['
        + ", ".join(['{"$ref": "#/$defs/a"}'] * 501)
        + "]}"
    )
    with pytest.raises(InvalidRequestError, match=r"\$ref"):  # and inside a grammar's %json
        check_structured(StructuredOutput("grammar", lark, field="guided_grammar"))


def test_schema_depth_and_size_bounds():
    def nested(levels: int) -> str:  # `levels` objects deep, counting the outermost
        return '{"type": "array", "items": ' * (levels - 1) + '{"type": "integer"}' + "}" * (levels - 1)

    check_structured(StructuredOutput("json_schema", nested(bounds.MAX_SCHEMA_DEPTH - 1)))
    for spec in (nested(bounds.MAX_SCHEMA_DEPTH + 1), "[" * 100_000 + "]" * 100_000):  # the second: too deep to parse
        with pytest.raises(InvalidRequestError, match="nest") as e:
            check_structured(StructuredOutput("json_schema", spec, field="guided_json"))
        assert e.value.param == "guided_json"
    # 600k characters of three bytes each: under the character limit, over the byte limit.
    with pytest.raises(InvalidRequestError, match="bytes") as e:
        check_structured(StructuredOutput("regex", "€" * 600_000, field="guided_regex"))
    assert e.value.param == "guided_regex"


# ---- past the bounds: a crash costs one request --------------------------------------------------------------------


def test_a_crashing_grammar_kills_only_a_validator_worker():
    validator = GrammarValidator(workers=1)
    try:
        assert validator.validate(_lark_chain(50)) is None
        with pytest.raises(ValidatorCrashed, match="crashed"):
            validator.validate(_lark_chain(40_000))  # crashes llguidance on any stack under hundreds of MB
        assert validator.num_crashes == 1
        assert validator.validate('start: "a"') is None  # the next one is served (by a fresh worker)
        assert "missing" in validator.validate("start: missing")
    finally:
        validator.close()


def test_past_the_bounds_the_offline_llm_survives_and_caches_the_verdict(folder, monkeypatch):
    """With the rule bound lifted, the issue's 5,000-rule grammar crashes a validator worker: the request gets a 400,
    the process (this one) lives on, the verdict is cached (the next try kills no worker), other requests run."""
    from fastqwen.grammar.validator import default_validator

    monkeypatch.setattr(bounds, "MAX_GRAMMAR_RULES", 10**6)
    llm = LLM(folder, dtype="float32", device="cpu", num_pages=256, page_size=8)
    crashes = default_validator().num_crashes
    killer = SamplingParams(
        max_tokens=4, structured=StructuredOutput("grammar", _lark_chain(40_000), field="guided_grammar")
    )
    for _ in range(2):
        with pytest.raises(InvalidRequestError, match="crashed the grammar validator") as e:
            llm.generate(["x"], killer, use_tqdm=False)
        assert e.value.param == "guided_grammar"
    assert default_validator().num_crashes == crashes + 1
    out = llm.generate(
        ["x"], SamplingParams(max_tokens=8, structured=StructuredOutput("regex", "[0-9]{3}")), use_tqdm=False
    )
    assert len(out[0].text) == 3 and out[0].text.isdigit()


_COMPILE_IN_ENGINE = """
import sys
from fastqwen.grammar import GrammarCompiler, bounds
from fastqwen.sampling_params import StructuredOutput
bounds.MAX_GRAMMAR_RULES = 10**6
compiler = GrammarCompiler(sys.argv[1] + "/tokenizer.json", 384, [2])
structured = StructuredOutput("grammar", sys.stdin.read())
compiler.matcher(compiler.submit(structured))  # raises if the compile failed; a crash ends the process
print("compiled")
"""


def test_what_the_validator_passes_the_engine_compiles(folder, monkeypatch):
    """A Lark chain just short of crashing the validator's stack compiles on the engine's compile threads (in a child
    process: were the engine's stack no larger than the validator's, it would crash the test runner)."""
    monkeypatch.setattr(bounds, "MAX_GRAMMAR_RULES", 10**6)
    passing = _lark_chain(4_000)  # crashes an 8 MiB stack; the validator's 16 MiB takes it
    check_structured(StructuredOutput("grammar", passing))
    run = subprocess.run(
        [sys.executable, "-c", _COMPILE_IN_ENGINE, folder], input=passing, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0 and "compiled" in run.stdout, (run.returncode, run.stderr[-2000:])


# ---- the issue's reproductions against a real server -----------------------------------------------------------------


@pytest.fixture(scope="module")
def server(folder):
    srv = ServerProcess(
        folder,
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--num-pages",
        "512",
        "--page-size",
        "8",
        "--served-model-name",
        "m",
    )
    yield srv
    srv.stop()


def _complete(server, timeout=120, **body) -> httpx.Response:
    return httpx.post(
        server.url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 4, **body}, timeout=timeout
    )


def test_the_issues_crashing_specs_get_400s_from_a_real_server_which_serves_on(server):
    attacks = [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": json.loads(_defs_chain(2000))},
                }
            },
            "response_format",
        ),
        ({"guided_grammar": _lark_chain(5000)}, "guided_grammar"),
    ]
    for body, field in attacks:
        r = _complete(server, **body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field
        ok = _complete(server, guided_regex="[a-c]{4}")
        assert ok.status_code == 200, ok.text
        assert len(ok.json()["choices"][0]["text"]) == 4
    assert server.proc.poll() is None


def test_a_grammar_that_gives_up_is_an_error_over_http(server):
    """Issue 40, item 5, through the server (test_grammar_give_up.py has it offline): no "stop" for a given-up grammar."""
    from test_grammar_give_up import INFINITE_OBJECT, REF_CYCLE

    r = _complete(
        server, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": json.loads(REF_CYCLE)}}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    r = _complete(server, max_tokens=32, guided_json=json.loads(INFINITE_OBJECT))
    assert r.status_code == 500 and "cannot satisfy the grammar" in r.json()["error"]["message"], r.text
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        timeout=120,
        json={
            "model": "m",
            "prompt": "x",
            "max_tokens": 32,
            "stream": True,
            "guided_json": json.loads(INFINITE_OBJECT),
        },
    ) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "cannot satisfy the grammar" in events[-1]["error"]["message"]
    assert all(c["finish_reason"] != "stop" for e in events[:-1] for c in e["choices"])
