"""Schemathesis over the server's own /openapi.json (issue 23): requests generated from the document, valid and
invalid, never get a 5xx, and every response has a status, content type and body the document declares.

Bounded: a few dozen examples per operation against a tiny CPU model with a 64-token context, so every accepted
request is short. Not checked: that every schema-valid request is accepted (positive_data_acceptance: the vocabulary,
the context length and the ranges of SamplingParams are not in the schema) and that every schema-invalid one is
refused (negative_data_rejection: bodies are parsed leniently, as OpenAI-compatible servers do, e.g. "1" for 1).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, settings

schemathesis = pytest.importorskip("schemathesis")
from checkpoints import make_checkpoint  # noqa: E402
from schemathesis.checks import negative_data_rejection, positive_data_acceptance  # noqa: E402
from server_process import ServerProcess  # noqa: E402
from test_text import CHAT_TEMPLATE  # noqa: E402

API_KEY = "fuzz-key"


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz")
    make_checkpoint(str(path), tied=True, max_positions=64)
    with open(path / "tokenizer_config.json", "w") as f:
        json.dump({"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>"}, f)
    srv = ServerProcess(
        str(path),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--num-pages",
        "1024",
        "--page-size",
        "8",
        "--served-model-name",
        "tiny",
        "--api-key",
        API_KEY,
        "--log-level",
        "warning",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors_and_conforming_responses(case):
    case.call_and_validate(
        headers={"Authorization": f"Bearer {API_KEY}"},
        excluded_checks=[positive_data_acceptance, negative_data_rejection],
        timeout=60,
    )
