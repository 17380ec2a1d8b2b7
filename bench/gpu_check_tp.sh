#!/usr/bin/env bash
# Tensor parallelism on a machine with 2 (or more) GPUs (nvidia-h200-x2): build, the TP tests, then the TP bars.
#   bash bench/gpu_check_tp.sh OUTDIR [STAGE ...]
# Stages (default: tests allreduce latency fp8 throughput; each fits in one 10-minute device call):
#   tests       build, pytest the tensor-parallel tests (GPU and CPU)                  -> build.log, tests.log
#   allreduce   bench/tp_bench.py: custom all-reduce vs NCCL at decode sizes, and the all-reduce + fused_add_rms_norm
#               against the all-reduce fused with the norm, hidden 4096 and 5120 in one run, and at one token each
#               row-parallel GEMV with the fused kernel after it, unsent and sending its rows; then one rank's GEMVs at
#               the TP=2 shard shapes of Qwen3-8B and Qwen3-32B (bench/bench_gemv.py --tp 2; at one token also
#               with blocks of 4, 5 and 6 weight rows forced)
#   latency     batch-1 TPOT with its limit (rank 0's weight bytes over the copy bandwidth of the same run), random
#               Qwen3-32B at TP=2 and TP=1, then Qwen3-8B at TP=2 and TP=1; 32B TP=2 again with FASTQWEN_PDL=0
#   httplatency batch-1 TPOT and TTFT of random Qwen3-32B at TP=2 through HTTP (bench/latency.py --http-only, then
#               SGLang's bench_serving one request at a time when .sgl/ holds it)
#   arvariants  the custom all-reduce's designs in one run, random Qwen3-32B TP=2 batch 1 offline, bf16 then FP8
#               weights: no barrier for small messages (the default), the one-token o_proj / down GEMVs sending
#               their rows themselves (FASTQWEN_GEMV_SENDS=1), one barrier a call for all
#               (FASTQWEN_ALLREDUCE_LAMPORT=0), two barriers (and FASTQWEN_ALLREDUCE_END_BARRIER=1), the default
#               with the GEMV's blocks of 4 or 6 rows only (FASTQWEN_GEMV_FIVE_ROWS=0); then TP=1 with and without 5
#               (ARVARIANTS and ARV_TP1_FIVE pick some: "default", "1"; ARV_TP1_FIVE=" " none); the default and
#               sends run with --decode-profile (rank 0's kernel families per decode step)
#   fp8         batch-1 TPOT with its limit, random Qwen3-32B with FP8 weights (quantized shard by shard) at TP=2
#   throughput  128 in / 1024 out, 256 requests at once, Qwen3-32B and Qwen3-8B at TP=1 and TP=2 (THROUGHPUT_SPECS)
#   mutants     tests/mutation_check.py's mutants that need two GPUs (the custom all-reduce, the fused all-reduce +
#               norm), and any named in MUTANTS=a,b        -> mutations.log, mutations_run.log
#   tp4         on four GPUs (nvidia-h100-x4): the TP GPU tests at world 4, the all-reduce at 4 ranks, random
#               Qwen3-32B batch-1 TPOT at TP=4 and TP=1 and throughput at TP=4 (issue 46; TP4_PARTS picks some)
#   dp          issue 45: random Qwen3-8B through HTTP at 128 in / 1024 out, 1024 requests, 512 in flight: one server
#               on one GPU, one server with --dp 2, the same with --api-server-count 2 (DP_CONFIGS: replicas:front
#               ends, default "1:1 2:1 2:2"), then SMG (cache_aware) before two single-GPU servers; SGLang's
#               bench_serving as the client when .sgl/ holds it (its sglang.benchmark package), else bench/serving.py;
#               DP_SMG=0 leaves the SMG run out
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

