#!/usr/bin/env bash
# Create .venv (Python 3.11+) with the pinned CPU torch, megatron-core and this package.
# Idempotent: a second call only re-checks. On a GPU cluster install your CUDA torch
# into the environment first; see docs/running.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.megatron-snip-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ requirements-cpu.txt -nt "$stamp" ]; then
  python -m pip install -q --upgrade pip
  python -m pip install -q -r requirements-cpu.txt
  python -m pip install -q --no-build-isolation -e '.[test]'
  touch "$stamp"
fi
python -W ignore -c "import torch, megatron.core, megatron_snip; print(f'environment ready: torch {torch.__version__}, megatron-core {megatron.core.__version__}')"
