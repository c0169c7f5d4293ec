"""Who writes a save, and what its manifest records about the writer.

Apart from :mod:`slurm_ckpt.job.pipeline` because this is a fact about the writer, not
about the threads that write: the pipeline, the DCP series and a restore's checks all
read the same shard fields, and the manifest's writer fields (rank, world size, lineage,
generation, launch, the ``last_healthy`` pin) are decided here once, so a reader of a
manifest finds what a writer wrote in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

from slurm_ckpt.job.dist import run_launch

__all__ = ["Shard", "save_meta"]


@dataclass(frozen=True)
class Shard:
    """Who writes: one rank's series (``key`` is the shard key) and its manifest fields."""

    user: str
    key: str
    base_key: str
    prefix: str
    rank: int
    world_size: int
    job: Optional[str]
    node: str


def save_meta(
    shard: Shard,
    meta: Mapping[str, Any],
    *,
    reason: str,
    state_format: str,
    generation: int,
    lineage_meta: Mapping[str, Any],
    last_healthy: Optional[Tuple[int, float]],
) -> Dict[str, Any]:
    """The manifest meta of one save: the caller's ``meta`` plus the writer's fields.

    The launch is recorded only for a job of more than one rank: a restore of another
    rank asks which launch saved a step, a single process has nobody to ask."""
    out = dict(meta)
    out.update(
        rank=shard.rank,
        world_size=shard.world_size,
        base_key=shard.base_key,
        reason=reason,
        state_format=state_format,
        generation=generation,
        **lineage_meta,
    )
    launch = run_launch() if shard.world_size > 1 else None
    if launch is not None:
        out["launch"] = launch
    if last_healthy is not None:
        out["last_healthy"] = {"step": last_healthy[0], "at": last_healthy[1]}
    return out
