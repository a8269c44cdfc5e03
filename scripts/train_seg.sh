#!/usr/bin/env bash
# Train the segmentation example (--task segment: seg_net on the generated shapes' masks) through
# scripts/train.sh with these settings; override one from the environment, extra arguments go to
# train.py. Evaluate it with scripts/eval.sh (the task is read from the checkpoint).
set -euo pipefail
cd "$(dirname "$0")/.."

export TASK=segment
export EPOCHS=${EPOCHS:-8}
export BATCH_SIZE=${BATCH_SIZE:-64}

bash scripts/train.sh "$@"
