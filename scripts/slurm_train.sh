#!/usr/bin/env bash
# A SLURM job: one torchrun per node, all joining one rendezvous on the first node. Submit it from
# the repository root; its arguments go to train.py:
#   sbatch scripts/slurm_train.sh --model_type resnet18 --epochs 90
#   sbatch --nodes=1 --job-name=try2 scripts/slurm_train.sh --epochs 3
# The experiment is checkpoints/<model>_<data>_slurm_<job name>, and --resume continues it (or starts
# it), so a requeued job carries on from its last checkpoint. On CPU nodes drop the --gpus-per-node
# line: then each node runs one process (or NPROC), with gloo and --cpu.
#
# Settings, from the environment (sbatch passes the submitting shell's on):
#   NPROC         processes per node (default: SLURM_GPUS_PER_NODE, else 1)
#   MAX_RESTARTS  torchrun restarts after a process fails, each resuming from the last checkpoint (3;
#                 none after a mistake met before the first training step: an option, a missing file)
#   RDZV_PORT     rendezvous port on the first node (default 29500 + job id % 1000)
#   PYTHON        (python3)
#
# Stopping. 120 s before the time limit SLURM sends USR1 to this script (B:USR1@120): every
# process saves and the job requeues itself. To save and requeue now: scancel --batch --signal=USR1
# <job>; to save and end: scancel --signal=USR2 <job>. A plain scancel, and a pre-emption, end it
# without a save (it resumes from the last checkpoint): SLURM's TERM reaches srun too, which kills
# the processes at once; a pre-emption saves only on clusters that send the job's --signal first
# (slurm.conf's PreemptParameters=send_user_signal, with a GraceTime).
#SBATCH --job-name=kiln
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=16
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=checkpoints/slurm-%j.out
set -euo pipefail
: "${SLURM_JOB_ID:?submit this script with sbatch}"

PYTHON=${PYTHON:-python3}
GPUS=${SLURM_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-0}}
GPUS=${GPUS##*:}  # "4" or "a100:4"
NPROC=${NPROC:-$((GPUS > 0 ? GPUS : 1))}
DEVICE=()
[ "$GPUS" -gt 0 ] || DEVICE=(--cpu)
MAX_RESTARTS=${MAX_RESTARTS:-3}
RDZV_PORT=${RDZV_PORT:-$((29500 + SLURM_JOB_ID % 1000))}
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
[ -z "${SLURM_CPUS_PER_TASK:-}" ] || export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK  # srun no longer inherits it

# One node's share, run by srun. SLURM signals every process of a job step at once, so torchrun must
# not pass a TERM on (a second signal stops Kiln at once, unsaved): it ignores TERM and USR2
# (torch >= 2.9 reads PET_SIGNALS_TO_HANDLE; older torch passes TERM on). USR2 makes this shell send
# torchrun an INT, which it passes on once while shutting down, so it restarts nothing.
kiln_node() {
    trap '' TERM
    (trap '' USR2; PET_SIGNALS_TO_HANDLE=SIGINT,SIGHUP,SIGQUIT exec "$@") &
    KILN_TORCHRUN=$!
    trap 'kill -INT $KILN_TORCHRUN' USR2
    local status
    while :; do  # a trap ends the wait early: wait again while torchrun runs
        wait $KILN_TORCHRUN && status=0 || status=$?
        kill -0 $KILN_TORCHRUN 2>/dev/null || return $status
    done
}
export -f kiln_node

REQUEUE=0
save_and_requeue() {
    echo "slurm_train.sh: time limit near: saving, then requeueing job $SLURM_JOB_ID"
    REQUEUE=1
    scancel --signal=USR2 "$SLURM_JOB_ID"
}
trap save_and_requeue USR1

srun --kill-on-bad-exit=1 bash -c 'kiln_node "$@"' kiln_node \
    "$PYTHON" -m utils.torchrun --nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node="$NPROC" \
    --rdzv-backend=c10d --rdzv-endpoint="$HEAD_NODE:$RDZV_PORT" --rdzv-id="$SLURM_JOB_ID" \
    --max-restarts="$MAX_RESTARTS" \
    train.py --save_prefix "slurm_$SLURM_JOB_NAME" --resume "${DEVICE[@]}" "$@" &
SRUN=$!
while :; do  # as in kiln_node(): USR1 ends the wait early
    wait $SRUN && status=0 || status=$?
    kill -0 $SRUN 2>/dev/null || break
done
[ "$REQUEUE" = 0 ] || exec scontrol requeue "$SLURM_JOB_ID"
exit $status
