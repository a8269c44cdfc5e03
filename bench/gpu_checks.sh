#!/usr/bin/env bash
# What only a machine with an NVIDIA GPU can check, in three stages (on one H100 with 16 cores the suite
# took 3.5 minutes; the others, with the defaults below, may take more than 10):
# `bash bench/gpu_checks.sh suite|correctness|speed [LOG_FOLDER]`. Every command's output
# goes to LOG_FOLDER/<stage>.log (default checkpoints/gpu_checks); a summary of the figures is printed.
# TORTURE_TRIALS (default 6; 0 skips) and COMPILE_LIMIT (seconds per compiled run, default 240) shorten a stage.
#   suite        the README's test suite on 8 workers
#   correctness  SIGKILL-and-resume on CUDA (bitwise), --amp bf16/fp16 against fp32 on the default job,
#                every --compile_mode, eval.py and predict.py from a GPU checkpoint on the GPU and on
#                the CPU, and torchrun asking for more processes than GPUs (one line)
#   speed        bench_overhead.py on CUDA (linear, small_cnn), the default job with and without
#                --compile_mode reduce-overhead (alternating rounds), JPEG decoding on the CPU against
#                nvJPEG (bench_decode.py) and photos trained from disk, and a --profile trace
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:?say which stage: suite, correctness or speed}
logs=${2:-checkpoints/gpu_checks}
mkdir -p "$logs"
log="$logs/$stage.log"
scratch=$(mktemp -d)
export PYTHONUNBUFFERED=1

say() { echo "== $*" | tee -a "$log"; }
run() { say "$*"; "$@" >>"$log" 2>&1; local code=$?; say "exit $code"; return $code; }
# the last command's printed speeds (each line's: since the line before, the first with the warm-up): their median
speeds() {
    tac "$log" | awk '/^== exit/ {next} /^== / {exit} / img\/s$/ {print $(NF-1)}' | sort -n |
        awk '{v[NR] = $1} END {if (NR) printf "median %s img/s over %d printed lines", v[int((NR + 1) / 2)], NR}'
}
best() { grep -o 'best val/[a-z0-9]* [0-9.]*' "$log" | tail -1; }

python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())' | tee "$log"
# a GPU image may lack some of Kiln's requirements (pip install -r requirements-dev.txt): tests fail on them
python3 - <<'PY' | tee -a "$log"
import importlib.util
wanted = ('simplejpeg', 'google_crc32c', 'pycocotools', 'torchmetrics', 'safetensors', 'xdist', 'yaml', 'tqdm', 'skimage')
missing = [name for name in wanted if importlib.util.find_spec(name) is None]
print('missing packages: ' + (' '.join(missing) if missing else 'none'))
PY
case $stage in
suite)
    run python3 -m pytest tests -n 8 -q -p no:cacheprovider
    tail -3 "$log"
    ;;
correctness)
    trials=${TORTURE_TRIALS:-6}  # 0: skip the SIGKILL trials
    [ "$trials" -gt 0 ] && run python3 bench/torture.py --device cuda --trials "$trials" --seed 1 && grep '^torture' "$log"
    for amp in off bf16 fp16; do
        run python3 train.py --amp "$amp" --no-progress_bar --checkpoints_dir "$scratch" --save_prefix "amp_$amp"
        echo "amp $amp: $(best), $(speeds)"
    done
    checkpoint="$scratch/small_cnn_shapes_amp_off/best.pth"
    for where in gpu cpu; do
        device=$([ "$where" = cpu ] && echo --cpu || true)
        run python3 eval.py --load_model_path "$checkpoint" --no-progress_bar --save_prefix "$where" $device
        run python3 predict.py --load_model_path "$checkpoint" --input data/generated/shapes/images/val \
            --no-progress_bar --save_prefix "$where" $device
    done
    say 'torchrun, 2 processes on 1 GPU: expect one line and a non-zero exit'
    python3 -m utils.torchrun --standalone --nproc-per-node=2 train.py --max_iteration 2 \
        --checkpoints_dir "$scratch" --save_prefix too_many 2>&1 | tail -3 | tee -a "$log"
    for mode in default reduce-overhead max-autotune; do
        run timeout "${COMPILE_LIMIT:-240}" python3 train.py --compile --compile_mode "$mode" --epochs 2 --no-progress_bar \
            --checkpoints_dir "$scratch" --save_prefix "compile_$mode"
        echo "compile $mode: $(best), $(speeds)"
        run python3 eval.py --load_model_path "$scratch/small_cnn_shapes_compile_$mode/best.pth" --no-progress_bar
    done
    grep -c '^== exit 0' "$log" | xargs echo 'commands that exited 0:'
    grep '^== exit [1-9]' "$log" || true
    ;;
speed)
    run python3 bench/bench_overhead.py --device cuda --model_type linear --repeats 9
    run python3 bench/bench_overhead.py --device cuda --repeats 5
    for round in 1 2 3; do
        for mode in default reduce-overhead; do
            compile=$([ "$mode" = default ] && echo '' || echo "--compile --compile_mode $mode")
            run python3 train.py $compile --no-progress_bar --checkpoints_dir "$scratch" --save_prefix "job_${mode}_$round"
            echo "default job ($mode) round $round: $(best), $(speeds), $(grep -o 'done after [0-9]*s' "$log" | tail -1)"
        done
    done
    # photos from disk: decoding on the CPU (DataLoader workers, the default) against nvJPEG on the GPU
    run python3 bench/bench_decode.py --device cuda --rounds 3
    run python3 -m data.photo_set "$scratch/photos" --per_class 400 --sizes 400 600
    run python3 train.py --data_type photos --train_list "$scratch/photos/train" --val_list "$scratch/photos/val" \
        --model_type linear --img_size 224 --epochs 3 --print_freq 5 --no-progress_bar --checkpoints_dir "$scratch"
    echo "photos from disk, linear model: $(speeds)"
    run python3 train.py --profile --max_iteration 20 --no-progress_bar --checkpoints_dir "$logs" --save_prefix profile
    grep -E '^(training|per epoch|checkpoint|time to first|evaluation):|^  decode_jpeg on|^  Kiln \(' "$log"
    ;;
*)
    echo "unknown stage $stage: suite, correctness or speed" >&2
    exit 2
    ;;
esac
rm -rf "$scratch"
