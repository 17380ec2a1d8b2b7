#!/usr/bin/env bash
# Build, test and benchmark fastqwen on a GPU machine with no network.
#   bash bench/gpu_check.sh OUTDIR
# Writes OUTDIR/build.log, OUTDIR/nvidia-smi.txt, OUTDIR/tests.log, and for every
# bench/bench_*.py OUTDIR/<name>.log and OUTDIR/<name>.json.
# Exit code: nonzero if the build or the tests failed (benchmarks are recorded only).
set -u -o pipefail

OUT="${1:?usage: bash bench/gpu_check.sh OUTDIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "$0")/.."

echo "== repo: $(pwd)   python: $(python3 --version 2>&1)"

# Optional extra wheels shipped with the checkout (e.g. packages missing on the machine).
if compgen -G ".whl/*.whl" > /dev/null; then
  echo "== installing wheels from .whl/ into /tmp/site"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi

echo "== nvidia-smi"
nvidia-smi 2>&1 | tee "$OUT/nvidia-smi.txt" || true

echo "== build"
start=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -v . 2>&1 | tee "$OUT/build.log"
build_rc=$?
echo "build rc=$build_rc in $(( $(date +%s) - start ))s" | tee -a "$OUT/build.log"

# Run from outside the source tree's python/ so the installed package (with _C) is used.
python3 -c "import fastqwen._C as c, torch; print('fastqwen._C built_with_cuda =', c.built_with_cuda, '| torch', torch.__version__, '| cuda available', torch.cuda.is_available())" 2>&1 | tee -a "$OUT/build.log"

echo "== tests"
FASTQWEN_RESULTS_DIR="$OUT" python3 -m pytest -q -rs tests 2>&1 | tee "$OUT/tests.log"
tests_rc=$?
echo "tests rc=$tests_rc" | tee -a "$OUT/tests.log"

echo "== benchmarks"
bench_rc=0
for b in bench/bench_*.py; do
  [ -e "$b" ] || continue
  name="$(basename "$b" .py)"
  echo "-- $name"
  python3 "$b" --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log"
  rc=$?
  echo "$name rc=$rc" | tee -a "$OUT/$name.log"
  [ "$rc" -eq 0 ] || bench_rc=$rc
done

echo "-- latency and throughput (random Qwen3-8B, offline)"
python3 bench/latency.py --model Qwen3-8B --load-format dummy --prompt-lens 128 1024 --new-tokens 64 --hf \
  --json "$OUT/latency.json" 2>&1 | tee "$OUT/latency.log" || bench_rc=1
python3 bench/throughput.py --model Qwen3-8B --load-format dummy --workload fixed --num-prompts 64 --input-len 128 \
  --output-len 128 --json "$OUT/throughput.json" 2>&1 | tee "$OUT/throughput.log" || bench_rc=1

echo "-- kernels"
python3 bench/kernels.py --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" || bench_rc=1

echo "== serving: random Qwen3-8B behind the HTTP server"
serve_rc=0
python3 bench/make_dummy_checkpoint.py --preset Qwen3-8B --out /tmp/qwen3-8b-dummy

start_server() {  # start_server LOGNAME [extra serve flags]: starts it and waits until /health says 200
  local log="$1"; shift
  python3 -m fastqwen.serve --model /tmp/qwen3-8b-dummy --load-format dummy --port 8000 --max-model-len 4096 "$@" \
    > "$OUT/$log" 2>&1 &
  server_pid=$!
  for _ in $(seq 300); do
    python3 -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:8000/health').status_code != 200)" 2>/dev/null && return 0
    sleep 1
  done
  return 1
}
stop_server() { kill -TERM "$server_pid"; wait "$server_pid"; }

start_server server.log || serve_rc=1
python3 - <<'PY' 2>&1 | tee "$OUT/chat_stream.log"
import httpx, json
body = {"messages": [{"role": "user", "content": "Hello, how are you?"}], "max_tokens": 16, "stream": True,
        "chat_template_kwargs": {"enable_thinking": False}}
with httpx.stream("POST", "http://127.0.0.1:8000/v1/chat/completions", json=body, timeout=120) as r:
    print("status", r.status_code)
    for line in r.iter_lines():
        if line:
            print(line[:200])
PY
python3 bench/serving.py --num-prompts 256 --concurrency 64 --input-len 256 --output-len 128 --json "$OUT/serving.json" 2>&1 | tee "$OUT/serving.log" || serve_rc=1
SHARED="--num-prompts 64 --concurrency 16 --input-len 1088 --shared-prefix-len 1024 --output-len 32"
python3 bench/serving.py $SHARED --json "$OUT/serving_shared_cache_on.json" 2>&1 | tee "$OUT/serving_shared_cache_on.log" || serve_rc=1
stop_server
head -n 20 "$OUT/server.log"
start_server server_nocache.log --disable-radix-cache || serve_rc=1
python3 bench/serving.py $SHARED --json "$OUT/serving_shared_cache_off.json" 2>&1 | tee "$OUT/serving_shared_cache_off.log" || serve_rc=1
stop_server

echo "== summary: build rc=$build_rc tests rc=$tests_rc bench rc=$bench_rc serving rc=$serve_rc" | tee "$OUT/summary.txt"
if [ "$build_rc" -ne 0 ] || [ "$tests_rc" -ne 0 ]; then
  exit 1
fi
exit 0
