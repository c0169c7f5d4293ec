#!/bin/bash
# A checkpointing training job: submit with `sbatch examples/sbatch_train.sh`.
#
# What each line buys you:
#   --requeue          the job may be requeued: by SLURM after a preemption
#                      (PreemptMode=REQUEUE), by ckpt-srun at the time limit.
#   --open-mode=append one log across restarts instead of the last run's only.
#   --signal=B:USR1@300
#                      SLURM's own time-limit warning, 5 minutes ahead, to the batch
#                      shell - which is ckpt-srun thanks to `exec` below; ckpt-srun relays
#                      it to every training process. Optional: ckpt-srun also sends it
#                      itself --warn seconds before the end time it asks the controller.
#
# The training program reads SLURM_CKPT_CONFIG / SLURM_CKPT_KEY (exported by
# ckpt-srun), saves a checkpoint when SLURM_CKPT_SIGNAL (USR1) arrives and exits, and
# resumes from the newest verified checkpoint when it starts (examples/train_tiny.py
# does all of that). The SLURM prolog/epilog of the site (ckpt-slurm install-hooks)
# prepare the node-local tier and flush whatever is left after the job.
#
#SBATCH --job-name=train-tiny
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
#SBATCH --time=01:00:00
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@300
#SBATCH --output=%x-%j.out

set -euo pipefail
VENV=${SLURM_CKPT_VENV:-/opt/slurm-ckpt/venv}
# sbatch runs a copy of this script from its spool directory, so "$0" says nothing about
# where the repository is: submit from the repository root, or set TRAIN.
TRAIN=${TRAIN:-$SLURM_SUBMIT_DIR/examples/train_tiny.py}
echo "job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0} on $(hostname)"

# exec: ckpt-srun becomes the batch shell, so SLURM's B:USR1 reaches it (a plain bash
# batch shell would die of it); ckpt-srun's own options first, then srun's, then the
# training command.
exec "$VENV/bin/ckpt-srun" --key "${SLURM_JOB_NAME}" --warn 300 -- \
    --ntasks-per-node=1 \
    "$VENV/bin/python" "$TRAIN" --steps 20000 --interval-steps 500
