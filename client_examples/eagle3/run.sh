#!/bin/bash
# The loop: prompts -> hidden states (hsserve extract --eagle3) -> an EAGLE-3 head -> served
# and measured on held-out prompts. SmolLM2-135M on the CPU, a few minutes.
#   bash client_examples/eagle3/run.sh [WORK_DIR]   (default /tmp/eagle3)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
work=${1:-/tmp/eagle3}
model=${MODEL:-default}
py=${PYTHON:-python}
"$py" "$here/make_prompts.py" --out "$work" --train "${TRAIN:-256}" --heldout "${HELDOUT:-24}"
hsserve extract "$work/train.jsonl" --output "$work/shards" --eagle3 --local --model "$model" \
  --max-tokens 96 --mode full --concurrency 32
folder=$("$py" -c "from hsserve.engine.config import EngineConfig; from hsserve.engine.setup import model_folder; print(model_folder(EngineConfig(model='$model')))")
"$py" "$here/train.py" --shards "$work/shards" --model "$folder" --output "$work/head" \
  --epochs "${EPOCHS:-4}"
"$py" "$here/evaluate.py" --model "$folder" --head "$work/head" --prompts "$work/heldout.jsonl"
