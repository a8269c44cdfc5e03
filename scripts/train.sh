#!/usr/bin/env bash
# Train a model. Edit the settings below, or override one from the environment
# (SAVE_PREFIX=try2 bash scripts/train.sh); extra arguments go to train.py as they are.
set -euo pipefail
# the project's folder (through a link to this script too); relative paths you give are the working folder's
ROOT=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.." && pwd)

# A setting left empty is not passed: train.py's default applies, or the --config's, or a resumed run's
# (a value here would override them all).
PYTHON=${PYTHON:-python3}
TASK=${TASK:-}                # a --task name: tasks/task_entry.py (empty: classify)
MODEL_TYPE=${MODEL_TYPE:-}    # empty: the task's own model (model/model_entry.py)
DATA_TYPE=${DATA_TYPE:-}      # empty: the task's own dataset (data/data_entry.py)
SAVE_PREFIX=${SAVE_PREFIX:-}  # names the experiment folder (empty: default)
EPOCHS=${EPOCHS:-}            # empty: 12
BATCH_SIZE=${BATCH_SIZE:-}    # empty: 128
LR=${LR:-}                    # empty: 3e-3

"$PYTHON" "$ROOT/train.py" ${TASK:+--task "$TASK"} ${MODEL_TYPE:+--model_type "$MODEL_TYPE"} \
    ${DATA_TYPE:+--data_type "$DATA_TYPE"} ${SAVE_PREFIX:+--save_prefix "$SAVE_PREFIX"} ${EPOCHS:+--epochs "$EPOCHS"} \
    ${BATCH_SIZE:+--batch_size "$BATCH_SIZE"} ${LR:+--lr "$LR"} "$@"
