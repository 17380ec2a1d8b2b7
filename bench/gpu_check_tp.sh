#!/usr/bin/env bash
# Tensor parallelism on a machine with 2 (or more) GPUs (nvidia-h200-x2): build, the TP tests, then the TP bars.
#   bash bench/gpu_check_tp.sh OUTDIR [STAGE ...]
# Stages (default: tests allreduce latency fp8 throughput; each fits in one 10-minute device call):
#   tests       build, pytest the tensor-parallel tests (GPU and CPU)                  -> build.log, tests.log
#   allreduce   bench/tp_bench.py: custom all-reduce vs NCCL at decode sizes, and the all-reduce + fused_add_rms_norm
#               against the all-reduce fused with the norm, hidden 4096 and 5120 in one run; then one rank's GEMVs at
#               the TP=2 shard shapes of Qwen3-8B and Qwen3-32B (bench/bench_gemv.py --tp 2)
#   latency     batch-1 TPOT with its limit (rank 0's weight bytes over the copy bandwidth of the same run), random
#               Qwen3-32B at TP=2 and TP=1, then Qwen3-8B at TP=2 and TP=1
#   fp8         batch-1 TPOT with its limit, random Qwen3-32B with FP8 weights (quantized shard by shard) at TP=2
#   throughput  128 in / 1024 out, 256 requests at once, Qwen3-32B at TP=1 and TP=2, then Qwen3-8B at TP=2
# NCCL_NVLS_ENABLE=0 throughout (no NVLink multicast objects: they can take the host's GPUs out of service).
set -u -o pipefail

OUT="${1:?usage: bash bench/gpu_check_tp.sh OUTDIR [tests|allreduce|latency|fp8|throughput ...]}"
shift
STAGES="${*:-tests allreduce latency fp8 throughput}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "$0")/.."
. bench/device_out.sh
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0

use_carried_wheels
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
nvidia-smi topo -m >> "$OUT/nvidia-smi.txt" 2>&1 || true
rc=0

build() {
  (cd /tmp && python3 -c "import fastqwen._C as c; assert c.built_with_cuda and hasattr(c, 'custom_all_reduce')") 2>/dev/null && return
  echo "== build"
  python3 -m pip install --no-build-isolation --no-deps . > "$OUT/build.log" 2>&1 || { tail -n 40 "$OUT/build.log"; exit 1; }
}

run() {  # run NAME TIMEOUT CMD...
  local name="$1" limit="$2"; shift 2
  echo "-- $name"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local r=$?
  echo "$name rc=$r" | tee -a "$OUT/$name.log"
  tail -n 5 "$OUT/$name.log"
  [ "$r" -eq 0 ] || rc=$r
}

for stage in $STAGES; do
  build
  case "$stage" in
    tests)
      FASTQWEN_RESULTS_DIR="$OUT" timeout 400 python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider \
        tests/test_tensor_parallel_gpu.py tests/test_tensor_parallel.py tests/test_tensor_parallel_fp8.py \
        tests/test_all_reduce_add_rms_norm.py \
        tests/test_cuda_graph_gpu.py \
        > "$OUT/tests.log" 2>&1 || rc=1
      pytest_report "$OUT/tests.log" 40 ;;
    allreduce)
      run allreduce 300 python3 bench/tp_bench.py --hidden 4096 5120 --json "$OUT/allreduce.json"
      # One rank's GEMVs at the TP=2 shard shapes against the copy rate (one GPU is enough; issue 46)
      run gemv_tp2 200 python3 bench/bench_gemv.py --presets Qwen3-8B Qwen3-32B --tp 2 --batches 1 2 4 8 \
        --json "$OUT/gemv_tp2.json" ;;
    latency)
      for spec in "32B 2" "32B 1" "8B 2" "8B 1"; do
        set -- $spec
        run "latency_$1_tp$2" 240 python3 bench/latency.py --model "Qwen3-$1" --load-format dummy --tp "$2" \
          --prompt-lens 128 --new-tokens 64 --json "$OUT/latency_$1_tp$2.json"
      done ;;
    fp8)
      run latency_32B_tp2_fp8 240 python3 bench/latency.py --model Qwen3-32B --load-format dummy --tp 2 \
        --quantization fp8 --prompt-lens 128 --new-tokens 64 --json "$OUT/latency_32B_tp2_fp8.json" ;;
    throughput)
      for spec in "32B 1" "32B 2" "8B 2"; do
        set -- $spec
        run "throughput_$1_tp$2_128x1024" 400 python3 bench/throughput.py --model "Qwen3-$1" --load-format dummy \
          --tp "$2" --workload fixed --num-prompts 256 --input-len 128 --output-len 1024 \
          --json "$OUT/throughput_$1_tp$2_128x1024.json"
      done ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
echo "== summary rc=$rc" | tee "$OUT/summary.txt"
pack_out "$OUT"
exit "$rc"
