#!/usr/bin/env bash
# Build, test and benchmark fastqwen on a GPU machine with no network.
#   bash bench/gpu_check.sh OUTDIR [STAGE ...]
# Stages (default: all, in this order; each fits in one 10-minute device call):
#   tests    build, pytest tests (GPU tests included)                       -> build.log, tests.log
#   tests1 .. tests4  the same in four parts by file name (test_a..d, test_e..l, test_m..r, test_s..z), one device
#            call each (the whole suite no longer fits in one; TESTS_TIMEOUT, default 480 s, as for tests)
#                                                                           -> tests1.log .. tests4.log
#   gputests  every test marked gpu (`pytest -m gpu tests`: those that skip without a GPU; the rest also run in CI),
#            one call (TESTS_TIMEOUT, default 480 s)                      -> gputests.log
#   testsubset  pytest on TEST_FILES (default: tests) with -k TESTS_K, limit TESTS_TIMEOUT (default 200 s)
#   kernels  bench/bench_*.py (but bench_gemm_fp8.py, which saturated runs), bench/kernels.py (norms, RoPE/KV,
#            decode and prefill attention, sampling)
#   offline  bench/latency.py and bench/throughput.py, random Qwen3-8B and Qwen3-0.6B, with the HF baseline
#            (= the stages latency, then throughput)
#   latency  offline's first half: bench/latency.py (batch-1 TPOT, TTFT) and profile_step.py at batch 1 and 256
#   throughput  offline's second half: bench/throughput.py (random and 128/1,024 workloads)
#   serving  the HTTP server: batch-1 latency through HTTP, bench/serving.py at concurrency 1/8/64/256
#   compare  bench/profile_step.py at batch 1 and 256 for this tree and for BASE_TREE (an older tree), same run
#   structured  the structured-output GPU tests, then bench/structured.py (random Qwen3-8B, Qwen3's tokenizer, 64 in
#            flight): the free-string JSON-schema mix and the exact-length one, each against unconstrained
#   serving15  offline throughput, then the server (engine core process) with bench/serving.py and SGLang's
#            bench_serving (SGL_TOOLS=folder) at 128/1024 c=256, 1024/1024 c=64, and 1024 in flight
#   batch1   random Qwen3-8B, bf16 and FP8 weights: batch-1 latency through HTTP and offline (a server and an
#            engine side by side, small KV pools), then bench/leave_out.py   (README: batch1-latency.md,
#            batch1-step-breakdown.md in bench/results/current/)
#   copyref  the one-token GEMVs and decode attention (64 x 4,096, one sequence of 16k to 128k) against the same copy
#            reference                                     (README: gemv-one-token.md, decode-attention.md)
#   prefill  bench/kernels.py's prefill cases only: every Hopper pipeline, bf16 and FP8 pools, against cuDNN and FA2
#   prefillbar  issue 48's bar cases only (4k, 8k, 16k, 32k, 2k on 30k; bf16), the default against cuDNN and FA2 in
#            PREFILL_ROUNDS (default 7) settled rounds                   -> prefill_bar.json
#   verifyattention  bench/kernels.py's prefill rows at verify steps' shapes (4 or 6 new tokens on 128 to 8,192 cached):
#            the Hopper kernel (what they run) against the tensor-core one and SDPA
#   prefillprofile  Nsight Compute on one Hopper prefill launch and one of cuDNN's SDPA kernel, the same 16k causal
#            prefill (bf16): speed of light, pipes, instructions, warp stalls (if ncu exists)
#   longcontext  TTFT of 4k and 32k prompts through HTTP (bench/latency.py --http-only, then SGLang's bench_serving
#            when SGL_TOOLS is set), what the HTTP path alone adds (frontend_rate.py --ttft-lens, a synthetic core),
#            offline (with the prefill's FLOP limit), and of a 131,071-token prompt with YaRN offline, random
#            Qwen3-8B                                                        (README: long-context.md)
#   fp8serving  128/1024 at 256 in flight, bf16 and FP8 weights: offline, then through the server with SGLang's
#            bench_serving (SGL_TOOLS)                                      (README: serving-256.md)
#   speculative  batch-1 time per output token with speculative decoding (synthetic acceptance length 2.0, k = 3;
#            SPEC_REPEATS requests of 128 tokens, default 5, medians)
#            next to without, offline and through HTTP (SPEC_QUANT: none fp8)   (README: speculative.md)
#   specgate  how verify steps follow each other, on one machine: FP8 speculation chained on the device (the
#            default), behind the host gate (FASTQWEN_VERIFY_CHAIN=0), launched plainly (and FASTQWEN_VERIFY_GATE=0),
#            speculation off; bf16 chained; profile_step --verify for each of the three      (README: speculative.md)
#   specthroughput  offline output throughput with and without speculation at 1, 4, 16 and 256 in flight
#   gemvtc   the tensor-core GEMV's FP8 pipelines (FASTQWEN_GEMV_TC_FP8_VARIANT 0..12) at 1 to 4 tokens, their GPU
#            test, then FP8 speculation off, and at acceptance 2.0 with each of GEMV_TC_VARIANTS (default: the
#            default pipeline and the fastest of GEMV_TC_BENCH_VARIANTS over a layer at 2 to 4 tokens)
#   eagle3   EAGLE-3 with a random head at Qwen3-8B's shapes (bench/make_eagle3_head.py), acceptance forced to 2.0:
#            batch-1 TPOT offline and through HTTP beside speculation off (SPEC_QUANT: none fp8), then profile_step
#            --verify with the head (its advance and draft steps' host time); EAGLE3_HEAD_QUANT=fp8 quantizes the head
#   gemvprofile  Nsight Compute on the FP8 GEMV (gate_up, o_proj) at one token and at four (default pipeline and
#            GEMV_PROFILE_VARIANTS): DRAM and L2 traffic, speed of light, warp stalls
#   verifyprofile  bench/profile_step.py --verify: the FP8 verify step's kernels (FASTQWEN_PDL=0, durations that add
#            up) and its graph's time with and without PDL
#   specreplay  bench/spec_replay.py: greedy requests twice with suffix decoding, the second drafting from the first
#            (bench/latency.py's speculation-off TPOT for the same lengths beside it)
#   specswitch  offline throughput with speculation forced on (max_batch_size 512) and off at 32, 64 and 128 in
#            flight: where speculation stops paying, for its default switch-off batch size
#   fp8kvserving  FP8 weights + FP8 KV, 128/1024 with 512 in flight (1,024 requests): offline, then through the
#            server (API_SERVERS front-end processes, default 1) with SGLang's bench_serving (SGL_TOOLS) (issue 47)
#   fp8fused  FASTQWEN_FP8_FUSED_QUANT (the FP8 GEMMs' inputs quantized by the norm and the SiLU that compute them):
#            its GPU tests and mutants, then FP8 weights + FP8 KV with it and without, in turns: the batch-512 decode
#            step's graph replay (bench/profile_step.py, twice each), then offline throughput at 512 in flight (1,024
#            requests of 128 / 1,024), once each (issue 47)
#   decodeafresh  decode attention's loads running on across a block's items: its GPU tests and mutants, then
#            bench/kernels.py's decode rows against the pipeline started afresh at each item, in turns (issue 47)
#   decodeafreshsteps  the same two in the engine, in turns: decode-step replays (bf16 at 256, FP8 + FP8 KV at 512),
#            then offline throughput at 256 (bf16; not with DECODE_AFRESH_BF16_THROUGHPUT=0) and 512 (FP8 + FP8 KV)
#   itemrecords  decode attention reading each work item from the plan's chunk records, copied items ahead (the default
#            since the twenty-third session): its GPU tests and mutants, the kernel against each item searched in the
#            chunk offsets (bench/kernels.py, batch 1 and saturated rows), then the engine's decode step graph replay
#            in turns (bf16 at 256, FP8 + FP8 KV at 512) (issue 47)
#   abkernels  bench/kernels.py's decode rows with this tree's build and with a build of AB_BASE (default ab_base/: an
#            untracked source tree, `git archive <ref> python csrc CMakeLists.txt pyproject.toml | tar -x -C ab_base`),
#            AB_ROUNDS (2) runs each in turns, side by side in ab_summary.json (bench/ab_builds.sh, bench/ab_summary.py)
#   absteps  the engine's decode step (bench/profile_step.py: bf16 at 256, FP8 + FP8 KV at 512, 640-token prompts) with
#            this tree's build and AB_BASE's, AB_STEP_ROUNDS (1) runs each in turns (bench/ab_builds.sh)
#   minchunk  bf16 decode attention's shortest chunk MIN_CHUNK (default 512) against the kernel's 256, in turns: batch-1
#            steps at 1k and 4k of context (bench/leave_out.py), the batch-256 step, offline throughput at 256 (issue 47)
#   decodestalls  Nsight Compute's warp-stall samples of the decode attention kernel at 512 x 640, bf16 and FP8 pools
#            (DECODE_STALLS="fp8:512:100-1200 ..." picks other kv:case pairs)
#   mutants  tests/mutation_check.py's mutants named in MUTANTS=a,b (one GPU), against the kept build folder
#   prefillstalls  Nsight Compute's warp-stall samples per SASS instruction of the Hopper prefill kernel (16k, bf16)
#   prefillvariants  bench/prefill_variants.py: the prefill kernel's pipelines (PREFILL_VARIANTS_LIST) beside cuDNN
#   stepaccount  bench/step_account.py: the decode step of random Qwen3-8B at batch 64, 256 and 512 per kernel family
#            against each family's bound; bf16, then FP8 weights + FP8 KV (issue 47)
#   saturated  issue 47's parts at decode batch sizes, in one call: decode attention at 256 and 512 sequences of
#            100, 640, 1,200 and 100..1,200 tokens, bf16 and FP8 pools (bench/kernels.py --ops decode); the FP8
#            projections at M = 16..512 against cuBLAS's FP8 and bf16 GEMMs (bench/bench_gemm_fp8.py); then the
#            stepaccount stage, its two runs' limits cut so that they end 570 s after this script began
# Every stage after `tests` builds first if the package is not installed yet or was built from other sources.
# Exit code: nonzero if the build or the tests failed (benchmarks are recorded only).
set -u -o pipefail

