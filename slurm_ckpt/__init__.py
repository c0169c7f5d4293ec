"""slurm_ckpt: fast, verified, tiered checkpoints for long training jobs on SLURM clusters.

Layers, each importing only those below it:
``core`` -> ``tiers`` -> ``ledger`` -> ``job`` -> ``slurm`` -> ``hooks``/``cli``.
"""

__version__ = "0.1.0"
