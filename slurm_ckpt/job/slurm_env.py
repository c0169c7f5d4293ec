"""What the in-job library needs from SLURM, read from the environment only.

The job layer must work inside ``srun`` without talking to ``slurmctld`` (a training step
should never block on the controller) and outside SLURM altogether. Everything here is a
pure function of ``os.environ``; the real SLURM client (state queries, KillWait, requeue
reasons) lives in :mod:`slurm_ckpt.slurm` and is plugged into the Checkpointer through
its injectable providers.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping, Optional, Tuple

from slurm_ckpt.errors import CkptError

__all__ = ["SlurmEnv", "job_end_time", "read_env", "resolve_rank", "sanitize_node"]

_NODE_BAD = re.compile(r"[^A-Za-z0-9_.-]+")


def _int(env: Mapping[str, str], name: str) -> Optional[int]:
    value = env.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        return None


def sanitize_node(name: str) -> str:
    """A host name as a safe file name (ledger, node status): short, no odd characters.

    ``gpu-node17.cluster.example`` -> ``gpu-node17``; anything unusable -> ``"localhost"``.
    """
    short = (name or "").strip().split(".", 1)[0]
    short = _NODE_BAD.sub("_", short).lstrip("._-")[:200]
    return short or "localhost"


@dataclass(frozen=True)
class SlurmEnv:
    """The SLURM variables of the current process (all None outside SLURM)."""

    job_id: Optional[str] = None
    node: Optional[str] = None
    procid: Optional[int] = None
    ntasks: Optional[int] = None
    end_time: Optional[float] = None
    restart_count: int = 0

    @property
    def in_slurm(self) -> bool:
        return self.job_id is not None


def read_env(environ: Optional[Mapping[str, str]] = None) -> SlurmEnv:
    """Read the SLURM environment of this process.

    ``ntasks`` prefers ``SLURM_STEP_NUM_TASKS`` (set by ``srun`` for the step the process
    runs in) over ``SLURM_NTASKS`` (the allocation's task count, also visible in a batch
    script that runs a single Python process): the number of checkpoint shards must be
    the number of processes that actually write one.
    """
    env = os.environ if environ is None else environ
    job = env.get("SLURM_JOB_ID", "").strip() or env.get("SLURM_JOBID", "").strip() or None
    node = env.get("SLURMD_NODENAME", "").strip() or None
    ntasks = _int(env, "SLURM_STEP_NUM_TASKS")
    if ntasks is None:
        ntasks = _int(env, "SLURM_NTASKS")
    return SlurmEnv(
        job_id=job,
        node=sanitize_node(node) if node else None,
        procid=_int(env, "SLURM_PROCID"),
        ntasks=ntasks,
        end_time=job_end_time(env),
        restart_count=_int(env, "SLURM_RESTART_COUNT") or 0,
    )


def job_end_time(environ: Optional[Mapping[str, str]] = None) -> Optional[float]:
    """``SLURM_JOB_END_TIME`` (epoch seconds) if set and sane, else None.

    The default deadline provider: it is exported by SLURM >= 21.08 in the job
    environment. It is not updated when an admin extends the time limit; the SLURM client
    provider (later) asks the controller instead.
    """
    env = os.environ if environ is None else environ
    value = env.get("SLURM_JOB_END_TIME", "").strip()
    if not value:
        return None
    try:
        t = float(value)
    except ValueError:
        return None
    return t if t > 0 else None


def resolve_rank(
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> Tuple[int, int]:
    """``(rank, world_size)``: explicit arguments, else ``RANK``/``WORLD_SIZE`` (torchrun),
    else ``SLURM_PROCID`` and the step's task count, else ``(0, 1)``."""
    env = os.environ if environ is None else environ
    if world_size is None:
        world_size = _int(env, "WORLD_SIZE")
        if world_size is not None and rank is None:
            rank = _int(env, "RANK")
    if world_size is None:
        senv = read_env(env)
        if senv.ntasks is not None and senv.procid is not None:
            world_size = senv.ntasks
            if rank is None:
                rank = senv.procid
    if world_size is None:
        world_size = 1
    if rank is None:
        rank = 0
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise CkptError(f"world_size must be a whole number >= 1, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise CkptError(f"rank must be a whole number in 0..{world_size - 1}, got {rank!r}")
    return rank, world_size