OUT="${1:?usage: bash bench/gpu_check.sh OUTDIR [tests|kernels|offline|latency|throughput|serving ...]}"
shift
STAGES="${*:-tests kernels offline serving}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "$0")/.."
. bench/device_out.sh
export PYTHONUNBUFFERED=1
# PORT: the servers' port (another GPU of the same host may run a second copy of this script on another port)
PORT=${PORT:-8000}

echo "== repo: $(pwd)   python: $(python3 --version 2>&1)   stages: $STAGES"

use_carried_wheels

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
head -n 12 "$OUT/nvidia-smi.txt"

build_rc=0
tests_rc=0
bench_rc=0
serve_rc=0

BUILT_HASH_FILE=/tmp/fastqwen-build/.tree_hash  # (tree_hash: device_out.sh)

build() {
  echo "== build"
  local start
  start=$(date +%s)
  # (the build folder is kept: the mutants stage recompiles only its mutated sources in it)
  python3 -m pip install --no-build-isolation --no-deps -v -Cbuild-dir=/tmp/fastqwen-build . > "$OUT/build.log" 2>&1
  build_rc=$?
  [ "$build_rc" -eq 0 ] && tree_hash > "$BUILT_HASH_FILE"
  echo "build rc=$build_rc in $(( $(date +%s) - start ))s" | tee -a "$OUT/build.log"
  [ "$build_rc" -eq 0 ] || tail -n 40 "$OUT/build.log"
  # Run from outside the source tree's python/ so the installed package (with _C) is used.
  (cd /tmp && python3 -c "import fastqwen._C as c, torch; print('fastqwen._C built_with_cuda =', c.built_with_cuda, '| torch', torch.__version__, '| cuda available', torch.cuda.is_available(), '|', torch.cuda.get_device_name())") 2>&1 | tee -a "$OUT/build.log"
}

run() {  # run NAME TIMEOUT CMD...: logs to OUT/NAME.log, records a failure in bench_rc
  local name="$1" limit="$2"; shift 2
  echo "-- $name"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=$?
  echo "$name rc=$rc" | tee -a "$OUT/$name.log"
  [ "$rc" -eq 0 ] || bench_rc=$rc
}

# The suite outgrew one call (2026-11-28: 67% in 480 s on an H100), and then its halves did (the second half took
# 440 s, the first reached test_engine_core in 215 s), so it runs in four parts of files, each in its own call; -v
# names every test as it finishes, so a run its timeout cuts short still says which ones failed.
TEST_PART_STARTS=(test_a test_e test_m test_s)  # part k: the files from its start to the next part's
test_part() {  # test_part 1..4: that part's test files
  local f name first="${TEST_PART_STARTS[$(($1 - 1))]}" next="${TEST_PART_STARTS[$1]:-test_~}"
  for f in tests/test_*.py; do
    name="$(basename "$f")"
    if [[ ! "$name" < "$first" && "$name" < "$next" ]]; then echo "$f"; fi
  done
}
stage_tests() {  # stage_tests [1..4]: the whole suite, or one part
  build
  local files=(tests) log="$OUT/tests.log"
  [ -n "${1:-}" ] && { mapfile -t files < <(test_part "$1"); log="$OUT/tests$1.log"; }
  echo "== tests ${1:+(part $1: ${#files[@]} files)}"
  FASTQWEN_RESULTS_DIR="$OUT" timeout "${TESTS_TIMEOUT:-480}" python3 -m pytest -v -rfEs --tb=short --durations=25 \
    -p no:cacheprovider \
    "${files[@]}" > "$log" 2>&1
  local rc=$?
  echo "tests rc=$rc" | tee -a "$log"
  [ "$rc" -eq 0 ] || tests_rc=$rc
  grep -E " (FAILED|ERROR) +\[" "$log" | cut -c1-200 | head -n 40
  pytest_report "$log"
}

stage_gputests() {  # the tests that only a GPU runs, in one call (the whole suite takes four)
  build
  echo "== tests marked gpu"
  FASTQWEN_RESULTS_DIR="$OUT" timeout "${TESTS_TIMEOUT:-480}" python3 -m pytest -v -rfEs --tb=short --durations=25 \
    -p no:cacheprovider -m gpu tests > "$OUT/gputests.log" 2>&1
  local rc=$?
  echo "tests rc=$rc" | tee -a "$OUT/gputests.log"
  [ "$rc" -eq 0 ] || tests_rc=$rc
  grep -E " (FAILED|ERROR) +\[" "$OUT/gputests.log" | cut -c1-200 | head -n 40
  pytest_report "$OUT/gputests.log"
}

stage_kernels() {
  echo "== kernel benchmarks"
  for b in bench/bench_*.py; do
    [ -e "$b" ] || continue
    name="$(basename "$b" .py)"
    [ "$name" = bench_gemm_fp8 ] && continue  # the saturated stage runs it (this stage stays within its 10 minutes)
    run "$name" 120 python3 "$b" --json "$OUT/$name.json"
  done
  run kernels 420 python3 bench/kernels.py --ops norms qk decode prefill sample --json "$OUT/kernels.json"
}

stage_copyref() {  # issue 43: README's GEMV and decode-attention fractions against one copy reference (the 1 GiB
  # device-to-device copy queued ahead of the GPU, bench/common.py copy_bandwidth), in one call
  run gemv_one_token 150 python3 bench/bench_gemv.py --batches 1 --json "$OUT/gemv_one_token.json"
  run decode_attention 150 python3 bench/kernels.py --ops decode --kv-dtypes bf16 fp8 \
    --decode-cases 64:4096 1:16384 1:32768 1:131072 --json "$OUT/decode_attention.json"
}

stage_offline() {
  stage_latency
  stage_throughput
}

stage_latency() {
  echo "== offline latency (random weights, bf16)"
  run latency_8b 200 python3 bench/latency.py --model Qwen3-8B --load-format dummy --prompt-lens 128 1024 4096 \
    --new-tokens 64 --hf --json "$OUT/latency_8b.json"
  run latency_0.6b 90 python3 bench/latency.py --model Qwen3-0.6B --load-format dummy --prompt-lens 128 1024 4096 \
    --new-tokens 64 --json "$OUT/latency_0.6b.json"
  for b in 1 256; do  # where a decode step's time goes, with and without the overlap schedule
    run "profile_8b_b$b" 120 python3 bench/profile_step.py --model Qwen3-8B --batch "$b" --steps 32 \
      --json "$OUT/profile_8b_b$b.json"
    run "profile_8b_b${b}_no_overlap" 120 python3 bench/profile_step.py --model Qwen3-8B --batch "$b" --steps 32 \
      --disable-overlap-schedule --json "$OUT/profile_8b_b${b}_no_overlap.json"
  done
}

