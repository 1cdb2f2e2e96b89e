#!/usr/bin/env bash
# Set up the environment if needed, then run the test suite (what CI runs).
#   bash scripts/test.sh           everything (unit and multi-process integration tests), three test
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
jobs=${TEST_JOBS:-3}
for a in "$@"; do
  case "$a" in
    --fast) args+=(-m "not integration"); jobs=${TEST_JOBS:-1} ;;
    --serial) jobs=1 ;;
    *) args+=("$a") ;;
  esac
done
# Three at once on a 2-core machine: a test that runs one process or waits (single-rank runs, a signal, a
# save, a launch's start-up) leaves a core idle, which the other test processes take (the whole suite, the same
# load beside it, 2026-12-07: 11:52 with three against 16:38 with two; with two, CPU time was 57% of the
# 2 cores' wall time). Files stay whole (--dist loadfile): their module fixtures (a shared launch) run once.
parallel=()
if [ "$jobs" -gt 1 ]; then parallel=(-n "$jobs" --dist loadfile); fi
ruff check --quiet .  # the lint rules: pyproject.toml [tool.ruff]
exec python -m pytest -q --durations=15 "${parallel[@]}" "${args[@]}"
