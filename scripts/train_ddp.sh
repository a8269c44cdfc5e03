#!/usr/bin/env bash
# Train with DistributedDataParallel, launched by PyTorch's torchrun. Each process takes one GPU
# (or CPU cores with the gloo backend) and BATCH_SIZE images per step: the global batch is
# BATCH_SIZE x processes. Extra arguments go to train.py as they are.
#
# One machine, all its GPUs:       bash scripts/train_ddp.sh
# One machine, 2 processes on CPU: NPROC=2 bash scripts/train_ddp.sh --cpu
# Several machines: run on each, with the same RDZV_ENDPOINT (host:port of the first machine):
#   NNODES=2 RDZV_ENDPOINT=node1:29500 bash scripts/train_ddp.sh
set -euo pipefail
# the project's folder (through a link to this script too); relative paths you give are the working folder's
ROOT=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.." && pwd)

PYTHON=${PYTHON:-python3}
NPROC=${NPROC:-$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() or 2)')}
NNODES=${NNODES:-1}
RDZV_ENDPOINT=${RDZV_ENDPOINT:-}
RDZV_ID=${RDZV_ID:-kiln}
TASK=${TASK:-}                # a --task name: tasks/task_entry.py (empty: classify; see train.sh)
MODEL_TYPE=${MODEL_TYPE:-}    # empty: the task's own model (model/model_entry.py)
DATA_TYPE=${DATA_TYPE:-}      # empty: the task's own dataset (data/data_entry.py)
# SAVE_PREFIX and BATCH_SIZE are passed unless set empty (SAVE_PREFIX= ...): they override a --config's
# and must match a resumed run's; the other settings, left empty, are not passed (see train.sh)
SAVE_PREFIX=${SAVE_PREFIX-ddp}
EPOCHS=${EPOCHS:-}            # empty: 12
BATCH_SIZE=${BATCH_SIZE-64}   # per process
LR=${LR:-}                    # empty: 3e-3

if [ "$NNODES" != 1 ] && [ -z "$RDZV_ENDPOINT" ]; then  # else each machine would wait for its own
    echo "error: NNODES=$NNODES needs RDZV_ENDPOINT=host:port of the first machine, the same on every machine" >&2
    exit 2
fi
if [ "$NNODES" = 1 ] && [ -z "$RDZV_ENDPOINT" ]; then
    LAUNCH=(--standalone --nproc-per-node="$NPROC")
else
    LAUNCH=(--nnodes="$NNODES" --nproc-per-node="$NPROC" --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT"
            --rdzv-id="$RDZV_ID")
fi
# utils.torchrun: a module of the project, found through PYTHONPATH from any working folder (-P: not in a
# `utils` package of the working folder's)
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -P -m utils.torchrun "${LAUNCH[@]}" "$ROOT/train.py" ${TASK:+--task "$TASK"} ${MODEL_TYPE:+--model_type "$MODEL_TYPE"} \
    ${DATA_TYPE:+--data_type "$DATA_TYPE"} ${SAVE_PREFIX:+--save_prefix "$SAVE_PREFIX"} \
    ${EPOCHS:+--epochs "$EPOCHS"} ${BATCH_SIZE:+--batch_size "$BATCH_SIZE"} ${LR:+--lr "$LR"} "$@"