stage_throughput() {
  echo "== offline throughput (random weights, bf16)"
  run throughput_8b_random 200 python3 bench/throughput.py --model Qwen3-8B --load-format dummy --workload random \
    --num-prompts 256 --hf --hf-requests 32 --json "$OUT/throughput_8b_random.json"
  run throughput_8b_128x1024 240 python3 bench/throughput.py --model Qwen3-8B --load-format dummy --workload fixed \
    --num-prompts 1024 --input-len 128 --output-len 1024 --json "$OUT/throughput_8b_128x1024.json"
  run throughput_0.6b_128x1024 150 python3 bench/throughput.py --model Qwen3-0.6B --load-format dummy --workload fixed \
    --num-prompts 1024 --input-len 128 --output-len 1024 --json "$OUT/throughput_0.6b_128x1024.json"
}

server_pid=""
start_server() {  # start_server LOGNAME CHECKPOINT [extra serve flags]: starts it and waits until /health says 200
  local log="$1" model="$2"; shift 2
  # 8192: the 4096-token latency prompt plus its output fits; a deep queue: the c=256 runs must not see 503s.
  python3 -m fastqwen.serve --model "$model" --load-format dummy --port "$PORT" --max-model-len 8192 \
    --max-queued-requests 4096 "$@" \
    > "$OUT/$log" 2>&1 &
  server_pid=$!
  for _ in $(seq 300); do
    python3 -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:$PORT/health').status_code != 200)" 2>/dev/null && return 0
    sleep 1
  done
  serve_rc=1
  return 1
}
stop_server() { kill -TERM "$server_pid"; wait "$server_pid"; }

stage_serving() {
  echo "== serving: random weights behind the HTTP server"
  python3 bench/make_dummy_checkpoint.py --preset Qwen3-8B --out /tmp/qwen3-8b-dummy
  python3 bench/make_dummy_checkpoint.py --preset Qwen3-0.6B --out /tmp/qwen3-0.6b-dummy
  # The decode step at batch 256 with 640 cached tokens, the middle of this workload's 128..1152 (ITL's yardstick).
  run profile_8b_b256_ctx640 150 python3 bench/profile_step.py --model Qwen3-8B --batch 256 --prompt-len 640 --steps 32 \
    --json "$OUT/profile_8b_b256_ctx640.json"
  start_server server_8b.log /tmp/qwen3-8b-dummy
  run http_latency_8b 120 python3 bench/latency.py --model Qwen3-8B --load-format dummy --prompt-lens 128 1024 4096 \
    --new-tokens 64 --url http://127.0.0.1:$PORT --http-only --json "$OUT/http_latency_8b.json"
  for io in "128 1024" "1024 1024"; do
    set -- $io
    for c in 1 8 64 256; do
      n=$(( c * 2 )); [ "$n" -ge 4 ] || n=4
      run "serving_8b_in$1_c$c" 150 python3 bench/serving.py --num-prompts "$n" --concurrency "$c" --input-len "$1" \
        --output-len "$2" --json "$OUT/serving_8b_in$1_c$c.json"
    done
  done
  stop_server
  grep -E "CUDA graph|KV cache|capture" "$OUT/server_8b.log" | head -n 5
  start_server server_0.6b.log /tmp/qwen3-0.6b-dummy
  run http_latency_0.6b 90 python3 bench/latency.py --model Qwen3-0.6B --load-format dummy --prompt-lens 128 1024 \
    --new-tokens 64 --url http://127.0.0.1:$PORT --http-only --json "$OUT/http_latency_0.6b.json"
  run serving_0.6b_in128_c256 120 python3 bench/serving.py --num-prompts 512 --concurrency 256 --input-len 128 \
    --output-len 1024 --json "$OUT/serving_0.6b_in128_c256.json"
  stop_server
}

stage_compare() {  # decode-step profile of this tree against BASE_TREE (an exported older commit), same machine, same run
  local base="${BASE_TREE:?set BASE_TREE to a folder holding the older tree}"
  echo "== profile: this tree vs $base"
  python3 -m pip install --no-build-isolation --no-deps --target /tmp/base "$base" > "$OUT/build_base.log" 2>&1 || {
    echo "base build failed"; tail -n 20 "$OUT/build_base.log"; bench_rc=1; return; }
  for b in 1 256; do
    run "profile_head_b$b" 150 python3 bench/profile_step.py --model Qwen3-8B --batch "$b" --steps 32 \
      --json "$OUT/profile_head_b$b.json"
    (cd "$base" && export PYTHONPATH="/tmp/base${PYTHONPATH:+:$PYTHONPATH}" && run "profile_base_b$b" 150 python3 bench/profile_step.py \
      --model Qwen3-8B --batch "$b" --steps 32 --json "$OUT/profile_base_b$b.json")
  done
}

SGL_TOOLS="${SGL_TOOLS:-}"  # a folder holding SGLang's bench_serving package (python -m sglang.benchmark.serving)
bench_serving() {  # bench_serving NAME BACKEND... : SGLang's client against the running server, random-ids 128/1024
  local name="$1"; shift
  [ -n "$SGL_TOOLS" ] || { echo "SGL_TOOLS not set: skipping $name"; return; }
  (cd "$SGL_TOOLS" && run "$name" 240 python3 -m sglang.benchmark.serving --host 127.0.0.1 --port "$PORT" "$@" \
    --dataset-name random-ids --random-range-ratio 1 --tokenizer /tmp/qwen3-8b-dummy --model /tmp/qwen3-8b-dummy \
    --output-file "$OUT/$name.jsonl")
}

stage_serving15() {  # the engine-core process bars: HTTP against offline, same run (issue 15)
  echo "== serving with the engine core process: random Qwen3-8B, 128 in / 1024 out"
  python3 bench/make_dummy_checkpoint.py --preset Qwen3-8B --out /tmp/qwen3-8b-dummy
  # 512 requests, as the HTTP runs below (256 run at once: two waves; the default batch limit follows the pool).
  run throughput_8b_128x1024_512 240 python3 bench/throughput.py --model Qwen3-8B --load-format dummy --workload fixed \
    --num-prompts 512 --input-len 128 --output-len 1024 --max-num-seqs 256 --json "$OUT/throughput_8b_128x1024_512.json"
  # The decode step at batch 256 with 640 cached tokens, the middle of this workload's 128..1152 (ITL's yardstick).
  run profile_8b_b256_ctx640 150 python3 bench/profile_step.py --model Qwen3-8B --batch 256 --prompt-len 640 --steps 32 \
    --json "$OUT/profile_8b_b256_ctx640.json"
  start_server server_8b.log /tmp/qwen3-8b-dummy
  run http_latency_8b 120 python3 bench/latency.py --model Qwen3-8B --load-format dummy --prompt-lens 128 256 \
    --new-tokens 64 --url http://127.0.0.1:$PORT --http-only --json "$OUT/http_latency_8b.json"
  run serving_8b_in128_c256 200 python3 bench/serving.py --num-prompts 512 --concurrency 256 --input-len 128 \
    --output-len 1024 --json "$OUT/serving_8b_in128_c256.json"
  bench_serving bench_serving_completions_c256 --backend vllm --num-prompts 512 --max-concurrency 256 \
    --random-input-len 128 --random-output-len 1024
  bench_serving bench_serving_generate_c256 --backend sglang --tokenize-prompt --num-prompts 512 --max-concurrency 256 \
    --random-input-len 128 --random-output-len 1024
  bench_serving bench_serving_completions_1024x1024_c64 --backend vllm --num-prompts 128 --max-concurrency 64 \
    --random-input-len 1024 --random-output-len 1024
  run serving_8b_c1024 200 python3 bench/serving.py --num-prompts 1024 --concurrency 1024 --input-len 128 \
    --output-len 128 --json "$OUT/serving_8b_c1024.json"
  stop_server
}

