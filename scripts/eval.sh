#!/usr/bin/env bash
# Evaluate a checkpoint on its validation split (or --val_list FILE): CHECKPOINT, or else the newest
# best.pth under CHECKPOINTS_DIR (what the last training made, whatever its task, model and data).
# Edit the settings below, or override one from the environment; extra arguments go to eval.py as they are.
set -euo pipefail
# the project's folder (through a link to this script too); relative paths you give are the working folder's
ROOT=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.." && pwd)

PYTHON=${PYTHON:-python3}
CHECKPOINTS_DIR=${CHECKPOINTS_DIR:-$ROOT/checkpoints}
NEWEST=$(ls -t "$CHECKPOINTS_DIR"/*/best.pth 2>/dev/null | head -n 1 || true)
CHECKPOINT=${CHECKPOINT:-$NEWEST}
SAVE_PREFIX=${SAVE_PREFIX:-default}
VIZ_FREQ=${VIZ_FREQ:-5}

LOAD=(--load_model_path "$CHECKPOINT")
if [ -z "$CHECKPOINT" ]; then
    for arg in "$@"; do  # the arguments name a checkpoint themselves, or ask for the help
        case $arg in --load_model_path* | -h | --help) LOAD=() ;; esac
    done
    if [ ${#LOAD[@]} -gt 0 ]; then  # eval.py would blame --load_model_path, which was never given
        echo "error: nothing trained in $CHECKPOINTS_DIR yet (no $CHECKPOINTS_DIR/*/best.pth); run bash scripts/train.sh first, or set CHECKPOINT=path/to/best.pth" >&2
        exit 2
    fi
fi

"$PYTHON" "$ROOT/eval.py" "${LOAD[@]}" --save_prefix "$SAVE_PREFIX" --viz_freq "$VIZ_FREQ" "$@"
