#!/usr/bin/env bash
# Issue 19's device runs: build, the GEMV/FP8 GPU tests, the kernel benchmark, and the batch-1 latency and 128/1024
# throughput of random Qwen3-8B in bf16 and FP8 (offline, and with the `http` stage through the server).
#   bash bench/gpu_fp8w.sh OUTDIR [build] [tests] [gemv] [latency] [throughput] [http] [suite] [pdl] [rates] [sass] [latency_ab] [small_batch]
#   [leave_out] [ncu] [serving] [first_requests]
# (rates: bench/dequant_rates.cu, the inner loops' arithmetic ceilings; sass: the GEMV kernels' disassembly;
# latency_ab: batch-1 latency with the GEMV's tensor-core kernel on and off; small_batch: decode throughput at 2 to 8
# in flight, tensor-core GEMV on and off; leave_out: the batch-1 step with kinds of kernels left out; ncu: Nsight
# Compute on the one-token GEMVs; serving: 128/1,024 at 256 in flight offline and, with SGL_TOOLS naming SGLang's
# benchmark package, through the server with its bench_serving; first_requests: the first five streams of a fresh
# server, with --skip-warmup and without)
# (FP8W_MORE_TESTS: more test files; FP8W_GEMV_BATCHES: token counts of the GEMV benchmark; FP8W_THROUGHPUT: the
# quantizations to run; FP8W_PROMPTS: requests per run; FP8W_SMALL_Q, FP8W_SMALL_BATCHES: small_batch's
# quantizations and request counts; FP8W_LEAVE_OUT: leave_out's variants)
set -u -o pipefail
OUT="$(mkdir -p "$1" && cd "$1" && pwd)"; shift
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
. bench/device_out.sh
use_carried_wheels
run() { local name="$1" limit="$2"; shift 2; echo "-- $name"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$?" | tee -a "$OUT/$name.log"; tail -n 25 "$OUT/$name.log"; }
for stage in "$@"; do
  case "$stage" in
    build)
      nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/device.txt" 2>&1
      start=$(date +%s); python3 -m pip install --no-build-isolation --no-deps . > "$OUT/build.log" 2>&1
      echo "build rc=$? in $(( $(date +%s) - start ))s" | tee -a "$OUT/build.log" ;;
    tests)
      FASTQWEN_RESULTS_DIR="$OUT" run tests 300 python3 -m pytest -q -rs -p no:cacheprovider tests/test_gemv_gpu.py \
        ${FP8W_MORE_TESTS:-} ;;
    gemv) run bench_gemv 240 python3 bench/bench_gemv.py --batches ${FP8W_GEMV_BATCHES:-1 2 4 8 16} --iters 20 \
            --json "$OUT/bench_gemv.json" ;;
    small_batch)  # decode at 2 to 8 in flight (all requests together: 128 in, 512 out), tensor-core GEMV on and off
      for q in ${FP8W_SMALL_Q:-none fp8}; do
        for n in ${FP8W_SMALL_BATCHES:-2 4 8}; do
          for tc in 1 0; do
            FASTQWEN_GEMV_TENSOR_CORES=$tc run "small_batch_${q}_${n}_tc$tc" 120 python3 bench/throughput.py \
              --model Qwen3-8B --load-format dummy --quantization "$q" --workload fixed --num-prompts "$n" \
              --input-len 128 --output-len 512 --json "$OUT/small_batch_${q}_${n}_tc$tc.json"
          done
        done
      done ;;
    latency_ab)  # batch-1 latency (128-token prompt) with the GEMV's tensor-core kernel on (1) and off (0)
      for q in none fp8; do
        for tc in ${FP8W_AB_TENSOR_CORES:-1 0}; do
          FASTQWEN_GEMV_TENSOR_CORES=$tc run "latency_8b_${q}_tc$tc" 150 python3 bench/latency.py --model Qwen3-8B \
            --load-format dummy --quantization "$q" --prompt-lens 128 --new-tokens 64 --json "$OUT/latency_8b_${q}_tc$tc.json"
        done
      done ;;
    latency)
      for q in none fp8; do
        run "latency_8b_$q" 150 python3 bench/latency.py --model Qwen3-8B --load-format dummy --quantization "$q" \
          --prompt-lens 128 1024 --new-tokens 64 --json "$OUT/latency_8b_$q.json"
      done ;;
    throughput)
      for q in ${FP8W_THROUGHPUT:-none fp8}; do
        run "throughput_8b_128x1024_$q" 200 python3 bench/throughput.py --model Qwen3-8B --load-format dummy \
          --quantization "$q" --workload fixed --num-prompts ${FP8W_PROMPTS:-512} --input-len 128 --output-len 1024 \
          --json "$OUT/throughput_8b_128x1024_$q.json"
      done ;;
    http)  # the server and an offline engine side by side (small KV pools), each measured in turn by one latency.py
      python3 bench/make_dummy_checkpoint.py --preset Qwen3-8B --out /tmp/qwen3-8b-dummy > /dev/null
      for q in none fp8; do
        python3 -m fastqwen.serve --model /tmp/qwen3-8b-dummy --load-format dummy --quantization "$q" --port 8000 \
          --max-model-len 8192 --num-pages 2048 > "$OUT/server_$q.log" 2>&1 &
        pid=$!
        for _ in $(seq 240); do
          python3 -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:8000/health').status_code != 200)" 2>/dev/null && break
          sleep 1
        done
        run "latency_8b_$q" 150 python3 bench/latency.py --model Qwen3-8B --load-format dummy --quantization "$q" \
          --num-pages 2048 --prompt-lens 128 1024 --new-tokens 64 --url http://127.0.0.1:8000 --json "$OUT/latency_8b_$q.json"
        kill -TERM "$pid"; wait "$pid"
      done ;;
    serving)  # 128/1,024 at 256 in flight, bf16 and FP8: offline, then the server with SGLang's client (SGL_TOOLS)
      python3 bench/make_dummy_checkpoint.py --preset Qwen3-8B --out /tmp/qwen3-8b-dummy > /dev/null
      for q in ${FP8W_THROUGHPUT:-none fp8}; do
        run "throughput_8b_128x1024_$q" 200 python3 bench/throughput.py --model Qwen3-8B --load-format dummy \
          --quantization "$q" --workload fixed --num-prompts ${FP8W_PROMPTS:-512} --input-len 128 --output-len 1024 \
          --json "$OUT/throughput_8b_128x1024_$q.json"
        [ -n "${SGL_TOOLS:-}" ] || { echo "SGL_TOOLS not set: no HTTP run"; continue; }
        python3 -m fastqwen.serve --model /tmp/qwen3-8b-dummy --load-format dummy --quantization "$q" --port 8000 \
          --max-model-len 8192 --max-queued-requests 4096 > "$OUT/server_serving_$q.log" 2>&1 &
        pid=$!
        for _ in $(seq 240); do
          python3 -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:8000/health').status_code != 200)" 2>/dev/null && break
          sleep 1
        done
        (cd "$SGL_TOOLS" && run "bench_serving_$q" 200 python3 -m sglang.benchmark.serving --host 127.0.0.1 --port 8000 \
          --backend vllm --dataset-name random-ids --random-range-ratio 1 --random-input-len 128 --random-output-len 1024 \
          --num-prompts ${FP8W_PROMPTS:-512} --max-concurrency 256 --tokenizer /tmp/qwen3-8b-dummy \
          --model /tmp/qwen3-8b-dummy --output-file "$OUT/bench_serving_$q.jsonl")
        kill -TERM "$pid"; wait "$pid"
      done ;;
    first_requests)  # the first requests a fresh server answers, bf16, without and with its warm-up request
      python3 bench/make_dummy_checkpoint.py --preset Qwen3-8B --out /tmp/qwen3-8b-dummy > /dev/null
      for mode in skip warm; do
        python3 -m fastqwen.serve --model /tmp/qwen3-8b-dummy --load-format dummy --port 8000 --max-model-len 8192 \
          --num-pages 2048 $([ "$mode" = skip ] && echo --skip-warmup) > "$OUT/server_first_$mode.log" 2>&1 &
        pid=$!
        for _ in $(seq 240); do
          python3 -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:8000/health').status_code != 200)" 2>/dev/null && break
          sleep 0.5
        done
        run "first_requests_$mode" 120 python3 bench/first_requests.py --url http://127.0.0.1:8000 --requests 5 \
          --json "$OUT/first_requests_$mode.json"
        kill -TERM "$pid"; wait "$pid"
      done ;;
    suite) FASTQWEN_RESULTS_DIR="$OUT" run suite 540 python3 -m pytest -q -rf -p no:cacheprovider tests ;;
    pdl)  # batch-1 latency with the GEMV's programmatic dependent launch off, then on (the default), in one run
      for q in none fp8; do
        for pdl in 0 1; do
          FASTQWEN_PDL=$pdl run "latency_8b_${q}_pdl$pdl" 150 python3 bench/latency.py --model Qwen3-8B \
            --load-format dummy --quantization "$q" --prompt-lens 128 --new-tokens 64 --json "$OUT/latency_8b_${q}_pdl$pdl.json"
        done
      done ;;
    rates)
      nvcc -std=c++20 -O3 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -Icsrc -o /tmp/dequant_rates bench/dequant_rates.cu \
        && run dequant_rates 60 /tmp/dequant_rates ;;
    leave_out)  # batch-1 decode step with each kind of small kernel left out (bench/leave_out.py)
      for q in none fp8; do
        run "leave_out_$q" 240 python3 bench/leave_out.py --model Qwen3-8B --load-format dummy --quantization "$q" \
          --prompt-lens 128 1024 --min-chunks ${FP8W_MIN_CHUNKS:-} ${FP8W_LEAVE_OUT:+--variants $FP8W_LEAVE_OUT} \
          --json "$OUT/leave_out_$q.json"
      done ;;
    ncu)  # Nsight Compute on the one-token GEMVs (clocks left alone, as METHOD.md asks)
      run ncu_gemv 240 ncu --clock-control none -k regex:gemv --section SpeedOfLight --section WarpStateStats \
        --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis python3 bench/ncu_gemv.py --calls 2 ;;
    sass)
      nvcc -std=c++20 -O3 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -Icsrc -cubin \
        -o /tmp/gemv.cubin csrc/gemv.cu && cuobjdump -sass /tmp/gemv.cubin > "$OUT/gemv.sass" 2>&1
      echo "sass rc=$?" ;;
  esac
done
# The device returns at most 8 files from $OUT: everything goes back as one archive.
pack_out "$OUT"
