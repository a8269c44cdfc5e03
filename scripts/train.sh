#!/usr/bin/env bash
# Train a model. Edit the settings below, or override one from the environment
# (SAVE_PREFIX=try2 bash scripts/train.sh); extra arguments go to train.py as they are.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
MODEL_TYPE=${MODEL_TYPE:-small_cnn}
DATA_TYPE=${DATA_TYPE:-shapes}
SAVE_PREFIX=${SAVE_PREFIX:-default}
EPOCHS=${EPOCHS:-12}
BATCH_SIZE=${BATCH_SIZE:-128}
LR=${LR:-3e-3}

"$PYTHON" train.py --model_type "$MODEL_TYPE" --data_type "$DATA_TYPE" --save_prefix "$SAVE_PREFIX" \
    --epochs "$EPOCHS" --batch_size "$BATCH_SIZE" --lr "$LR" "$@"
