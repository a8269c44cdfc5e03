#!/usr/bin/env bash
# Train the segmentation example (--task segment): seg_net on the generated shapes' masks.
# Edit the settings below, or override one from the environment; extra arguments go to train.py.
# Evaluate the result with scripts/eval.sh (the task is read from the checkpoint).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
MODEL_TYPE=${MODEL_TYPE:-seg_net}
DATA_TYPE=${DATA_TYPE:-shapes_seg}
SAVE_PREFIX=${SAVE_PREFIX:-default}
EPOCHS=${EPOCHS:-8}
BATCH_SIZE=${BATCH_SIZE:-64}
LR=${LR:-3e-3}

"$PYTHON" train.py --task segment --model_type "$MODEL_TYPE" --data_type "$DATA_TYPE" --save_prefix "$SAVE_PREFIX" \
    --epochs "$EPOCHS" --batch_size "$BATCH_SIZE" --lr "$LR" "$@"