stage_structured() {  # issue 16's bar: a JSON-schema mix at 64 in flight against the same requests unconstrained
  FASTQWEN_RESULTS_DIR="$OUT" run structured_tests 300 python3 -m pytest -q -rs -p no:cacheprovider tests/test_structured_gpu.py
  # host side: the masks of 64 rows with every request of a spec on one compile, then spread (the engine's default)
  run grammar_masks 120 python3 bench/grammar_masks.py --rows 64 --steps 40 --lexer-groups 1 0
  [ -d /tmp/qwen3-8b-dummy ] || python3 bench/make_dummy_checkpoint.py --preset Qwen3-8B --out /tmp/qwen3-8b-dummy
  for mix in plain exact; do
    run "structured_8b_$mix" 200 python3 bench/structured.py --model /tmp/qwen3-8b-dummy --load-format dummy \
      --in-flight 64 --mix "$mix" --json "$OUT/structured_8b_$mix.json"
  done
}

stage_batch1() {  # the README's batch-1 figures: bench/results/current/batch1-latency.md and batch1-step-breakdown.md
  [ -d /tmp/qwen3-8b-dummy ] || python3 bench/make_dummy_checkpoint.py --preset Qwen3-8B --out /tmp/qwen3-8b-dummy
  for q in none fp8; do
    # --num-pages 2048: the server and latency.py's offline engine share the GPU
    start_server "server_batch1_$q.log" /tmp/qwen3-8b-dummy --quantization "$q" --num-pages 2048 &&
      run "http_latency_8b_$q" 150 python3 bench/latency.py --model Qwen3-8B --load-format dummy \
      --quantization "$q" --num-pages 2048 --prompt-lens 128 1024 --new-tokens 64 --url http://127.0.0.1:$PORT \
      --json "$OUT/http_latency_8b_$q.json"
    stop_server
  done
  for q in none fp8; do
    run "leave_out_$q" 240 python3 bench/leave_out.py --model Qwen3-8B --load-format dummy --quantization "$q" \
      --prompt-lens 128 1024 --json "$OUT/leave_out_$q.json"
  done
}

stage_testsubset() {  # the GPU tests a change touched, without the whole suite's 8 minutes
  echo "== tests: ${TEST_FILES:-tests} -k '${TESTS_K:-}'"
  # shellcheck disable=SC2086  # (the files are words)
  FASTQWEN_RESULTS_DIR="$OUT" timeout "${TESTS_TIMEOUT:-200}" python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider \
    ${TEST_FILES:-tests} -k "${TESTS_K:-}" > "$OUT/tests_subset.log" 2>&1
  local rc=$?
  echo "tests_subset rc=$rc" | tee -a "$OUT/tests_subset.log"
  [ "$rc" -eq 0 ] || tests_rc=$rc
  pytest_report "$OUT/tests_subset.log"
}

stage_prefillbar() {  # issue 48's bar cases alone (4k, 8k, 16k, 32k, 2k on 30k; bf16), the default pipeline against
  # cuDNN's and FlashAttention-2's SDPA in PREFILL_ROUNDS (default 7) settled rounds: a ratio within 0.05 of 1 moved
  # between calls at 3 rounds (long-context.md)
  run prefill_bar 240 python3 bench/kernels.py --ops prefill --kv-dtypes bf16 --iters 10 \
    --prefill-cases 1:4096:0 1:8192:0 1:16384:0 1:32768:0 1:2048:30720 --prefill-variants 11 \
    --prefill-rounds "${PREFILL_ROUNDS:-7}" --json "$OUT/prefill_bar.json"
}

stage_prefill() {  # issue 48: the prefill cases of bench/kernels.py, the Hopper pipelines PREFILL_VARIANTS (default:
  # static and dynamic ping-pong, the overlap with ping-pong, three stages; each with and without Q by the producer,
  # bit 4), bf16 and FP8 pools, with cuDNN's and FlashAttention-2's SDPA on the same shapes in the same run
  # (README: long-context.md)
  # shellcheck disable=SC2086  # (the variants are words)
  run prefill 300 python3 bench/kernels.py --ops prefill --kv-dtypes bf16 fp8 --iters 10 \
    --prefill-variants ${PREFILL_VARIANTS:-2 10 11 14 18 26 27 30} --json "$OUT/prefill.json"
}

stage_verifyattention() {  # issue 42: the attention of verify steps (k + 1 = 4 or 6 query rows on a short or long
  # context) on both prefill kernels (the Hopper one, which verify steps take, and the tensor-core one), beside SDPA
  run verify_attention 150 python3 bench/kernels.py --ops prefill --kv-dtypes bf16 fp8 --iters 20 \
    --prefill-cases 1:4:128 1:4:1024 1:4:8192 1:6:128 4:4:512 --json "$OUT/verify_attention.json"
}

stage_prefillprofile() {  # issue 48: where the Hopper prefill kernel's time goes, beside cuDNN's on the same shape
  # (Nsight Compute, if the machine has it): one 16k causal prefill (bf16), speed of light, pipes, instructions, warp
  # stalls, for our kernel (its default pipeline) and for the cuDNN SDPA kernel that bench/kernels.py times next to it
  if ! command -v ncu > /dev/null; then echo "prefillprofile: no ncu on this machine"; return; fi
  local sections=(--section SpeedOfLight --section WarpStateStats --section SchedulerStats
                  --section ComputeWorkloadAnalysis --section InstructionStats --section MemoryWorkloadAnalysis)
  local case=(python3 bench/kernels.py --ops prefill --kv-dtypes bf16 --iters 3 --prefill-cases 1:16384
              --prefill-variants 10)
  run prefill_ncu_ours 200 ncu --kernel-name regex:prefill_hopper --launch-skip 5 --launch-count 1 "${sections[@]}" \
    "${case[@]}"
  # cuDNN's SDPA kernels are named cudnn_generated_fort_native_sdpa_* (FlashAttention-2's flash_fwd_*: not matched)
  run prefill_ncu_cudnn 200 ncu --kernel-name regex:'cudnn|sdpa' --launch-skip 3 --launch-count 1 "${sections[@]}" \
    "${case[@]}"
}

stage_prefillstalls() {  # issue 48: Nsight Compute's warp-stall samples per SASS instruction of the Hopper prefill
  # kernel (PREFILL_PROFILE_VARIANT, default 11, the default pipeline) on one 16k causal prefill, bf16; clocks left alone
  if ! command -v ncu > /dev/null; then echo "prefillstalls: no ncu on this machine"; return; fi
  # (bench/prefill_variants.py: its first launches are the pipeline's own, before cuDNN's)
  local case=(python3 bench/prefill_variants.py --iters 3 --repeats 1 --no-cudnn --cases 1:16384
              --variants "${PREFILL_PROFILE_VARIANT:-11}")
  run prefill_stalls 300 ncu --clock-control none --kernel-name regex:prefill_hopper --launch-skip 2 --launch-count 1 \
    --section SourceCounters --section WarpStateStats --section SpeedOfLight --import-source no -f \
    -o /tmp/prefill_stalls "${case[@]}"
  ncu -i /tmp/prefill_stalls.ncu-rep --page source --csv --print-source sass > /tmp/prefill_stalls_sass.csv \
    2> "$OUT/prefill_stalls_export.err"
  ncu -i /tmp/prefill_stalls.ncu-rep --page details --print-details all > "$OUT/prefill_stalls_details.txt" 2>&1
  gzip -c /tmp/prefill_stalls_sass.csv > "$OUT/prefill_stalls_sass.csv.gz"
  python3 bench/ncu_stalls.py /tmp/prefill_stalls_sass.csv > "$OUT/prefill_stalls_top.txt" 2>&1
  head -n 60 "$OUT/prefill_stalls_top.txt"
}

stage_prefillvariants() {  # issue 48: bench/prefill_variants.py, pipelines PREFILL_VARIANTS_LIST beside cuDNN
  run prefill_variants 400 python3 bench/prefill_variants.py --cases ${PREFILL_VARIANT_CASES:-1:8192 1:16384 1:32768 4:4096} \
    --variants ${PREFILL_VARIANTS_LIST:-10 11}
}

