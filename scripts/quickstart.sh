#!/usr/bin/env bash
# The main job: train the default model on the generated shapes dataset, then evaluate its
# best checkpoint. Each call makes a new experiment folder, so it can be run again safely.
set -euo pipefail
cd "$(dirname "$0")/.."

RUN=quickstart_$(date +%Y%m%d_%H%M%S)
SAVE_PREFIX=$RUN bash scripts/train.sh "$@"
CHECKPOINT=checkpoints/small_cnn_shapes_$RUN/best.pth bash scripts/eval.sh
