#!/usr/bin/env bash
# Set up the environment if needed, then run the test suite (what CI runs).
#   bash scripts/test.sh           everything (unit and multi-process integration tests), two test
#                                  processes at once (pytest-xdist; a test file stays on one process)
#   bash scripts/test.sh --fast    the unit tier only (tests not marked `integration`: no process launched),
#                                  in one process (each extra one re-imports and re-collects the suite,
#                                  which costs the unit tier more than it gains: 147 s against 92 s)
#   bash scripts/test.sh --serial  one test process (TEST_JOBS=N: N at once)
# Other arguments go to pytest (e.g. a test file, -k EXPR).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
args=()
jobs=${TEST_JOBS:-2}
for a in "$@"; do
  case "$a" in
    --fast) args+=(-m "not integration"); jobs=${TEST_JOBS:-1} ;;
    --serial) jobs=1 ;;
    *) args+=("$a") ;;
  esac
done
# Two at once on a 2-core machine: a test that runs one process (single-rank runs, waits for a signal or a
# save) leaves a core idle, which the other test process takes (a mixed sample of 69 tests: 122 s against
# 174 s in one process). Files stay whole (--dist loadfile): their module fixtures (a shared launch) run once.
parallel=()
if [ "$jobs" -gt 1 ]; then parallel=(-n "$jobs" --dist loadfile); fi
ruff check --quiet .  # the lint rules: pyproject.toml [tool.ruff]
exec python -m pytest -q --durations=15 "${parallel[@]}" "${args[@]}"
