"""slurm_ckpt: fast, verified, tiered checkpoints for long training jobs on SLURM clusters.

Layers, each importing only those below it (README: "Layout of the code"):
``errors`` -> ``core`` -> ``tiers`` -> ``ledger`` -> ``admission`` -> ``slurm`` -> ``node`` ->
``job`` -> ``hooks``/``ops`` -> ``cli``.

``from slurm_ckpt import Checkpointer`` is resolved lazily (PEP 562), so that
``import slurm_ckpt`` - done by the CLI and the SLURM hooks - does not pull in numpy and
the job layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List

__version__ = "0.1.0"

if TYPE_CHECKING:  # pragma: no cover
    from slurm_ckpt.job.checkpointer import Checkpointer

_LAZY = {"Checkpointer": "slurm_ckpt.job.checkpointer"}

__all__ = ["Checkpointer", "__version__"]


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
