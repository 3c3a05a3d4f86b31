#!/usr/bin/env bash
# `make gpu-check`: run scripts/gpu_check.py on this machine's own Python, torch and transformers.
#
# DEVICE=cuda (default): the interpreter is $PYTHON or python3 (a GPU image's own). The wheels that
# `make gpu-wheels` put in .whl/ (packages such an image lacks: datasets, jsonargparse ...) and
# specstop itself are installed with --no-deps into a folder of their own, put first on PYTHONPATH,
# so the image's torch and transformers are used and never replaced. Nothing is fetched.
# DEVICE=cpu: the project virtualenv (make setup), the tiny pair only; rows that need CUDA are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE="${DEVICE:-cuda}"
BUDGET="${GPU_CHECK_BUDGET:-450}"
if [ "$DEVICE" = cpu ]; then
  PY="${PYTHON:-${SPECSTOP_VENV:-.venv}/bin/python}"
else
  PY="${PYTHON:-python3}"
  SITE="${GPU_CHECK_SITE:-/tmp/specstop-gpu-site}"
  rm -rf "$SITE" && mkdir -p "$SITE"
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl
  else
    echo "[gpu-check] no wheels in .whl/ (make gpu-wheels makes them); using the packages installed here"
  fi
  if "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "$SITE" . >"$SITE.log" 2>&1; then
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  else  # no setuptools >= 68 here to build it: run specstop from this checkout instead
    echo "[gpu-check] specstop did not build here ($(tail -n 1 "$SITE.log")); running it from this checkout"
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
echo "[gpu-check] $("$PY" -c 'import sys, torch, transformers; print(sys.executable, "torch", torch.__version__, "transformers", transformers.__version__)')"
exec "$PY" scripts/gpu_check.py --device "$DEVICE" --budget "$BUDGET" ${GPU_CHECK_OUT:+--out "$GPU_CHECK_OUT"} \
  ${GPU_CHECK_WORK:+--work "$GPU_CHECK_WORK"}
