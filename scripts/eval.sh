#!/usr/bin/env bash
# Evaluate a checkpoint on its validation split (or --val_list FILE): CHECKPOINT, or else the newest
# best.pth under CHECKPOINTS_DIR (what the last training made, whatever its task, model and data).
# Edit the settings below, or override one from the environment; extra arguments go to eval.py as they are.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
CHECKPOINTS_DIR=${CHECKPOINTS_DIR:-checkpoints}
NEWEST=$(ls -t "$CHECKPOINTS_DIR"/*/best.pth 2>/dev/null | head -n 1 || true)
CHECKPOINT=${CHECKPOINT:-${NEWEST:-$CHECKPOINTS_DIR/small_cnn_shapes_default/best.pth}}
SAVE_PREFIX=${SAVE_PREFIX:-default}
VIZ_FREQ=${VIZ_FREQ:-5}

"$PYTHON" eval.py --load_model_path "$CHECKPOINT" --save_prefix "$SAVE_PREFIX" --viz_freq "$VIZ_FREQ" "$@"