stage_gemvprofile() {  # issue 42: Nsight Compute on the FP8 GEMV of gate_up and o_proj at one token (gemv.cu) and at
  # four (gemv_tc.cu's default pipeline, and GEMV_PROFILE_VARIANTS): DRAM and L2 traffic, speed of light, warp stalls
  if ! command -v ncu > /dev/null; then echo "gemvprofile: no ncu on this machine"; return; fi
  local sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats
                  --section LaunchStats --section Occupancy
                  --metrics dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sector_hit_rate.pct)
  for shape in gate_up o_proj; do
    run "gemv_ncu_${shape}_m1" 120 ncu --kernel-name regex:gemv --launch-skip 4 --launch-count 1 "${sections[@]}" \
      python3 bench/gemv_ncu_case.py --shape "$shape" --m 1
    for v in default ${GEMV_PROFILE_VARIANTS:-}; do
      local variant=()
      [ "$v" = default ] || variant=(--variant "$v")
      run "gemv_ncu_${shape}_m4_v$v" 120 ncu --kernel-name regex:gemv --launch-skip 4 --launch-count 1 \
        "${sections[@]}" python3 bench/gemv_ncu_case.py --shape "$shape" --m 4 "${variant[@]}"
    done
  done
}

stage_longcontext() {  # issue 48, bench/results/current/long-context.md: TTFT at 4k and 32k through HTTP, what the
  # HTTP path alone adds, then offline with the FLOP limit, then 131,071 tokens with YaRN (factor 4) offline
  [ -d /tmp/qwen3-8b-dummy ] || python3 bench/make_dummy_checkpoint.py --preset Qwen3-8B --out /tmp/qwen3-8b-dummy
  start_server "server_longcontext.log" /tmp/qwen3-8b-dummy --max-model-len 33000 &&
    run "ttft_http_8b" 200 python3 bench/latency.py --model Qwen3-8B --http-only --url http://127.0.0.1:$PORT \
    --prompt-lens 128 --new-tokens 4 --ttft-lens 4096 32768 --json "$OUT/ttft_http_8b.json"
  # The same through a client that is not ours (SGL_TOOLS): 3 prompts one at a time, sent as token ids to the native
  # /generate (as text, random-ids prompts re-tokenize to other lengths: 32,768 became 36,786 tokens). No warm-up
  # request and a seed per length: the warm-up repeats the first prompt, and one seed gives the 32k prompts the 4k
  # ones as cached prefixes (2026-11-28: a 56% prefix-cache hit rate, a 32k median TTFT of 1,167 ms)
  for n in 4096 32768; do
    bench_serving "ttft_http_8b_bench_serving_$n" --backend sglang --tokenize-prompt --num-prompts 3 \
      --max-concurrency 1 --random-input-len "$n" --random-output-len 2 --warmup-requests 0 --seed "$n"
  done
  stop_server
  # What the HTTP path alone adds at each length (the server before a synthetic core that answers at once; CPU only)
  run "ttft_http_path" 120 python3 bench/frontend_rate.py --model /tmp/qwen3-8b-dummy --replicas 1 \
    --ttft-lens 16 4096 32768 --json "$OUT/ttft_http_path.json"
  run "ttft_offline_8b" 200 python3 bench/latency.py --model Qwen3-8B --load-format dummy --prompt-lens 128 \
    --new-tokens 4 --ttft-lens 4096 32768 --max-model-len 33000 --json "$OUT/ttft_offline_8b.json"
  run "ttft_offline_8b_128k" 240 python3 bench/latency.py --model Qwen3-8B --load-format dummy --prompt-lens 128 \
    --new-tokens 4 --ttft-lens 131071 --max-model-len 131072 \
    --rope-scaling '{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768}' \
    --json "$OUT/ttft_offline_8b_128k.json"
}

stage_fp8serving() {  # bench/results/current/serving-256.md: bf16 and FP8 weights at 256 in flight
  [ -d /tmp/qwen3-8b-dummy ] || python3 bench/make_dummy_checkpoint.py --preset Qwen3-8B --out /tmp/qwen3-8b-dummy
  for q in none fp8; do
    run "throughput_8b_128x1024_$q" 240 python3 bench/throughput.py --model Qwen3-8B --load-format dummy \
      --quantization "$q" --workload fixed --num-prompts 512 --input-len 128 --output-len 1024 --max-num-seqs 256 \
      --json "$OUT/throughput_8b_128x1024_$q.json"
    [ -n "$SGL_TOOLS" ] || { echo "SGL_TOOLS not set: no HTTP run"; continue; }
    start_server "server_serving_$q.log" /tmp/qwen3-8b-dummy --quantization "$q"
    bench_serving "bench_serving_$q" --backend vllm --num-prompts 512 --max-concurrency 256 \
      --random-input-len 128 --random-output-len 1024
    stop_server
  done
}

SPEC_SYNTHETIC='{"method": "ngram", "num_speculative_tokens": 3, "synthetic_acceptance_length": 2.0}'

stage_speculative() {  # issue 42: a server and an engine side by side (small pools), speculation off then on
  [ -d /tmp/qwen3-8b-dummy ] || python3 bench/make_dummy_checkpoint.py --preset Qwen3-8B --out /tmp/qwen3-8b-dummy
  for q in ${SPEC_QUANT:-none fp8}; do
    for mode in ${SPEC_MODES:-off on}; do
      local extra=()
      [ "$mode" = on ] && extra=(--speculative-config "$SPEC_SYNTHETIC")
      local tag="${mode}_$q${SPEC_TAG:-}"
      start_server "server_spec_$tag.log" /tmp/qwen3-8b-dummy --quantization "$q" --num-pages 2048 "${extra[@]}" &&
        run "latency_spec_$tag" 150 python3 bench/latency.py --model Qwen3-8B --load-format dummy \
        --quantization "$q" --num-pages 2048 --prompt-lens 128 --new-tokens 128 --repeats "${SPEC_REPEATS:-5}" \
        --url http://127.0.0.1:$PORT \
        "${extra[@]}" --json "$OUT/latency_spec_$tag.json"
      # and an independent client, one request at a time (SGL_TOOLS set): SGLang's bench_serving, its TPOT and ITL
      bench_serving "bench_serving_spec_$tag" --backend vllm --num-prompts 8 --max-concurrency 1 \
        --random-input-len 128 --random-output-len 128
      stop_server
    done
  done
}

# spec_throughput_pair NAME SPEC IN_FLIGHT PROMPTS OUTPUT_LEN LIMIT [MODES]: bench/throughput.py (random Qwen3-8B,
# 128 in) with speculation off, then on (the speculative config SPEC) -> OUT/NAME_{off,on}_cIN_FLIGHT.json
spec_throughput_pair() {
  local name="$1" spec="$2" c="$3" prompts="$4" output_len="$5" limit="$6"
  for mode in ${7:-off on}; do
    local extra=()
    [ "$mode" = on ] && extra=(--speculative-config "$spec")
    run "${name}_${mode}_c$c" "$limit" python3 bench/throughput.py --model Qwen3-8B --load-format dummy \
      --workload fixed --num-prompts "$prompts" --input-len 128 --output-len "$output_len" --max-num-seqs "$c" \
      "${extra[@]}" --json "$OUT/${name}_${mode}_c$c.json"
  done
}

stage_specthroughput() {  # issue 42: speculation must pay at 1, 4 and 16 in flight and cost nothing at 256
  for c in ${SPEC_INFLIGHT:-1 4 16}; do
    spec_throughput_pair throughput_spec "$SPEC_SYNTHETIC" "$c" $((c * 4)) 256 120
  done
  # (SPEC_SATURATED=skip: not the 256 pair, where speculation switches itself off)
  [ "${SPEC_SATURATED:-}" = skip ] ||
    spec_throughput_pair throughput_spec "$SPEC_SYNTHETIC" 256 512 1024 200 "${SPEC_SATURATED:-off on}"
}
stage_gemvtc() {  # issue 42: the tensor-core GEMV's FP8 pipelines at 2 to 4 tokens, their test, then FP8 speculation
  # (acceptance 2.0, batch 1, offline and through HTTP) with each pipeline in the whole engine
  # shellcheck disable=SC2086  # (the variants are words)
  run gemv_tc_variants 120 python3 bench/bench_gemv.py --batches 1 2 3 4 --shapes qkv o_proj gate_up down \
    --tc-fp8-variants ${GEMV_TC_BENCH_VARIANTS:-5 7 8 11 12} --json "$OUT/gemv_tc_variants.json"
  FASTQWEN_RESULTS_DIR="$OUT" run gemv_tc_variants_test 120 python3 -m pytest -q -p no:cacheprovider \
    tests/test_gemv_gpu.py -k "pipelines or tensor_core or matches_reference"
  local variants="${GEMV_TC_VARIANTS:-fastest}"
  if [ "$variants" = fastest ]; then  # the default pipeline and the one fastest over a layer's four at 2 to 4 tokens
    python3 -c '
import json, sys
shapes = json.load(open(sys.argv[1]))["shapes"].values()
rows = [r for rows in shapes for r in rows if 2 <= r["batch"] <= 4]
names = {k for r in rows for k in r if k.startswith("gemv_fp8_v") and k.endswith("_us")}
print(min(names, key=lambda k: sum(r[k] for r in rows))[len("gemv_fp8_v"):-len("_us")])' \
      "$OUT/gemv_tc_variants.json" > /tmp/fastest_fp8_pipeline  # (a later call on the same machine reads it)
    variants="$( (cd /tmp && python3 -c 'from fastqwen import _C; print(_C.set_gemv_tc_fp8_variant(0))') |
      cat - /tmp/fastest_fp8_pipeline | sort -un | tr '\n' ' ')"
    echo "gemvtc: FP8 speculation with pipelines $variants (the fastest: $(cat /tmp/fastest_fp8_pipeline))"
  fi
  SPEC_QUANT=fp8 SPEC_MODES=off stage_speculative  # (the no-speculation figure of the same run)
  for v in $variants; do
    FASTQWEN_GEMV_TC_FP8_VARIANT=$v SPEC_QUANT=fp8 SPEC_MODES=on SPEC_TAG="_v$v" stage_speculative
  done
}

