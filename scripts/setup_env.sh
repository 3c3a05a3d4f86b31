#!/usr/bin/env bash
# Create (or reuse) the project virtualenv and install specstop into it.
#
# Why a script: a bare `torch` requirement on a machine with no torch pulls a multi-GB CUDA
# build. We install torch==2.13.0 (the local CPU wheel on these machines) first, and only when
# the virtualenv has no torch yet, so GPU users who bring their own torch keep it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SPECSTOP_VENV:-.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtualenv $VENV"
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if python -c "import torch" >/dev/null 2>&1; then
  echo "[setup] keeping installed torch $(python -c 'import torch; print(torch.__version__)')"
else
  echo "[setup] installing torch==${SPECSTOP_TORCH_VERSION:-2.13.0}"
  python -m pip install -q "torch==${SPECSTOP_TORCH_VERSION:-2.13.0}"
fi
if ! python -c "import specstop, transformers, lightning, datasets, pytest" >/dev/null 2>&1 \
   || [ pyproject.toml -nt "$VENV/.specstop-installed" ]; then
  echo "[setup] installing specstop and its dependencies"
  python -m pip install -q -e ".[dev]"  # dev = every extra + pytest, ruff
  touch "$VENV/.specstop-installed"
fi
echo "[setup] ready: $VENV ($(python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
