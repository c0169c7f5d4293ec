"""slurm layer: talking to SLURM (queries, drain/resume, requeue, signals), host lists,
and the validated hook/job environment. Imports only core and errors, so hooks and the
job wrapper can use it without the job library.

The names below are resolved on first use (PEP 562): importing one submodule (say
``slurm_ckpt.slurm.records`` for a constant) does not import the client and its
``subprocess``/``socket`` machinery, which a command that never asks SLURM does not need.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, List

if TYPE_CHECKING:  # pragma: no cover
    from slurm_ckpt.slurm.client import SlurmClient, get_client
    from slurm_ckpt.slurm.env import HookEnv, JobEnv, hook_env, job_env
    from slurm_ckpt.slurm.hostlist import compress, expand
    from slurm_ckpt.slurm.records import REASON_PREFIX, JobInfo, JobNotFound, NodeInfo

_LAZY = {
    "SlurmClient": "slurm_ckpt.slurm.client",
    "get_client": "slurm_ckpt.slurm.client",
    "HookEnv": "slurm_ckpt.slurm.env",
    "JobEnv": "slurm_ckpt.slurm.env",
    "hook_env": "slurm_ckpt.slurm.env",
    "job_env": "slurm_ckpt.slurm.env",
    "compress": "slurm_ckpt.slurm.hostlist",
    "expand": "slurm_ckpt.slurm.hostlist",
    "REASON_PREFIX": "slurm_ckpt.slurm.records",
    "JobInfo": "slurm_ckpt.slurm.records",
    "JobNotFound": "slurm_ckpt.slurm.records",
    "NodeInfo": "slurm_ckpt.slurm.records",
}

__all__ = [
    "REASON_PREFIX",
    "HookEnv",
    "JobEnv",
    "JobInfo",
    "JobNotFound",
    "NodeInfo",
    "SlurmClient",
    "compress",
    "expand",
    "get_client",
    "hook_env",
    "job_env",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'slurm_ckpt.slurm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_LAZY))
