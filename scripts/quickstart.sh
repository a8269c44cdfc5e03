#!/usr/bin/env bash
# The main job: train the default model on the generated shapes dataset, then evaluate its
# best checkpoint. Each call makes a new experiment folder, so it can be run again safely.
# Extra arguments go to train.py (bash scripts/quickstart.sh --model_type linear --epochs 2).
set -euo pipefail
# the project's folder (through a link to this script too); relative paths you give are the working folder's
ROOT=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.." && pwd)

CHECKPOINTS_DIR=${CHECKPOINTS_DIR:-$ROOT/checkpoints}  # where the run goes (as scripts/eval.sh reads it)
for word in "$@"; do
    if [[ $word == --checkpoints_dir* ]]; then  # the run would go there, and its evaluation look here
        echo "error: quickstart.sh takes CHECKPOINTS_DIR=DIR before the command, not --checkpoints_dir DIR" >&2
        exit 2
    elif [[ $word == --save_prefix* || $word == --fast_dev_run* ]]; then  # its run is not where it looks
        echo "error: quickstart.sh names its run itself (<model>_<data>_quickstart_<time>); drop $word, or use" \
            "scripts/train.sh and scripts/eval.sh" >&2
        exit 2
    fi
done
RUN=quickstart_$(date +%Y%m%d_%H%M%S)
SAVE_PREFIX=$RUN bash "$ROOT/scripts/train.sh" --checkpoints_dir "$CHECKPOINTS_DIR" "$@"
# the run's folder is <checkpoints_dir>/<model>_<data>_<RUN>: whichever model and data the arguments chose
CHECKPOINTS=("$CHECKPOINTS_DIR"/*_"$RUN"/best.pth)
if [ ! -f "${CHECKPOINTS[0]}" ]; then
    echo "error: no $CHECKPOINTS_DIR/*_$RUN/best.pth to evaluate" >&2
    exit 2
fi
# its results in <run>/eval/best_val_quickstart: `bash scripts/eval.sh` then writes its own beside them
CHECKPOINT=${CHECKPOINTS[0]} SAVE_PREFIX=quickstart bash "$ROOT/scripts/eval.sh"
