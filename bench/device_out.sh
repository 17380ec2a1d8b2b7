# Shared by the device scripts (sourced): the wheels a call carries, and what it sends back. The reply keeps only the
# end of stdout and at most 8 files from $OUT.

# use_carried_wheels: the wheels in .whl/ (packages missing on the machine: fastapi, uvicorn, ...) into /tmp/site,
# put on PYTHONPATH. Nothing when none were carried.
use_carried_wheels() {
  if compgen -G ".whl/*.whl" > /dev/null; then
    # once per machine: scripts run side by side on one host (one per GPU) must not reinstall over each other
    [ -e /tmp/site/.carried ] ||
      { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
          .whl/*.whl && touch /tmp/site/.carried; }
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
}

# tree_hash: the sources an install is built from, hashed. A warm machine keeps the last call's install, which is
# stale when the tree changed since (an eleventh-session call ran old Python code that way): the scripts compare this
# with the hash written at their last build.
tree_hash() {
  find python csrc CMakeLists.txt pyproject.toml -type f \( -name '*.py' -o -name '*.cu' -o -name '*.cuh' -o -name '*.h' \
    -o -name '*.cpp' -o -name '*.txt' -o -name '*.toml' \) -print0 | sort -z | xargs -0 sha1sum | sha1sum | cut -c1-40
}

# pytest_report LOG [LINES]: a pytest log's failures as short tracebacks (trimmed), then its summary lines last.
pytest_report() {
  awk '/= (FAILURES|ERRORS) =/,/short test summary/' "$1" | grep -E "^(E  |_____|tests/[a-z_0-9]+\.py:[0-9]+)" \
    | cut -c1-220 | head -n 160
  grep -E "^(FAILED|ERROR|SKIPPED)|[0-9]+ (passed|failed)" "$1" | cut -c1-260 | tail -n "${2:-70}"
}

# pack_out OUT: everything under OUT replaced by one archive, OUT/results.tgz.
pack_out() {
  local archive
  archive="$(mktemp /tmp/results.XXXXXX.tgz)"
  tar czf "$archive" -C "$1" . && find "$1" -mindepth 1 -delete && mv "$archive" "$1/results.tgz"
}
