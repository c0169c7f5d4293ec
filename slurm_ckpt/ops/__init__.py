"""ops layer: the operator logic behind ``ckpt-slurm`` and ``ckpt-srun`` (status, list,
verify, gc, flush, drill, maint, install-hooks, the srun wrapper), with no click or rich:
the commands in :mod:`slurm_ckpt.cli` parse arguments and print what these return."""
