#!/usr/bin/env bash
# The test run behind bench/results/current/gpu-tests.md: build, every test (GPU ones included), then the mutants of
# tests/mutation_check.py (each must make its tests fail). The mutants compile while the tests run.
#   bash bench/gpu_tests.sh OUTDIR          -> build.log, tests.log, mutations.log, summary.txt
#   MUTANTS_ONLY=1 bash bench/gpu_tests.sh OUTDIR
#       the build and the mutants only (no suite): the mutants build in parallel and MUTANT_JOBS (default 4) are
#       tested at once on the GPU; MUTANTS=a,b picks some by name. -> build.log, mutations.log, summary.txt
#       (mutations_run.log fills as each mutant is decided, so a run cut short still tells which were caught)
# BUILD (default /tmp/fastqwen-build) is the CMake build folder: an earlier build there makes the next one incremental.
set -u -o pipefail
OUT="${1:?usage: bash bench/gpu_tests.sh OUTDIR}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
shift  # the rest: extra pytest arguments
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export FASTQWEN_RESULTS_DIR="$OUT"  # tests record the figures they measured (tests/checkpoints.py record_result)
. bench/device_out.sh
use_carried_wheels
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1; head -n 12 "$OUT/nvidia-smi.txt"
BUILD="${BUILD:-/tmp/fastqwen-build}"
start=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -v -Cbuild-dir=$BUILD . > "$OUT/build.log" 2>&1
build_rc=$?
echo "build rc=$build_rc in $(( $(date +%s) - start ))s" | tee -a "$OUT/build.log"
(cd /tmp && python3 -c "import fastqwen._C as c, torch; print('built_with_cuda', c.built_with_cuda, '| torch', torch.__version__, '|', torch.cuda.get_device_name())") 2>&1 | tee -a "$OUT/build.log"
[ "$build_rc" -eq 0 ] || { tail -n 40 "$OUT/build.log"; exit 1; }

if [ "${MUTANTS_ONLY:-0}" = 1 ]; then
  start=$(date +%s)
  timeout "${MUTANTS_TIMEOUT:-480}" python3 tests/mutation_check.py --build-dir $BUILD --jobs "${MUTANT_JOBS:-4}" \
    ${MUTANTS:+--names "$MUTANTS"} --out "$OUT" 2>&1 | tee "$OUT/mutations_run.log" | grep -E "^== |caught"
  mutants_rc=${PIPESTATUS[0]}
  echo "build rc=$build_rc mutants rc=$mutants_rc in $(( $(date +%s) - start ))s" | tee "$OUT/summary.txt"
  exit "$mutants_rc"
fi

python3 tests/mutation_check.py --build-dir $BUILD --phase build > "$OUT/mutants_build.log" 2>&1 &
mutants=$!
date -u +"tests started %Y-%m-%dT%H:%M:%SZ" > "$OUT/tests.log"
timeout "${TESTS_TIMEOUT:-480}" python3 -m pytest -v -rs -p no:cacheprovider --durations=12 tests "$@" 2>&1 | tee -a "$OUT/tests.log" | tail -n 40
tests_rc=${PIPESTATUS[0]}
echo "tests rc=$tests_rc" | tee -a "$OUT/tests.log"
wait $mutants; cat "$OUT/mutants_build.log"
timeout "${MUTANTS_TIMEOUT:-600}" python3 tests/mutation_check.py --build-dir $BUILD --phase test --jobs "${MUTANT_JOBS:-1}" \
  --out "$OUT" 2>&1 | tee "$OUT/mutations_run.log" | tail -n 3
mutants_rc=${PIPESTATUS[0]}
echo "build rc=$build_rc tests rc=$tests_rc mutants rc=$mutants_rc" | tee "$OUT/summary.txt"
[ "$tests_rc" -eq 0 ] && [ "$mutants_rc" -eq 0 ]
