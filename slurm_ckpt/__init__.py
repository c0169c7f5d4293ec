"""slurm_ckpt: fast, verified, tiered checkpoints for long training jobs on SLURM clusters.

Layers, each importing only those below it (README: "Layout of the code"):
``errors`` -> ``core`` -> ``tiers`` -> ``ledger`` -> ``admission`` -> ``slurm`` -> ``node`` ->
``job`` -> ``hooks``/``ops`` -> ``cli``.

``from slurm_ckpt import Checkpointer`` is resolved lazily (PEP 562), so that
``import slurm_ckpt`` - done by the CLI and the SLURM hooks - does not pull in numpy and
the job layer. The exceptions a user may catch are all importable from here: the ones of
:mod:`slurm_ckpt.errors` at once, the job layer's (``CheckpointFailed``,
``DataVersionMismatch``, ``SuspectStep``) and the torch codec's (``UnsupportedState``) lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Tuple

__version__ = "0.1.0"

# The errors a training job may catch, all from one place (the base class catches all).
from slurm_ckpt.errors import (  # noqa: E402 - after __version__ on purpose
    CkptError,
    ConfigError,
    InvalidName,
    NotFound,
    TierError,
    UnsupportedState,
    VerifyError,
)

if TYPE_CHECKING:  # pragma: no cover
    from slurm_ckpt.job.checkpointer import Checkpointer
    from slurm_ckpt.job.options import RamOptions
    from slurm_ckpt.job.pipeline import CheckpointFailed
    from slurm_ckpt.job.replicas import SuspectStep
    from slurm_ckpt.job.restore import DataVersionMismatch, Restored
    from slurm_ckpt.job.saved import Saved

_LAZY = {
    "Checkpointer": "slurm_ckpt.job.checkpointer",
    "Saved": "slurm_ckpt.job.saved",
    # Checkpointer(ram=RamOptions(...)): the RAM tier (docs/in-job-recovery.md)
    "RamOptions": "slurm_ckpt.job.options",
    "Restored": "slurm_ckpt.job.restore",
    # raised by save() after too many failures in a row
    "CheckpointFailed": "slurm_ckpt.job.pipeline",
    # raised by restore(expect_data_version=..., on_data_change="refuse")
    "DataVersionMismatch": "slurm_ckpt.job.restore",
    # raised on the training thread when replicas disagree (on_suspect="raise")
    "SuspectStep": "slurm_ckpt.job.replicas",
}

__all__ = [
    "CheckpointFailed",
    "Checkpointer",
    "CkptError",
    "ConfigError",
    "DataVersionMismatch",
    "InvalidName",
    "NotFound",
    "RamOptions",
    "Restored",
    "Saved",
    "SuspectStep",
    "TierError",
    "UnsupportedState",
    "VerifyError",
    "__version__",
    "rank_and_world_size",
]


def rank_and_world_size() -> Tuple[int, int]:
    """This process's ``(rank, world_size)`` by the rule every Checkpointer uses
    (``RANK``/``WORLD_SIZE`` as torchrun sets them, else ``SLURM_PROCID`` and the srun
    step's task count, else ``(0, 1)``), so a job's process group and its checkpoint
    shards always agree."""
    from slurm_ckpt.slurm.env import resolve_rank

    return resolve_rank()


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'slurm_ckpt' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_LAZY))
