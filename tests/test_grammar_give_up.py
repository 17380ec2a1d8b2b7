"""A grammar that gives up does not report success (issue 40, item 5).

A schema no finite output satisfies is refused with a 400 when the first mask already says so (an unsatisfiable $ref
cycle, an empty regex class), and otherwise ends its request with finish_reason "error" and the reason (a recursive
required object: only infinite instances). Checked against what the schema allows, by hand; over HTTP in
test_grammar_isolation.py (which starts the one server).
"""

from __future__ import annotations

import json

import pytest
from fastqwen import LLM, SamplingParams
from fastqwen.errors import InvalidRequestError
from fastqwen.sampling_params import StructuredOutput
from test_structured_output import _write_checkpoint

# Every instance would be {"a": {"a": ...}} forever: nothing finite satisfies it, but "{" is a valid prefix.
INFINITE_OBJECT = json.dumps({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]})
REF_CYCLE = json.dumps({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}})


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("give_up"))
    _write_checkpoint(folder)
    return LLM(folder, dtype="float32", device="cpu", num_pages=256, page_size=8, max_num_seqs=8)


@pytest.mark.parametrize("kind, spec", [("json_schema", REF_CYCLE), ("regex", r"[^\s\S]")])
def test_a_grammar_with_no_output_is_a_400(llm, kind, spec):
    with pytest.raises(InvalidRequestError, match="no output satisfies it") as e:
        llm.generate(
            ["x"],
            SamplingParams(max_tokens=8, structured=StructuredOutput(kind, spec, field="guided_json")),
            use_tqdm=False,
        )
    assert e.value.param == "guided_json"


def test_a_grammar_that_gives_up_midway_ends_with_an_error(llm):
    infinite = SamplingParams(max_tokens=32, structured=StructuredOutput("json_schema", INFINITE_OBJECT))
    finite = SamplingParams(max_tokens=64, structured=StructuredOutput("json_schema", '{"type": "boolean"}'))
    given_up, control = llm.generate(["x", "y"], [infinite, finite], use_tqdm=False)
    assert given_up.finish_reason == "error", (given_up.text, given_up.finish_reason)
    assert "cannot satisfy the grammar" in given_up.error
    assert control.finish_reason == "stop" and control.text in ("true", "false")  # its batch-mate is unaffected
