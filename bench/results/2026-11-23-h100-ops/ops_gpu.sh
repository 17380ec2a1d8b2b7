#!/usr/bin/env bash
# Issue 17 on a GPU: build, serve random Qwen3-0.6B weights with vLLM metric names, look at the logs and /metrics,
# then the ops tests and the GPU engine tests.
set -u
OUT="$1"
cd "$(dirname "$0")"
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/device.txt" 2>&1
python3 -m pip install --no-build-isolation --no-deps . > "$OUT/build.log" 2>&1; echo "build rc=$?" >> "$OUT/build.log"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >> "$OUT/build.log" 2>&1
export PYTHONPATH=/tmp/site
(cd /tmp && exec timeout 200 python3 -m fastqwen serve Qwen3-0.6B --load-format dummy --metrics-compat vllm \
  --stats-interval 1 --enable-request-log --port 8011 > "$OUT/serve.log" 2>&1) &
SERVER=$!
for i in $(seq 1 120); do curl -sf -o /dev/null http://127.0.0.1:8011/health && break; sleep 1; done
for i in $(seq 1 16); do
  curl -s http://127.0.0.1:8011/v1/completions -H 'content-type: application/json' -H "x-request-id: gpu-$i" \
    -d '{"prompt":[785,6722,315,9625,374],"max_tokens":256,"ignore_eos":true}' -o /dev/null &
done
sleep 8
curl -s http://127.0.0.1:8011/metrics > "$OUT/metrics.txt"
curl -sI http://127.0.0.1:8011/health >> "$OUT/metrics.txt"
kill -INT "$SERVER"; wait "$SERVER"; echo "server exit status $?" >> "$OUT/serve.log"
python3 -m pytest -q -p no:warnings tests/test_operations.py tests/test_startup.py tests/test_model_sources.py \
  tests/test_engine_gpu.py tests/test_cuda_graph_gpu.py tests/test_real_weights.py -rs > "$OUT/tests.log" 2>&1
echo "tests rc=$?" >> "$OUT/tests.log"
