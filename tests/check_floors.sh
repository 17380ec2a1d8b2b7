#!/usr/bin/env bash
# Run a quick subset of the tests against the dependency floors (tests/floors.txt), installed into a throwaway
# folder in front of the environment's own packages. Not part of .ci/run (about 3 minutes on 2 cores, most of it
# installing); run it when a floor in pyproject.toml changes:  bash tests/check_floors.sh
set -euo pipefail
cd "$(dirname "$0")/.."
target=$(mktemp -d /tmp/fastqwen-floors.XXXXXX)
trap 'rm -rf "$target"' EXIT
# fastapi brings the starlette release it was made for; the others need nothing older than what is installed.
python3 -m pip install -q --target "$target" "$(grep -E '^fastapi==' tests/floors.txt)"
python3 -m pip install -q --no-deps --target "$target" $(grep -vE '^(#|fastapi==|$)' tests/floors.txt)
PYTHONPATH="$target:$PWD/python:${PYTHONPATH:-}" python3 - <<'PY'
import importlib.metadata as m
for line in open("tests/floors.txt"):
    if line.strip() and not line.startswith("#"):
        name, version = line.strip().split("==")
        assert m.version(name) == version, (name, m.version(name), version)
print("floors installed:", ", ".join(l.strip() for l in open("tests/floors.txt") if "==" in l))
PY
# Where each floor's API is used: grammars (llguidance), the engine-core process (pyzmq, msgspec), HTTP (the rest).
PYTHONPATH="$target:$PWD/python:${PYTHONPATH:-}" python3 -m pytest -q -p no:cacheprovider \
  tests/test_structured_output.py tests/test_engine_core.py tests/test_server.py \
  -k "schema_mix_and_regex_offline or bad_specs_are_refused or choice_grammar or mixed_batch or completion_equals_offline or streamed_completion or chat_streaming_and_not or error_statuses or exact_sse_framing"
