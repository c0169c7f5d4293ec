"""job layer: the in-job library (snapshot, background write and flush, signals, restore).

Training code uses :class:`Checkpointer` (also importable as ``slurm_ckpt.Checkpointer``).
"""

from __future__ import annotations

from slurm_ckpt.job.checkpointer import (
    Checkpointer,
    CheckpointFailed,
    CheckpointStats,
    SaveRecord,
)
from slurm_ckpt.job.restore import Restored

__all__ = ["CheckpointFailed", "CheckpointStats", "Checkpointer", "Restored", "SaveRecord"]
