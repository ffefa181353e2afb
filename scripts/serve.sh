#!/usr/bin/env bash
# Set up (if needed) and start tritonserver on model_repository (default model: SmolLM2-135M).
# Options go to `hsserve serve`: --http-port 8000 --grpc-port 8001 --metrics-port 8002
# --model-repository DIR --triton-arg=--log-verbose=1, --openai (the OpenAI API on :9000,
# --openai-port). Ctrl-C stops it cleanly.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m hsserve.cli serve "$@"