stage_verifyprofile() {  # issue 42: the FP8 verify step (k = 3, acceptance 2.0, batch 1) kernel by kernel, without
  # programmatic dependent launch so that the kernels' durations add up, then its graph timed with it
  for pdl in 0 1; do
    FASTQWEN_PDL=$pdl run "verify_profile_fp8_pdl$pdl" 150 python3 bench/profile_step.py --model Qwen3-8B \
      --load-format dummy --quantization fp8 --num-pages 2048 --speculative-config "$SPEC_SYNTHETIC" --verify \
      $([ "$pdl" = 0 ] && echo --kernels) --json "$OUT/verify_profile_fp8_pdl$pdl.json"
  done
}

stage_specgate() {  # issue 42: chained verify steps, the host gate and neither on the same machine: FP8 speculation
  # through HTTP and offline with each, and without speculation; bf16 chained; then profile_step --verify with each
  # (the host parts between two verify steps)
  SPEC_QUANT=fp8 stage_speculative
  FASTQWEN_VERIFY_CHAIN=0 SPEC_QUANT=fp8 SPEC_MODES=on SPEC_TAG=_gate stage_speculative
  FASTQWEN_VERIFY_CHAIN=0 FASTQWEN_VERIFY_GATE=0 SPEC_QUANT=fp8 SPEC_MODES=on SPEC_TAG=_nogate stage_speculative
  SPEC_QUANT=none SPEC_MODES=on stage_speculative
  for mode in chain:1:1 gate:0:1 plain:0:0; do
    local name=${mode%%:*} flags=${mode#*:}
    FASTQWEN_VERIFY_CHAIN=${flags%:*} FASTQWEN_VERIFY_GATE=${flags#*:} run "verify_profile_fp8_$name" 120 \
      python3 bench/profile_step.py --model Qwen3-8B --load-format dummy --quantization fp8 --num-pages 2048 \
      --speculative-config "$SPEC_SYNTHETIC" --verify --json "$OUT/verify_profile_fp8_$name.json"
  done
}

stage_eagle3() {  # issue 42: EAGLE-3 on the GPU: a random head at Qwen3-8B's published shapes (bench/make_eagle3_head.py)
  # drafting for real, acceptance forced to 2.0 (k = 3): batch-1 TPOT offline and through HTTP, bf16 and FP8 weights,
  # beside speculation off (SPEC_QUANT)
  [ -d /tmp/qwen3-8b-dummy ] || python3 bench/make_dummy_checkpoint.py --preset Qwen3-8B --out /tmp/qwen3-8b-dummy
  [ -d /tmp/qwen3-8b-eagle3 ] || python3 bench/make_eagle3_head.py --target /tmp/qwen3-8b-dummy --out /tmp/qwen3-8b-eagle3
  # EAGLE3_HEAD_QUANT=fp8: the head's projections quantized too (speculative_config.quantization)
  local head_quant="" tag=_eagle3
  [ -n "${EAGLE3_HEAD_QUANT:-}" ] && head_quant=", \"quantization\": \"$EAGLE3_HEAD_QUANT\"" && tag="_eagle3_head$EAGLE3_HEAD_QUANT"
  local eagle3="{\"method\": \"eagle3\", \"model\": \"/tmp/qwen3-8b-eagle3\", \"num_speculative_tokens\": 3, \"synthetic_acceptance_length\": 2.0$head_quant}"
  SPEC_SYNTHETIC="$eagle3" SPEC_TAG=$tag stage_speculative
  # where the cycle's time goes: profile_step --verify with the head (drafter_ms: its advance and draft steps)
  for q in ${SPEC_QUANT:-none fp8}; do
    run "verify_profile${tag}_$q" 150 python3 bench/profile_step.py --model Qwen3-8B --load-format dummy \
      --quantization "$q" --num-pages 2048 --speculative-config "$eagle3" --verify --json "$OUT/verify_profile${tag}_$q.json"
  done
}

stage_specreplay() {  # issue 42's replay test: acceptance length >= 3 and TPOT >= 2x better on the second pass
  # (and speculation off in the same call: the same prompt length and output length, one request at a time)
  run spec_replay_off 120 python3 bench/latency.py --model Qwen3-8B --load-format dummy --prompt-lens 128 \
    --new-tokens 256 --json "$OUT/spec_replay_off.json"
  run spec_replay 200 python3 bench/spec_replay.py --model Qwen3-8B --load-format dummy --json "$OUT/spec_replay.json"
}

stage_specswitch() {  # issue 42: speculation at acceptance 2.0 kept on above its default switch-off batch size
  local forced='{"method": "ngram", "num_speculative_tokens": 3, "synthetic_acceptance_length": 2.0, "max_batch_size": 512}'
  for c in ${SPEC_SWITCH_INFLIGHT:-32 64 128}; do
    spec_throughput_pair throughput_forced "$forced" "$c" $((c * 2)) 512 120
  done
}

stage_mutants() {  # tests/mutation_check.py's mutants named in MUTANTS (a,b,...): each built into its own copy of
  # the module from the kept build folder; its named tests must fail against it
  [ -n "${MUTANTS:-}" ] || { echo "mutants: name them in MUTANTS=a,b"; return; }
  timeout "${MUTANTS_TIMEOUT:-400}" python3 tests/mutation_check.py --build-dir /tmp/fastqwen-build --jobs 1 \
    --names "$MUTANTS" --out "$OUT" > "$OUT/mutations_run.log" 2>&1 || bench_rc=1
  grep -E "^== |caught|NOT RUN|surviv" "$OUT/mutations_run.log" | tail -n 20
}

stage_fp8kvserving() {  # issue 47: FP8 weights + FP8 KV at 512 in flight, offline then through HTTP
  [ -d /tmp/qwen3-8b-dummy ] || python3 bench/make_dummy_checkpoint.py --preset Qwen3-8B --out /tmp/qwen3-8b-dummy
  local flags=(--quantization fp8 --kv-cache-dtype fp8_e4m3 --max-num-seqs 512)
  local api=${API_SERVERS:-1}  # front-end processes of the HTTP run (--api-server-count)
  run throughput_8b_fp8kv_c512 240 python3 bench/throughput.py --model Qwen3-8B --load-format dummy "${flags[@]}" \
    --workload fixed --num-prompts 1024 --input-len 128 --output-len 1024 --json "$OUT/throughput_8b_fp8kv_c512.json"
  [ -n "$SGL_TOOLS" ] || { echo "SGL_TOOLS not set: no HTTP run"; return; }
  start_server "server_fp8kv_api$api.log" /tmp/qwen3-8b-dummy "${flags[@]}" --api-server-count "$api" &&
    bench_serving "bench_serving_fp8kv_c512_api$api" --backend vllm --num-prompts 1024 --max-concurrency 512 \
      --random-input-len 128 --random-output-len 1024
  stop_server
}

STEP_ACCOUNT_DEADLINE="${STEP_ACCOUNT_DEADLINE:-}"  # when set (seconds since this script began): both step_account.py runs end by then
step_account_limit() {  # step_account_limit RUNS_LEFT: this run's limit, 280 s or its share of the time left
  [ -n "$STEP_ACCOUNT_DEADLINE" ] || { echo 280; return; }
  local share=$(( (STEP_ACCOUNT_DEADLINE - SECONDS) / $1 ))
  [ "$share" -gt 1 ] || share=1  # (timeout 0 would mean no limit)
  echo $(( share < 280 ? share : 280 ))
}
stage_fp8fused() {  # issue 47: the FP8 GEMMs' inputs quantized where they are computed, tested, then timed in turns
  FASTQWEN_RESULTS_DIR="$OUT" timeout 200 python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider \
    tests/test_gemv_gpu.py -k "quantized or quantizer" > "$OUT/tests_fp8fused.log" 2>&1 || tests_rc=1
  pytest_report "$OUT/tests_fp8fused.log" 20
  timeout 200 python3 tests/mutation_check.py --build-dir /tmp/fastqwen-build --jobs 1 \
    --names fp8_quant_silu_takes_the_gate_for_up,norm_fp8_group_max_over_half_its_lanes --out "$OUT" \
    > "$OUT/mutations_run.log" 2>&1 || bench_rc=1
  grep -E "^== |caught|NOT RUN|surviv" "$OUT/mutations_run.log" | tail -n 5
  local fp8=(--model Qwen3-8B --load-format dummy --quantization fp8 --kv-cache-dtype fp8_e4m3 --max-num-seqs 512)
  for round in 1 2; do
    for fused in 0 1; do
      FASTQWEN_FP8_FUSED_QUANT=$fused run "step_fp8kv_b512_fused${fused}_$round" 90 python3 bench/profile_step.py \
        "${fp8[@]}" --batch 512 --steps 32 --json "$OUT/step_fp8kv_b512_fused${fused}_$round.json"
    done
  done
  for fused in 0 1; do
    FASTQWEN_FP8_FUSED_QUANT=$fused run "throughput_fp8kv_fused$fused" 110 python3 bench/throughput.py "${fp8[@]}" \
      --workload fixed --num-prompts 1024 --input-len 128 --output-len 1024 --json "$OUT/throughput_fp8kv_fused$fused.json"
  done
}

decode_setting_check() {  # decode_setting_check NAME MUTANTS SETTING CASE...: the decode GPU tests, the mutants
  # MUTANTS (comma-separated), then bench/kernels.py's decode rows at CASEs with the kernel's SETTING (its
  # --decode-compare) against the default, in turns (bf16 and FP8 pools) -> tests_NAME.log, decode_NAME.json
  local name="$1" mutants="$2" setting="$3"
  shift 3
  FASTQWEN_RESULTS_DIR="$OUT" timeout 240 python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider \
    tests/test_attention_gpu.py tests/test_fp8_kv_gpu.py -k "decode" > "$OUT/tests_$name.log" 2>&1 || tests_rc=1
  pytest_report "$OUT/tests_$name.log" 20
  timeout 200 python3 tests/mutation_check.py --build-dir /tmp/fastqwen-build --jobs 1 --names "$mutants" --out "$OUT" \
    > "$OUT/mutations_run.log" 2>&1 || bench_rc=1
  grep -E "^== |caught|NOT RUN|surviv" "$OUT/mutations_run.log" | tail -n 5
  run "decode_$name" 200 python3 bench/kernels.py --ops decode --kv-dtypes bf16 fp8 --iters 30 --decode-compare "$setting" \
    --decode-cases "$@" --json "$OUT/decode_$name.json"
}

decode_steps_in_turns() {  # decode_steps_in_turns NAME FLAG: the engine's decode step (graph replay and engine step,
  # bench/profile_step.py) without and with FLAG, in turns: bf16 at 256 and FP8 + FP8 KV at 512, 640-token prompts
  # -> step_bf16_256[_NAME].json, step_fp8kv_512[_NAME].json
  local name="$1" flag="$2" on step=(--model Qwen3-8B --load-format dummy --prompt-len 640 --steps 32)
  for on in "" "$flag"; do
    run "step_bf16_256${on:+_$name}" 90 python3 bench/profile_step.py "${step[@]}" --batch 256 --max-num-seqs 256 \
      $on --json "$OUT/step_bf16_256${on:+_$name}.json"
    run "step_fp8kv_512${on:+_$name}" 150 python3 bench/profile_step.py "${step[@]}" --batch 512 --quantization fp8 \
      --kv-cache-dtype fp8_e4m3 --max-num-seqs 512 $on --json "$OUT/step_fp8kv_512${on:+_$name}.json"
  done
}

stage_decodeafresh() {  # issue 47: decode attention's loads running on across a block's work items, tested, then
  # against the pipeline started afresh at each item, in turns: the kernel at batch 1 and at saturated batches
  decode_setting_check afresh decode_q_in_the_next_stage_slot,decode_merge_in_the_stage_loading afresh \
    1:128 1:16384 64:4096 256:640 256:100-1200 512:640 512:1200 512:100-1200
}

stage_decodeafreshsteps() {  # issue 47: the engine with decode attention's loads run on across items and started
  # afresh, in turns: the decode step's graph replay (bf16 at 256, FP8 + FP8 KV at 512, 640-token prompts), then
  # offline throughput (128 / 1,024, 1,024 requests) bf16 at 256 in flight and FP8 + FP8 KV at 512
  decode_steps_in_turns afresh --decode-afresh
  local fixed=(--model Qwen3-8B --load-format dummy --workload fixed --num-prompts 1024 --input-len 128 --output-len 1024)
  if [ "${DECODE_AFRESH_BF16_THROUGHPUT:-1}" = 1 ]; then
    for afresh in --decode-afresh ""; do
      run "throughput_bf16_256${afresh:+_afresh}" 150 python3 bench/throughput.py "${fixed[@]}" --max-num-seqs 256 \
        $afresh --json "$OUT/throughput_bf16_256${afresh:+_afresh}.json"
    done
  fi
  for afresh in "" --decode-afresh; do
    run "throughput_fp8kv_512${afresh:+_afresh}" 110 python3 bench/throughput.py "${fixed[@]}" --quantization fp8 \
      --kv-cache-dtype fp8_e4m3 --max-num-seqs 512 $afresh --json "$OUT/throughput_fp8kv_512${afresh:+_afresh}.json"
  done
}

stage_itemrecords() {  # issue 47: work items read from the plan's chunk records, copied items ahead (the default), tested,
  # then against each item searched in the chunk offsets, in turns: the kernel, then the engine's saturated decode steps
  decode_setting_check records \
    decode_record_ring_filled_one_item_short,decode_item_record_ends_a_tile_early,decode_skips_first_chunk search \
    1:128 1:4160 1:16384 64:4096 256:640 256:100-1200 512:640 512:100-1200
  decode_steps_in_turns search --decode-search
}

stage_abkernels() {  # a kernel change against the code before it: bench/kernels.py's decode rows (AB_DECODE_CASES)
  # with this tree's build and with a build of AB_BASE (default ab_base/, an untracked source tree made with
  # `git archive <ref> python csrc CMakeLists.txt pyproject.toml | tar -x -C ab_base`), AB_ROUNDS times each in turns
  local base="${AB_BASE:-ab_base}"
  if [ ! -d "$base" ]; then echo "abkernels: no $base"; return; fi
  wait_ab_prebuild
  bash bench/ab_builds.sh "$base" "$OUT/ab" "${AB_ROUNDS:-2}" python3 bench/kernels.py --ops decode --kv-dtypes bf16 fp8 \
    --iters 30 --decode-cases ${AB_DECODE_CASES:-1:128 1:16384 64:4096 256:640 256:100-1200 512:640 512:100-1200} \
    --json "$OUT/ab/{}.json" || bench_rc=1
  python3 bench/ab_summary.py "$OUT/ab" --json "$OUT/ab_summary.json" || bench_rc=1
  rm -rf "$OUT/ab/base_site"  # (the base build: not results)
}

stage_absteps() {  # a kernel change against the code before it in the engine: bench/profile_step.py's decode step
  # (graph replay and engine step; bf16 at 256 and FP8 + FP8 KV at 512, 640-token prompts) with this tree's build and
  # with AB_BASE's (as stage abkernels), AB_STEP_ROUNDS times each in turns -> absteps_{bf16_256,fp8kv_512}/{new,base}_N.json
  local base="${AB_BASE:-ab_base}"
  if [ ! -d "$base" ]; then echo "absteps: no $base"; return; fi
  wait_ab_prebuild
  local step=(--model Qwen3-8B --load-format dummy --prompt-len 640 --steps 32)
  bash bench/ab_builds.sh "$base" "$OUT/absteps_bf16_256" "${AB_STEP_ROUNDS:-1}" timeout 120 python3 bench/profile_step.py \
    "${step[@]}" --batch 256 --max-num-seqs 256 --json "$OUT/absteps_bf16_256/{}.json" || bench_rc=1
  bash bench/ab_builds.sh "$base" "$OUT/absteps_fp8kv_512" "${AB_STEP_ROUNDS:-1}" timeout 150 python3 bench/profile_step.py \
    "${step[@]}" --batch 512 --quantization fp8 --kv-cache-dtype fp8_e4m3 --max-num-seqs 512 \
    --json "$OUT/absteps_fp8kv_512/{}.json" || bench_rc=1
  for which in bf16_256 fp8kv_512; do
    python3 bench/ab_summary.py "$OUT/absteps_$which" --json "$OUT/absteps_${which}_summary.json" || bench_rc=1
  done
  rm -rf "$OUT"/absteps_*/base_site  # (the base build: not results)
}

stage_minchunk() {  # issue 47: bf16 decode attention with 512-token chunks (MIN_CHUNK) against the default 256, in
  # turns: batch-1 steps at 1k and 4k of context (the cost: fewer chunks, fewer SMs), the batch-256 step (640-token
  # prompts) and offline throughput at 256 in flight (the gain the kernel rows promise: 9% at 256 and 512 x 640)
  local chunk=${MIN_CHUNK:-512}
  run minchunk_batch1 150 python3 bench/leave_out.py --model Qwen3-8B --load-format dummy --prompt-lens 1024 4096 \
    --variants full --min-chunks "$chunk" --rounds 3 --json "$OUT/minchunk_batch1.json"
  local step=(--model Qwen3-8B --load-format dummy --prompt-len 640 --steps 32 --batch 256 --max-num-seqs 256)
  for round in 1 2; do
    for c in 0 "$chunk"; do
      run "minchunk_step_${c}_$round" 90 python3 bench/profile_step.py "${step[@]}" --decode-min-chunk "$c" \
        --json "$OUT/minchunk_step_${c}_$round.json"
    done
  done
  local fixed=(--model Qwen3-8B --load-format dummy --workload fixed --num-prompts 1024 --input-len 128 --output-len 1024)
  for c in "$chunk" 0; do
    run "minchunk_throughput_$c" 150 python3 bench/throughput.py "${fixed[@]}" --max-num-seqs 256 --decode-min-chunk "$c" \
      --json "$OUT/minchunk_throughput_$c.json"
  done
}

stage_decodestalls() {  # issue 47: Nsight Compute's warp-stall samples per SASS instruction of the decode attention
  # kernel at 512 sequences of 640 tokens, bf16 then FP8 pools (its first launch: the eager call before the graphs);
  # DECODE_STALLS picks others, as kv:case pairs ("fp8:512:100-1200 fp8:512:640")
  if ! command -v ncu > /dev/null; then echo "decodestalls: no ncu on this machine"; return; fi
  local spec kv case name
  for spec in ${DECODE_STALLS:-bf16:512:640 fp8:512:640}; do
    kv=${spec%%:*} case=${spec#*:}
    name="${kv}_${case//[:-]/_}"
    run "decode_stalls_$name" 200 ncu --clock-control none --kernel-name regex:decode_kernel --launch-count 1 \
      --section SourceCounters --section WarpStateStats --section SpeedOfLight --section Occupancy --import-source no \
      -f -o "/tmp/decode_stalls_$name" python3 bench/kernels.py --ops decode --kv-dtypes "$kv" --iters 3 \
      --decode-cases "$case"
    ncu -i "/tmp/decode_stalls_$name.ncu-rep" --page source --csv --print-source sass > "/tmp/decode_stalls_${name}_sass.csv" \
      2> "$OUT/decode_stalls_${name}_export.err"
    ncu -i "/tmp/decode_stalls_$name.ncu-rep" --page details --print-details all > "$OUT/decode_stalls_${name}_details.txt" 2>&1
    gzip -c "/tmp/decode_stalls_${name}_sass.csv" > "$OUT/decode_stalls_${name}_sass.csv.gz"
    python3 bench/ncu_stalls.py "/tmp/decode_stalls_${name}_sass.csv" > "$OUT/decode_stalls_${name}_top.txt" 2>&1
    head -n 40 "$OUT/decode_stalls_${name}_top.txt"
  done
}

stage_stepaccount() {  # issue 47: the saturated step accounted for, bf16 and FP8 weights + FP8 KV
  run step_account_bf16 "$(step_account_limit 2)" python3 bench/step_account.py --model Qwen3-8B --load-format dummy \
    --json "$OUT/step_account_bf16.json"
  run step_account_fp8 "$(step_account_limit 1)" python3 bench/step_account.py --model Qwen3-8B --load-format dummy \
    --quantization fp8 --kv-cache-dtype fp8_e4m3 --json "$OUT/step_account_fp8.json"
}

stage_saturated() {  # issue 47: decode attention and FP8 GEMMs at saturated batch sizes, then the step account
  run decode_saturated 150 python3 bench/kernels.py --ops decode --kv-dtypes bf16 fp8 --decode-cases \
    256:100 256:640 256:1200 256:100-1200 512:100 512:640 512:1200 512:100-1200 --json "$OUT/decode_saturated.json"
  run gemm_fp8 150 python3 bench/bench_gemm_fp8.py --presets Qwen3-8B --batches 16 32 64 128 256 512 \
    --json "$OUT/gemm_fp8.json"
  # The step accounts share what is left of 570 s from the script's start: one device call holds 600.
  STEP_ACCOUNT_DEADLINE=570 stage_stepaccount
}

# The A/B stages build AB_BASE as well (bench/ab_builds.sh, about 100 s): started here in the background, beside this
# tree's build, into the build folder ab_builds.sh reuses, so that its own build of the base only installs.
AB_PREBUILD_PID=""
if [[ " $STAGES " =~ \ (abkernels|absteps)\  ]] && [ -d "${AB_BASE:-ab_base}" ]; then
  python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/fastqwen-ab-prebuilt \
    -Cbuild-dir=/tmp/fastqwen-ab-build "$(cd "${AB_BASE:-ab_base}" && pwd)" > "$OUT/ab_prebuild.log" 2>&1 &
  AB_PREBUILD_PID=$!
fi
wait_ab_prebuild() {  # before bench/ab_builds.sh touches the build folder
  [ -n "$AB_PREBUILD_PID" ] && { wait "$AB_PREBUILD_PID" || echo "the base's background build failed: ab_builds.sh builds it"; }
  AB_PREBUILD_PID=""
}

for stage in $STAGES; do
  case "$stage" in
    tests) stage_tests ;;
    tests1) stage_tests 1 ;;
    tests2) stage_tests 2 ;;
    tests3) stage_tests 3 ;;
    tests4) stage_tests 4 ;;
    gputests) stage_gputests ;;
    testsubset|kernels|offline|latency|throughput|serving|compare|serving15|structured|batch1|copyref|prefill|prefillbar|verifyattention|prefillprofile|prefillstalls|prefillvariants|longcontext|fp8serving|speculative|specgate|specthroughput|gemvtc|gemvprofile|eagle3|verifyprofile|specreplay|specswitch|fp8kvserving|fp8fused|decodeafresh|decodeafreshsteps|itemrecords|abkernels|absteps|minchunk|decodestalls|stepaccount|saturated|mutants)
      # (mutants also need the kept build folder)
      if ! (cd /tmp && python3 -c "import fastqwen._C") 2>/dev/null ||
        [ "$(cat "$BUILT_HASH_FILE" 2>/dev/null)" != "$(tree_hash)" ] ||
        { [ "$stage" = mutants ] && [ ! -d /tmp/fastqwen-build ]; }; then
        build  # (none yet, or built from other sources)
      fi
      "stage_$stage" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done

echo "== summary: build rc=$build_rc tests rc=$tests_rc bench rc=$bench_rc serving rc=$serve_rc" | tee "$OUT/summary.txt"
pack_out "$OUT"
if [ "$build_rc" -ne 0 ] || [ "$tests_rc" -ne 0 ]; then
  exit 1
fi
exit 0
