"""Local retention of one writer: which of its local checkpoints to delete now.

Apart from :mod:`slurm_ckpt.job.pipeline` because it is a decision over the series as the
tier and the ledger show it (the policy of :mod:`slurm_ckpt.core.retention` applied to
what is listed), not part of moving bytes: the pipeline only says which steps are busy
(queued, flushing, being written) and so may not go.
"""

from __future__ import annotations

from typing import Callable, Set

from slurm_ckpt.core.lineage import SeriesView
from slurm_ckpt.core.retention import CkptInfo, RetentionPolicy, plan_local_deletions
from slurm_ckpt.job.bookkeeping import Bookkeeper
from slurm_ckpt.ledger.record import State
from slurm_ckpt.tiers.base import Tier

__all__ = ["prune_local"]


def prune_local(
    local: Tier,
    user: str,
    key: str,
    books: Bookkeeper,
    policy: RetentionPolicy,
    busy_steps: Callable[[], Set[int]],
) -> None:
    """Delete the local checkpoints of ``user``/``key`` that ``policy`` no longer needs;
    never a step in ``busy_steps()`` (asked after the ledger is read, so a step that
    becomes busy meanwhile is still kept), nor one the ledger pins. Raises CkptError or
    OSError; the caller logs it (retention failing must not fail a save)."""
    records = books.records()
    busy = busy_steps()
    infos = []
    listed = local.steps(user, key)
    view = SeriesView.of((i.step, i.manifest.meta, i.manifest.wall_time) for i in listed)
    for info in listed:
        r = records.get(info.step)
        if r is not None:
            ci = r.to_local_info()
        else:
            ci = CkptInfo(info.step, wall_time=info.manifest.wall_time, seq=-1)
        ci.pinned = ci.pinned or info.step in busy
        ci.retired = not view.active(info.step, info.manifest.meta)
        infos.append(ci)
    for step in plan_local_deletions(infos, policy):
        local.delete(user, key, step)
        if step in records:
            books.set_state(step, "local", State.DELETED)
        books.emit("local_deleted", step=step)
