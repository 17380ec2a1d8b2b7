#!/usr/bin/env bash
# The FP8 KV cache on a GPU machine with no network (issue 20): build, tests, kernel figures, the throughput bar.
#   bash bench/fp8kv_check.sh OUTDIR [tests] [kernels] [throughput]
#   tests       build; the FP8 tests and the 16-bit attention / RoPE-KV / engine tests beside them  -> tests.log
#   kernels     bench/kernels.py decode and prefill attention on bf16 and FP8 pools                  -> kernels.json
#   throughput  1,024 in / 1,024 out, 256 requests at once, random Qwen3-8B: bf16 KV then FP8 KV, one run
set -u -o pipefail
OUT="${1:?usage: bash bench/fp8kv_check.sh OUTDIR [tests] [kernels] [throughput]}"
shift
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
. bench/device_out.sh
use_carried_wheels
rc=0
if ! python3 -c "import fastqwen._C" 2> /dev/null; then
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
  start=$(date +%s)
  python3 -m pip install --no-build-isolation --no-deps . > "$OUT/build.log" 2>&1 || { tail -n 40 "$OUT/build.log"; exit 1; }
  echo "build $(( $(date +%s) - start ))s"
fi
for stage in "$@"; do
  case "$stage" in
    tests)
      FASTQWEN_RESULTS_DIR="$OUT" timeout 300 python3 -m pytest -q -rs -p no:cacheprovider tests/test_fp8_kv_gpu.py \
        tests/test_fp8_kv.py tests/test_attention_gpu.py tests/test_kernels_gpu.py tests/test_engine_gpu.py \
        2>&1 | tail -n 40 | tee "$OUT/tests.log" || rc=1 ;;
    kernels)
      timeout 240 python3 bench/kernels.py --ops decode prefill --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" \
        || rc=1 ;;
    throughput)
      for kv in auto fp8_e4m3; do
        timeout 200 python3 bench/throughput.py --model Qwen3-8B --load-format dummy --workload fixed --num-prompts 256 \
          --input-len 1024 --output-len 1024 --max-num-seqs 256 --kv-cache-dtype "$kv" \
          --json "$OUT/throughput_8b_1024x1024_256_$kv.json" 2>&1 | tail -n 5 | tee -a "$OUT/throughput.log" || rc=1
      done ;;
    *) echo "unknown stage $stage"; rc=2 ;;
  esac
done
exit $rc
