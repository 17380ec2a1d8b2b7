#!/usr/bin/env bash
# Batch-1 latency of this tree (A) against another source tree (B, e.g. `git archive <commit>` unpacked into an
# ignored folder and carried), in one device call: both built side by side, then bench/latency.py alternating
# A, B, A, B so that drift between runs shows as spread rather than as a difference.
#   bash bench/ab_latency.sh OUTDIR BASE_TREE [ROUNDS] [QUANTIZATIONS...]
set -u -o pipefail
OUT="$(mkdir -p "$1" && cd "$1" && pwd)"; BASE="$(cd "$2" && pwd)"; ROUNDS="${3:-2}"; QUANTS="${*:4}"
QUANTS="${QUANTS:-none fp8}"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
. bench/device_out.sh
use_carried_wheels
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/device.txt" 2>&1
python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/ab_A . > "$OUT/build_A.log" 2>&1 &
(cd "$BASE" && python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/ab_B . > "$OUT/build_B.log" 2>&1) &
wait
for round in $(seq "$ROUNDS"); do
  for q in $QUANTS; do
    for side in A B; do
      tree=.; [ "$side" = B ] && tree="$BASE"
      PYTHONPATH="/tmp/ab_$side:$PYTHONPATH" timeout 150 python3 "$tree/bench/latency.py" --model Qwen3-8B \
        --load-format dummy --quantization "$q" --prompt-lens 128 1024 --new-tokens 64 \
        --json "$OUT/latency_${q}_${side}_$round.json" > "$OUT/latency_${q}_${side}_$round.log" 2>&1
      python3 - "$OUT/latency_${q}_${side}_$round.json" "$side" "$q" "$round" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(sys.argv[2], sys.argv[3], "round", sys.argv[4], [(r["prompt_tokens"], round(r["offline"]["tpot_ms"], 3)) for r in d["rows"]],
      "floor", round(d["tpot_floor_ms"], 3))
PY
    done
  done
done
pack_out "$OUT"
