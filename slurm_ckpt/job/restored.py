"""What a restore returns, and the names a restore is asked and answered in.

Apart from :mod:`slurm_ckpt.job.restore` (which finds and loads a step) because these
are shared vocabulary, not search: the result (:class:`Restored`), the refusals
(:class:`DataVersionMismatch`, :class:`NotThisFormat`), a rank's series and payload
directory (:func:`shard_key`, :func:`shard_prefix`: the writer names them the same
way), a payload's format and the tier names ``restore(tiers=...)`` accepts. The shared
read of a replica group, the output directories and the tools read them too, without
needing the Restorer.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from slurm_ckpt.core.config_schema import PFS
from slurm_ckpt.core.manifest import Manifest
from slurm_ckpt.errors import CkptError
from slurm_ckpt.job.state import INDEX_NAME, STATE_FORMAT

__all__ = [
    "DATA_CHANGE_ACTIONS",
    "WARM",
    "DataVersionMismatch",
    "NotThisFormat",
    "Restored",
    "check_tier_names",
    "payload_format",
    "shard_key",
    "shard_prefix",
]

#: What ``restore(expect_data_version=...)`` does when the data changed since the save.
DATA_CHANGE_ACTIONS = ("warn", "refuse")


class DataVersionMismatch(CkptError):
    """The checkpoint was trained on other data than the job has now, and the caller
    asked to refuse such a restore."""


class NotThisFormat(CkptError):
    """A committed checkpoint that is sound but holds another payload than the one asked
    for (a directory of files from :meth:`Checkpointer.output`, a ``torch.save`` file, a
    DCP checkpoint, where ``restore()`` wants a ``save()`` state): skipped, never marked
    bad, never removed."""


def payload_format(m: Manifest, prefix: str) -> Optional[str]:
    """What a checkpoint holds: ``meta.state_format``, or for a manifest without one (a
    writer that recorded none) the state format when the rank's index is there, else
    None (files of an unknown kind)."""
    fmt = m.meta.get("state_format")
    if isinstance(fmt, str):
        return fmt
    index = f"{prefix}/{INDEX_NAME}" if prefix else INDEX_NAME
    return STATE_FORMAT if any(f.path == index for f in m.files) else None


def shard_key(key: str, rank: int, world_size: int) -> str:
    """The checkpoint series (key) of one rank: ``key`` alone, or ``key.rankNNNNN``."""
    return key if world_size == 1 else f"{key}.rank{rank:05d}"


def shard_prefix(rank: int) -> str:
    """The directory of a rank's payload inside its step directory."""
    return f"rank-{rank:05d}"


#: ``restore(tiers=[...])``'s name for the configured warm tier, whichever it is.
WARM = "warm"


def check_tier_names(
    tiers: Sequence[str], have: Sequence[str], warm: Optional[str] = None
) -> List[str]:
    """``restore(tiers=[...])``: a name that is no tier of this Checkpointer raises (a typo
    such as ``"nvme"`` must not read as "no checkpoint" and a fresh start).

    ``"warm"`` names the warm tier (``warm``: its name, ``"pfs"`` or ``"object"``). The
    old name ``"pfs"`` on a site without a PFS is a deprecated alias of ``"warm"`` (one
    release); on a site with one it is the PFS tier itself."""
    names = [tiers] if isinstance(tiers, str) else list(tiers)
    if warm not in have:  # laptop mode: no warm tier
        warm = None
    for i, name in enumerate(names):
        if name == PFS and name not in have and warm is not None:
            warnings.warn(
                'restore(tiers=["pfs"]) on a site without a PFS: say "warm"',
                DeprecationWarning,
                stacklevel=3,
            )
            name = WARM
        if name == WARM and warm is not None:
            names[i] = name = warm
        if name not in have:
            raise CkptError(
                f"restore(): no tier {name!r} here (this Checkpointer has: {', '.join(have)})"
            )
    return names


@dataclass
class Restored:
    """What :meth:`Checkpointer.restore` returns."""

    step: int
    tokens: Optional[int]
    state: Any
    #: The tier read (``local``, ``pfs``, ``s3``, ``cold``), or ``partner``: read straight
    #: from the rank holding this rank's partner copy (a rank relaunched on a spare node,
    #: :mod:`slurm_ckpt.job.partner_tier`); ``ram``: this process's own RAM snapshot,
    #: ``partner-ram``: the RAM copy another rank holds (:mod:`slurm_ckpt.job.ram_tier`).
    tier: str
    key: str = ""
    rank: int = 0
    world_size: int = 1
    meta: Dict[str, Any] = field(default_factory=dict)
    #: The data version recorded at save time (``save(data_version=...)``), or None.
    data_version: Optional[str] = None
    nbytes: int = 0
    seconds: float = 0.0
    #: True when only the weights were loaded (``restore(weights_only=True)``).
    partial: bool = False
    #: Set by :meth:`Restorer.restore_rest` when the rest of the weights' step failed
    #: verification and an older step was restored whole instead: ``state`` then holds
    #: the weights too, and they must be applied again.
    rolled_back: bool = False
    #: The lineage of the step (``main`` unless the series was rolled back) and whether
    #: it is retired (only when asked for by ``restore(step=..., lineage=...)``).
    lineage: str = "main"
    retired: bool = False
    #: Payload bytes this rank read from storage (its stripe when the restore was shared
    #: by a replica group, ``restore(replicas=...)``), and verified bytes it received
    #: from the group's other ranks instead.
    read_bytes: int = 0
    peer_bytes: int = 0
