#!/usr/bin/env bash
# Create (or reuse) .venv and install tracemagic with its test extra, every package
# pinned by constraints.txt. torch is pinned to 2.13.0, which pip takes from the local
# CPU wheel (find-links) instead of pulling the CUDA build from the registry.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
extra=()
if [ -d /opt/wheels ]; then
  extra+=(--find-links /opt/wheels)
fi
.venv/bin/python -m pip install -q --upgrade "pip>=24" "${extra[@]}"
.venv/bin/python -m pip install -q "${extra[@]}" -c constraints.txt -e '.[test]'
.venv/bin/python -c "import torch, tracemagic; print('tracemagic', tracemagic.__version__, 'torch', torch.__version__)"
