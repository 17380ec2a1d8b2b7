#!/usr/bin/env bash
# A kernel change against the code before it, in turns, on one GPU: a second build of BASE (a source tree: python/,
# csrc/, CMakeLists.txt, pyproject.toml, e.g. `git archive <ref> python csrc CMakeLists.txt pyproject.toml | tar -x -C
# ab_base`, which travels to the device as an untracked folder) into OUT/base_site, then CMD run ROUNDS times with each
# build, alternating (the installed build first), each run's stdout and stderr in OUT/{new,base}_N.log. A "{}" in CMD
# becomes that run's name (new_N or base_N), for its own --json file.
#   bash bench/ab_builds.sh BASE OUT ROUNDS CMD...
#   bash bench/ab_builds.sh ab_base OUT 2 python3 bench/kernels.py --ops decode --decode-cases 512:640 --json OUT/{}.json
# Builds from scratch take about 100 s on the device; the installed build (the tree's) must exist already.
set -u -o pipefail

BASE="${1:?usage: bash bench/ab_builds.sh BASE OUT ROUNDS CMD...}"
OUT="${2:?}"
ROUNDS="${3:?}"
shift 3
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
BASE="$(cd "$BASE" && pwd)"
cd "$(dirname "$0")/.."

echo "== base build of $BASE"
start=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps --target "$OUT/base_site" -Cbuild-dir=/tmp/fastqwen-ab-build \
  "$BASE" > "$OUT/base_build.log" 2>&1 || { tail -n 30 "$OUT/base_build.log"; exit 1; }
echo "base build in $(( $(date +%s) - start ))s"

rc=0
for round in $(seq 1 "$ROUNDS"); do
  for which in new base; do
    name="${which}_$round"
    cmd=("${@//\{\}/$name}")
    run_rc=0
    if [ "$which" = base ]; then  # the base build's package ahead of the installed one
      PYTHONPATH="$OUT/base_site${PYTHONPATH:+:$PYTHONPATH}" "${cmd[@]}" > "$OUT/$name.log" 2>&1 || run_rc=$?
    else
      "${cmd[@]}" > "$OUT/$name.log" 2>&1 || run_rc=$?
    fi
    echo "$name rc=$run_rc"
    [ "$run_rc" -eq 0 ] || rc=1
  done
done
exit "$rc"
