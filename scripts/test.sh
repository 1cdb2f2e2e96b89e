#!/usr/bin/env bash
# Set up the environment if needed, then run the test suite (what CI runs).
#   bash scripts/test.sh           everything (unit and multi-process integration tests)
#   bash scripts/test.sh --fast    the unit tier only (tests not marked `integration`: no process launched)
# Other arguments go to pytest (e.g. a test file, -k EXPR).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
args=()
for a in "$@"; do
  if [ "$a" = "--fast" ]; then args+=(-m "not integration"); else args+=("$a"); fi
done
ruff check --quiet .  # the lint rules: pyproject.toml [tool.ruff]
exec python -m pytest -q --durations=15 "${args[@]}"
