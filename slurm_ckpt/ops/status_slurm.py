"""The SLURM side of ``ckpt-slurm status``: one look at every job and node, or why not.

:func:`query_slurm` asks SLURM once for all jobs (``squeue --json``) and once for all
nodes (``sinfo --json``), never once per job; anything missing gives a snapshot that says
why, never an exception. Where SLURM is not installed at all (:func:`slurm_absent`: no
``squeue`` or ``sinfo`` on the PATH, a laptop) it is not asked, and the note
(:data:`SLURM_ABSENT`) is not an error. :mod:`slurm_ckpt.ops.status` joins the snapshot
with the catalogs and node statuses.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

from slurm_ckpt.errors import CkptError
from slurm_ckpt.slurm.records import REASON_PREFIX

__all__ = [
    "SLURM_ABSENT",
    "SlurmJob",
    "SlurmNode",
    "SlurmQuery",
    "SlurmSnapshot",
    "no_slurm",
    "query_slurm",
    "slurm_absent",
]

#: The SLURM note of a machine without SLURM (a laptop): not an error, not printed.
SLURM_ABSENT = "not installed on this machine"
#: The note of a machine whose SLURM commands are installed but belong to no cluster (no
#: slurm.conf, no configless source): a workstation with the client package. Like
#: :data:`SLURM_ABSENT`, nothing to report as an error.
SLURM_UNCONFIGURED = "not configured on this machine"
#: What SLURM's commands print when they have no configuration at all.
_NO_CONFIG_SOURCE = "Could not establish a configuration source"


@dataclass(frozen=True)
class SlurmJob:
    """The little status needs to know about a job."""

    job_id: str
    state: str
    user: Optional[str] = None
    nodes: Tuple[str, ...] = ()


@dataclass(frozen=True)
class SlurmNode:
    """The little status needs to know about a node."""

    name: str
    state: str
    drained: bool = False
    reason: Optional[str] = None

    @property
    def drained_by_us(self) -> bool:
        return self.drained and (self.reason or "").startswith(REASON_PREFIX)


@dataclass
class SlurmSnapshot:
    """One look at SLURM: every job and node it knows, or ``available=False`` and why."""

    available: bool
    note: str = ""
    jobs: Dict[str, SlurmJob] = field(default_factory=dict)
    nodes: Dict[str, SlurmNode] = field(default_factory=dict)


#: The injectable query: no arguments, returns a snapshot, never raises.
SlurmQuery = Callable[[], SlurmSnapshot]


def no_slurm(note: str = "SLURM not queried") -> SlurmSnapshot:
    """A snapshot that says SLURM could not be asked (states show as ``unknown``)."""
    return SlurmSnapshot(False, note)


def slurm_absent(env: Optional[Dict[str, str]] = None) -> bool:
    """True when neither ``squeue`` nor ``sinfo`` is on the PATH: a laptop or a machine
    outside any cluster, where asking SLURM can only fail."""
    path = (env if env is not None else os.environ).get("PATH", os.defpath)
    return shutil.which("squeue", path=path) is None and shutil.which("sinfo", path=path) is None


def query_slurm(timeout: float = 10.0, env: Optional[Dict[str, str]] = None) -> SlurmSnapshot:
    """Ask SLURM through :mod:`slurm_ckpt.slurm` (``squeue --json``, ``sinfo --json``).

    Anything missing (the client module, the commands, the controller) gives a snapshot
    with ``available=False`` and the one-line reason, never an exception: status is most
    needed exactly when something is broken. ``env`` is the environment for SLURM's
    commands (default: this process's, e.g. ``SLURM_CONF``).
    """
    if slurm_absent(env):
        return no_slurm(SLURM_ABSENT)
    # Imported here: a status that never asks SLURM (--no-slurm, a laptop) skips the
    # client's subprocess and socket machinery.
    from slurm_ckpt.slurm.client import SlurmClient

    try:
        client = SlurmClient(backend="cli", timeout=timeout, env=env)
        jobs = client.jobs()
        nodes = client.nodes()
    except CkptError as exc:
        if _NO_CONFIG_SOURCE in str(exc):
            return no_slurm(SLURM_UNCONFIGURED)
        return no_slurm(str(exc))
    snap = SlurmSnapshot(True, f"{len(jobs)} jobs, {len(nodes)} nodes")
    for j in jobs:
        snap.jobs[str(j.job_id)] = SlurmJob(str(j.job_id), j.state, j.user, tuple(j.nodes))
    for n in nodes:  # sinfo lists a node once per partition: keep one
        snap.nodes.setdefault(n.name, SlurmNode(n.name, n.state_string, n.drained, n.reason))
    return snap
