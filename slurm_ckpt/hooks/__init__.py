"""hooks layer: what root runs on compute nodes around jobs (SLURM prolog and epilog, the
per-node stager daemon) and the privilege dropping they all use for user data."""