build() {  # unless installed from this tree already (a warm machine keeps the last call's install)
  (cd /tmp && python3 -c "import fastqwen._C as c; assert c.built_with_cuda and hasattr(c, 'custom_all_reduce')") 2>/dev/null &&
    [ "$(cat /tmp/fastqwen-build/.tree_hash 2>/dev/null)" = "$(tree_hash)" ] && return
  echo "== build"
  local start=$(date +%s)
  # the build folder is kept: the mutants stage recompiles only their mutated sources in it
  python3 -m pip install --no-build-isolation --no-deps -Cbuild-dir=/tmp/fastqwen-build . > "$OUT/build.log" 2>&1 ||
    { tail -n 40 "$OUT/build.log"; exit 1; }
  tree_hash > /tmp/fastqwen-build/.tree_hash
  echo "build in $(( $(date +%s) - start ))s" | tee -a "$OUT/build.log"
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

SERVE=(python3 -m fastqwen.serve --model /tmp/qwen3-8b-dummy --load-format dummy --max-model-len 8192
       --max-queued-requests 4096 --log-level warning)
wait_ready() {  # wait_ready URL SECONDS: until URL answers 200
  for _ in $(seq "$2"); do
    python3 -c "import httpx,sys; sys.exit(httpx.get('$1', timeout=2).status_code != 200)" 2>/dev/null && return 0
    sleep 1
  done
  echo "not ready: $1"; return 1
}
load_8b() {  # load_8b NAME: 1024 requests of 128 in / 1024 out, 512 in flight, against 127.0.0.1:8000
  if [ -d .sgl/sglang ]; then
    (cd .sgl && PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" run "$1" 400 python3 -m sglang.benchmark.serving \
      --backend vllm --host 127.0.0.1 --port 8000 --dataset-name random-ids --random-range-ratio 1 \
      --random-input-len 128 --random-output-len 1024 --num-prompts 1024 --max-concurrency 512 \
      --tokenizer /tmp/qwen3-8b-dummy --model /tmp/qwen3-8b-dummy --output-file "$OUT/$1.jsonl")
  else
    run "$1" 400 python3 bench/serving.py --url http://127.0.0.1:8000 --num-prompts 1024 --concurrency 512 \
      --input-len 128 --output-len 1024 --json "$OUT/$1.json"
  fi
}
stage_dp() {
  [ -d /tmp/qwen3-8b-dummy ] || python3 bench/make_dummy_checkpoint.py --preset Qwen3-8B --out /tmp/qwen3-8b-dummy
  local pids=()
  # DP_CONFIGS: replicas:front-end processes (--api-server-count) of each one-server run
  for config in ${DP_CONFIGS:-1:1 2:1 2:2}; do
    local dp=${config%:*} api=${config#*:} name
    name="dp$dp$([ "$api" = 1 ] || echo "_api$api")"
    echo "== --dp $dp --api-server-count $api"
    "${SERVE[@]}" --port 8000 --dp "$dp" --api-server-count "$api" > "$OUT/server_$name.log" 2>&1 &
    pids=($!)
    wait_ready http://127.0.0.1:8000/health 300 && load_8b "${name}_128x1024_c512"
    python3 -c "import httpx; print(httpx.get('http://127.0.0.1:8000/metrics').text)" | grep -E "^vllm:num_requests|^fastqwen:.*(preempt|kv_cache_usage)" \
      > "$OUT/metrics_$name.txt"
    kill -TERM "${pids[@]}"; wait "${pids[@]}"
  done
  [ "${DP_SMG:-1}" = 1 ] || return 0
  echo "== SMG (cache_aware) before two single-GPU servers"
  pids=()
  for gpu in 0 1; do
    CUDA_VISIBLE_DEVICES=$gpu "${SERVE[@]}" --port "800$((gpu + 1))" > "$OUT/server_gpu$gpu.log" 2>&1 &
    pids+=($!)
  done
  wait_ready http://127.0.0.1:8001/health 300 && wait_ready http://127.0.0.1:8002/health 300 &&
    python3 -m smg launch --worker-urls http://127.0.0.1:8001 http://127.0.0.1:8002 --policy cache_aware \
      --host 127.0.0.1 --port 8000 --log-level warn --prometheus-host 127.0.0.1 --prometheus-port 29100 \
      > "$OUT/smg.log" 2>&1 &
  local smg=$!
  wait_ready http://127.0.0.1:8000/v1/models 120 && sleep 12 && load_8b "smg_128x1024_c512"  # 12 s: a load report
  kill -TERM "$smg"; wait "$smg"
  kill -TERM "${pids[@]}"; wait "${pids[@]}"
}

# native_stacks_if_running PID SECONDS LOG: if PID still runs after SECONDS, every thread's native and Python stack of
# it and its child processes (py-spy, carried as a wheel: a hang in a C++ destructor shows no Python frame below the
# line that dropped the object) into LOG.
native_stacks_if_running() {
  local pid="$1" waited=0
  while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt "$2" ]; do sleep 5; waited=$((waited + 5)); done
  kill -0 "$pid" 2>/dev/null || return 0
  local spy=/tmp/site/bin/py-spy
  [ -x "$spy" ] || { echo "no py-spy carried: no native stacks" > "$3"; return 0; }
  local family="$pid" next="$pid" children
  while [ -n "$next" ]; do  # the process and every descendant (pytest under timeout, the TP ranks under pytest)
    children=""
    for p in $next; do children="$children $(pgrep -P "$p" | tr '\n' ' ')"; done
    # shellcheck disable=SC2086  # (echo squeezes the spaces)
    next="$(echo $children)"
    family="$family $next"
  done
  for p in $family; do
    echo "== pid $p: $(tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null | cut -c1-200)"
    timeout 30 "$spy" dump --native --pid "$p" 2>&1
  done > "$3"
}

for stage in $STAGES; do
  build
  case "$stage" in
    tests)
      # The grammar test builds two TP=2 engines in one process, which hung in the first one's NCCL teardown until
      # rank 0 destroyed its CUDA graphs first (bc4ec72): it still runs last and alone, under its own limit and with
      # py-spy stacks if it runs long, so that a teardown hang cannot take the others' report with it.
      grammar_test=tests/test_tensor_parallel_gpu.py::test_tp2_grammars_in_graphs_overlap_like_the_serial_schedule
      FASTQWEN_RESULTS_DIR="$OUT" timeout 400 python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider \
        tests/test_tensor_parallel_gpu.py tests/test_tensor_parallel.py tests/test_tensor_parallel_fp8.py \
        tests/test_all_reduce_add_rms_norm.py \
        tests/test_cuda_graph_gpu.py --deselect "$grammar_test" \
        > "$OUT/tests.log" 2>&1 || rc=1
      pytest_report "$OUT/tests.log" 40
      timeout 150 python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider -o faulthandler_timeout=120 \
        "$grammar_test" > "$OUT/tests_grammar.log" 2>&1 &
      grammar=$!
      native_stacks_if_running "$grammar" 110 "$OUT/tests_grammar_stacks.log"
      wait "$grammar" || rc=1
      pytest_report "$OUT/tests_grammar.log" 10 ;;
    allreduce)
      run allreduce 300 python3 bench/tp_bench.py --hidden 4096 5120 --json "$OUT/allreduce.json"
      # One rank's GEMVs at the TP=2 shard shapes against the copy rate (one GPU is enough; issue 46)
      run gemv_tp2 200 python3 bench/bench_gemv.py --presets Qwen3-8B Qwen3-32B --tp 2 --batches 1 2 4 8 \
        --rows-per-block 4 5 6 --json "$OUT/gemv_tp2.json" ;;
    latency)
      # spec: model:TP:fused:PDL. 32B at TP=2 with the all-reduce fused with the residual add and norm
      # (FASTQWEN_FUSED_ALLREDUCE_NORM=1), then followed by fused_add_rms_norm, then fused without programmatic
      # dependent launch (FASTQWEN_PDL=0: every kernel of the step, the all-reduces included, waits for the one before
      # to end and then launches)
      # LATENCY_SPECS: a subset (the 32B runs load 65 GB each; all seven may not fit one 10-minute call)
      for spec in ${LATENCY_SPECS:-32B:2:1:1 32B:2:0:1 32B:2:1:0 32B:1:0:1 8B:2:1:1 8B:2:0:1 8B:1:0:1}; do
        set -- ${spec//:/ }
        name="latency_$1_tp$2_fused$3$([ "$4" = 1 ] || echo _pdl0)"
        FASTQWEN_FUSED_ALLREDUCE_NORM=$3 FASTQWEN_PDL=$4 run "$name" 240 python3 bench/latency.py \
          --model "Qwen3-$1" --load-format dummy --tp "$2" --prompt-lens 128 --new-tokens 64 --json "$OUT/$name.json"
      done ;;
    httplatency)  # issue 46's bar is offline AND through HTTP: the TP=2 server, then the client alone
      [ -d /tmp/qwen3-32b-dummy ] || python3 bench/make_dummy_checkpoint.py --preset Qwen3-32B --out /tmp/qwen3-32b-dummy
      python3 -m fastqwen.serve --model /tmp/qwen3-32b-dummy --load-format dummy --tp 2 --max-model-len 8192 \
        --port 8000 --log-level warning > "$OUT/server_32B_tp2.log" 2>&1 &
      server=$!
      wait_ready http://127.0.0.1:8000/health 400 &&
        run http_latency_32B_tp2 200 python3 bench/latency.py --model Qwen3-32B --http-only --url http://127.0.0.1:8000 \
          --prompt-lens 128 --new-tokens 64 --json "$OUT/http_latency_32B_tp2.json"
      if [ -d .sgl/sglang ]; then  # the same through a client that is not ours: SGLang's bench_serving, one at a time
        (cd .sgl && PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" run http_latency_32B_tp2_bench_serving 200 \
          python3 -m sglang.benchmark.serving --backend vllm --host 127.0.0.1 --port 8000 --dataset-name random-ids \
          --random-range-ratio 1 --random-input-len 128 --random-output-len 64 --num-prompts 16 --max-concurrency 1 \
          --tokenizer /tmp/qwen3-32b-dummy --model /tmp/qwen3-32b-dummy \
          --output-file "$OUT/http_latency_32B_tp2_bench_serving.jsonl")
      fi
      kill -TERM "$server"; wait "$server" ;;
    arvariants)
      for quantization in none fp8; do
        for variant in ${ARVARIANTS:-default sends onebarrier endbarrier fourorsix}; do
          FASTQWEN_ALLREDUCE_LAMPORT=$([ "$variant" = onebarrier ] || [ "$variant" = endbarrier ] && echo 0 || echo 1) \
            FASTQWEN_ALLREDUCE_END_BARRIER=$([ "$variant" = endbarrier ] && echo 1 || echo 0) \
            FASTQWEN_GEMV_FIVE_ROWS=$([ "$variant" = fourorsix ] && echo 0 || echo 1) \
            FASTQWEN_GEMV_SENDS=$([ "$variant" = sends ] && echo 1 || echo 0) \
            run "latency_32B_tp2_${quantization}_$variant" 150 python3 bench/latency.py --model Qwen3-32B \
            --load-format dummy --tp 2 --quantization "$quantization" --prompt-lens 128 --new-tokens 64 \
            $([ "$variant" = default ] || [ "$variant" = sends ] && echo --decode-profile) --json "$OUT/latency_32B_tp2_${quantization}_$variant.json"
        done
      done
      for five in ${ARV_TP1_FIVE:-1 0}; do
        FASTQWEN_GEMV_FIVE_ROWS=$five run "latency_32B_tp1_five$five" 150 python3 bench/latency.py --model Qwen3-32B \
          --load-format dummy --tp 1 --prompt-lens 128 --new-tokens 64 --json "$OUT/latency_32B_tp1_five$five.json"
      done ;;
    fp8)
      FASTQWEN_FUSED_ALLREDUCE_NORM=${FUSED:-1} run latency_32B_tp2_fp8 240 python3 bench/latency.py --model Qwen3-32B --load-format dummy --tp 2 \
        --quantization fp8 --prompt-lens 128 --new-tokens 64 --json "$OUT/latency_32B_tp2_fp8.json" ;;
    throughput)
      # THROUGHPUT_SPECS: model:TP runs (the default all four: TP=1 beside TP=2 for both models, issue 46's bars)
      for spec in ${THROUGHPUT_SPECS:-32B:1 32B:2 8B:1 8B:2}; do
        set -- ${spec//:/ }
        run "throughput_$1_tp$2_128x1024" 400 python3 bench/throughput.py --model "Qwen3-$1" --load-format dummy \
          --tp "$2" --workload fixed --num-prompts 256 --input-len 128 --output-len 1024 \
          --json "$OUT/throughput_$1_tp$2_128x1024.json"
      done ;;
    tp4)  # issue 46 on a four-GPU machine: the TP tests at world 4, the all-reduce at 4 ranks, Qwen3-32B at TP=4
      # TP4_PARTS: a subset of "tests allreduce latency4 latency1 throughput" (the default: all), and
      # "latency4fused": TP=4 again with the all-reduce fused with the norm (FASTQWEN_FUSED_ALLREDUCE_NORM=1; the
      # default at four ranks runs the all-reduce and the norm kernel apart: 1.9% faster, twentieth session)
      parts=" ${TP4_PARTS:-tests allreduce latency4 latency1 throughput} "
      if [[ $parts == *" tests "* ]]; then  # the world-4 cases (the tests stage runs the TP=2 ones)
        FASTQWEN_RESULTS_DIR="$OUT" timeout 400 python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider \
          "tests/test_tensor_parallel_gpu.py::test_custom_all_reduce_matches_the_sum_and_nccl[4]" \
          "tests/test_tensor_parallel_gpu.py::test_fused_all_reduce_norm_matches_float64[4]" \
          "tests/test_tensor_parallel_gpu.py::test_one_barrier_all_reduce_matches_the_sum_and_nccl[4]" \
          "tests/test_tensor_parallel_gpu.py::test_one_barrier_fused_all_reduce_norm_matches_float64[4]" \
          "tests/test_tensor_parallel_gpu.py::test_sending_gemv_feeds_the_fused_all_reduce[4]" \
          > "$OUT/tests_tp4.log" 2>&1 || rc=1
        pytest_report "$OUT/tests_tp4.log" 20
      fi
      [[ $parts == *" allreduce "* ]] &&
        run allreduce_tp4 200 python3 bench/tp_bench.py --world 4 --hidden 5120 --json "$OUT/allreduce_tp4.json"
      for tp in 4 1; do
        [[ $parts == *" latency$tp "* ]] &&
          run "latency_32B_tp$tp" 240 python3 bench/latency.py --model Qwen3-32B --load-format dummy --tp "$tp" \
            --prompt-lens 128 --new-tokens 64 --json "$OUT/latency_32B_tp$tp.json"
      done
      [[ $parts == *" latency4fused "* ]] &&
        FASTQWEN_FUSED_ALLREDUCE_NORM=1 run latency_32B_tp4_fused 240 python3 bench/latency.py --model Qwen3-32B \
          --load-format dummy --tp 4 --prompt-lens 128 --new-tokens 64 --json "$OUT/latency_32B_tp4_fused.json"
      [[ $parts == *" throughput "* ]] &&
        run throughput_32B_tp4_128x1024 300 python3 bench/throughput.py --model Qwen3-32B --load-format dummy --tp 4 \
          --workload fixed --num-prompts 256 --input-len 128 --output-len 1024 \
          --json "$OUT/throughput_32B_tp4_128x1024.json"
      true ;;
    dp) stage_dp ;;
    mutants)
      names=all_reduce_drops_the_last_rank,all_reduce_norm_adds_the_residual_twice,all_reduce_norm_drops_the_last_rank
      names+=,all_reduce_norm_composition_adds_the_residual_twice
      names+=,barrier_free_all_reduce_leaves_the_previous_buffer_full
      names+=,sent_all_reduce_takes_its_own_row_from_data,one_barrier_all_reduce_copies_into_one_half
      # (sending_gemv_stores_into_the_last_rounds_buffer hangs its test's ranks into their 240 s deadline: MUTANTS=)
      names+=${MUTANTS:+,$MUTANTS}
      timeout "${MUTANTS_TIMEOUT:-300}" python3 tests/mutation_check.py --build-dir /tmp/fastqwen-build --jobs 1 \
        --names "$names" --out "$OUT" > "$OUT/mutations_run.log" 2>&1 || rc=1
      grep -E "^== |caught|NOT RUN|surviv" "$OUT/mutations_run.log" | tail -n 20 ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
echo "== summary rc=$rc" | tee "$OUT/summary.txt"
pack_out "$OUT"
exit "$rc"
