#!/usr/bin/env bash
# A SLURM job: one torchrun per node, all joining one rendezvous on the first node. Pre-emption
# sends SIGTERM two minutes ahead (torchrun passes it on to every process); Kiln saves and exits,
# and the requeued job continues the same
# experiment (--resume starts it when there is nothing to continue yet).
#   sbatch scripts/slurm_train.sh
#SBATCH --job-name=kiln
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=16
#SBATCH --signal=TERM@120
#SBATCH --requeue
#SBATCH --output=checkpoints/slurm-%j.out
set -euo pipefail

PYTHON=${PYTHON:-python3}
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun "$PYTHON" -m torch.distributed.run --nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node="$SLURM_GPUS_PER_NODE" \
    --rdzv-backend=c10d --rdzv-endpoint="$HEAD_NODE:29500" --rdzv-id="$SLURM_JOB_ID" \
    train.py --save_prefix "slurm_$SLURM_JOB_NAME" --resume "$@"
