#!/usr/bin/env bash
# Train the segmentation example (--task segment: seg_net on the generated shapes' masks) through
# scripts/train.sh with these settings; override one from the environment, extra arguments go to
# train.py. Evaluate it with scripts/eval.sh (the task is read from the checkpoint).
set -euo pipefail
# the project's folder (through a link to this script too); relative paths you give are the working folder's
ROOT=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.." && pwd)

export TASK=segment
RESUMING=0
for word in "$@"; do
    if [[ $word == --resume* ]]; then RESUMING=1; fi
done
if [ "$RESUMING" = 0 ]; then  # a resumed run keeps its own (these would shorten a longer one)
    export EPOCHS=${EPOCHS:-8}
    export BATCH_SIZE=${BATCH_SIZE:-64}
fi

bash "$ROOT/scripts/train.sh" "$@"
