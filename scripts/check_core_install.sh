#!/usr/bin/env bash
# Prove the core install's promise (docs/decoders.md): `pip install specstop` with no extra loads an
# export and decodes with our decoder, the public API and HF `custom_generate`, without Lightning,
# datasets, matplotlib or scikit-learn - and the export keeps working after it is moved.
#
# The project venv ($SPECSTOP_VENV, default .venv, every extra) builds the export, as a user's
# training machine would; a fresh throwaway venv with the core install consumes it.
# Usage: bash scripts/check_core_install.sh   (or `make check-core-install`)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"
FULL_PY="${SPECSTOP_VENV:-.venv}/bin/python"
PY="${PYTHON:-python3}"
TORCH_VERSION="${SPECSTOP_TORCH_VERSION:-2.13.0}"
START=$SECONDS

say() { echo "[core-install] $*"; }

if [ ! -x "$FULL_PY" ]; then
  say "no project venv at $FULL_PY: run \`make setup\` first (it builds the export)"
  exit 1
fi

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

# 1. The export, made by the full install (training-side packages are allowed there).
say "building a tiny pair and a random-init export with $FULL_PY"
"$FULL_PY" scripts/core_install_smoke.py make-export "$TMP/built"

# 2. Move it: the export must not depend on where it was written (generate.py finds its folder
# from custom_generate= at call time; config.json must hold no path the runtime needs).
mkdir -p "$TMP/moved"
mv "$TMP/built/export" "$TMP/moved/policy"
say "moved the export to $TMP/moved/policy"

# 3. A fresh venv with the core install only.
say "creating a fresh venv with $("$PY" --version 2>&1)"
"$PY" -m venv "$TMP/venv"
CORE="$TMP/venv/bin/python"
# torch first, pinned: a bare `torch` requirement would pull a multi-GB CUDA build, while the
# pinned version resolves to the local CPU wheel on these machines (as scripts/setup_env.sh does).
say "installing torch==$TORCH_VERSION"
"$CORE" -m pip install -q "torch==$TORCH_VERSION"
# Built from a clean copy of what the wheel contains (pyproject.toml, README.md, specstop/):
# installing from the checkout itself would build in-tree, where a stale build/lib from an older
# build can slip deleted modules into the wheel (hiding a broken import), and it would write
# build/ and *.egg-info into the working tree. Non-editable and without extras, like a user's
# `pip install specstop`.
SRC="$TMP/src"
mkdir "$SRC"
cp -R pyproject.toml README.md specstop "$SRC/"
find "$SRC" -name __pycache__ -prune -exec rm -rf {} +
say "installing specstop (no extras) from a copy of $REPO"
"$CORE" -m pip install -q "$SRC"

# 4. The extras' packages must be absent, or the checks below would prove nothing about them.
"$CORE" - <<'EOF'
import importlib.util
import sys

present = [m for m in ("lightning", "datasets", "matplotlib", "sklearn") if importlib.util.find_spec(m) is not None]
if present:
    print(f"FAIL the core install pulled in extra packages: {', '.join(present)}")
    sys.exit(1)
print("ok   lightning, datasets, matplotlib, sklearn are not installed")
EOF

# 5. Decode with the moved export in the core venv. Run from the temp dir so the checkout is not
# on sys.path: `specstop` must come from the installed copy.
(cd "$TMP" && "$CORE" "$REPO/scripts/core_install_smoke.py" check --export "$TMP/moved/policy" --pair "$TMP/built/pair")

say "passed in $((SECONDS - START)) s"
