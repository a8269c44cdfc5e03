#!/usr/bin/env bash
# Train a model. Edit the settings below, or override one from the environment
# (SAVE_PREFIX=try2 bash scripts/train.sh); extra arguments go to train.py as they are.
set -euo pipefail
# the project's folder (through a link to this script too); relative paths you give are the working folder's
ROOT=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.." && pwd)

PYTHON=${PYTHON:-python3}
TASK=${TASK:-classify}        # a --task name: tasks/task_entry.py
MODEL_TYPE=${MODEL_TYPE:-}    # empty: the task's own model (model/model_entry.py)
DATA_TYPE=${DATA_TYPE:-}      # empty: the task's own dataset (data/data_entry.py)
SAVE_PREFIX=${SAVE_PREFIX:-default}
EPOCHS=${EPOCHS:-12}
BATCH_SIZE=${BATCH_SIZE:-128}
LR=${LR:-3e-3}

"$PYTHON" "$ROOT/train.py" --task "$TASK" ${MODEL_TYPE:+--model_type "$MODEL_TYPE"} ${DATA_TYPE:+--data_type "$DATA_TYPE"} \
    --save_prefix "$SAVE_PREFIX" --epochs "$EPOCHS" --batch_size "$BATCH_SIZE" --lr "$LR" "$@"
