#!/usr/bin/env bash
# Creates .venv with a Python >= 3.12 and installs gdn_jax with its test and demo extras,
# pinned to the GPU machine's versions (constraints.txt). Idempotent.
set -euo pipefail
cd "$(dirname "$0")"
find_python() {
  # the GPU image runs Python 3.12: prefer it, so CI tests what the device runs
  for c in python3.12 python3.13 python3; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      command -v "$c"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    # 3.12.x first (the GPU image's), then the newest
    for v in $(ls "$(pyenv root)/versions" 2>/dev/null | grep -E '^3\.12\.' | sort -rV; ls "$(pyenv root)/versions" 2>/dev/null | sort -rV); do
      p="$(pyenv root)/versions/$v/bin/python3"
      if [ -x "$p" ] && "$p" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
        echo "$p"; return 0
      fi
    done
  fi
  return 1
}
if [ ! -x .venv/bin/python ]; then
  PY=$(find_python) || { echo "setup.sh: need Python >= 3.12 (jax >= 0.11 requires it)" >&2; exit 1; }
  echo "setup.sh: creating .venv with $PY"
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt -e ".[test,demo]"
echo "setup.sh: ready ($(.venv/bin/python -c 'import jax; print("jax", jax.__version__)'))"
