#!/usr/bin/env bash
# `make check-oldest`: the decoder and Hugging Face tests on the oldest supported transformers.
#
# The packages in scripts/oldest_supported.txt are installed, without dependencies, into a folder of
# their own that is put first on PYTHONPATH, so the project virtualenv stays as it is and only those
# packages are older. Each version is checked before the tests run, so a wrong pin cannot pass unseen.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SPECSTOP_VENV:-.venv}"
PY="$VENV/bin/python"
SITE="${SPECSTOP_OLDEST_SITE:-$VENV/oldest-supported}"
if [ ! -f "$SITE/.installed" ] || [ scripts/oldest_supported.txt -nt "$SITE/.installed" ]; then
  rm -rf "$SITE"
  "$PY" -m pip install -q --no-deps --target "$SITE" -r scripts/oldest_supported.txt
  touch "$SITE/.installed"
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - <<'PY'
from importlib.metadata import version
from pathlib import Path

pins = [line.split("==") for line in Path("scripts/oldest_supported.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")]
for name, want in pins:
    have = version(name)
    assert have == want, f"{name} {have} is first on the path, not the pinned {want}"
from specstop.pair.compat import check_supported_versions

check_supported_versions()
print("[check-oldest] " + ", ".join(f"{n} {v}" for n, v in pins))
PY
"$PY" -m pytest -q -p no:cacheprovider -m "not gpu" tests/test_decoder.py tests/test_tree_decoder.py \
  tests/test_batched_decoder.py tests/test_pearl_decoder.py tests/test_decoder_sampling.py tests/test_hf_assist.py \
  tests/test_hub_native.py tests/test_export_runtime.py tests/test_tree_node_head.py
