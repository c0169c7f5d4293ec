"""Aging: which checkpoints go on from one tier to the next (PFS -> object store, warm ->
cold), and which the cold tier may drop. Pure policy: no I/O, no clock.

The chain of tiers after the node-local one is ``pfs``, ``object``, ``cold`` (those
configured). A tier passes on one checkpoint per window of ``every_s`` seconds (windows
aligned to the epoch; the *oldest* committed checkpoint of each window, the same stable
choice as retention's window keepers, so repeated runs do not churn), plus every pinned
one; ``every_s == 0`` passes on every checkpoint. Until the next tier holds a verified
copy of such a checkpoint, this tier's retention must keep it
(:attr:`~slurm_ckpt.core.retention.CkptInfo.next_tier_verified` False).

The cold tier keeps what is younger than ``keep_for_s``, every pinned checkpoint
(forever), and its newest checkpoint always.
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, List, Set

from slurm_ckpt.core.retention import CkptInfo

__all__ = ["plan_aging", "plan_cold_deletions"]


def plan_aging(infos: Iterable[CkptInfo], have: Set[int], every_s: float) -> List[int]:
    """Steps of this tier that belong on the next one and are not there yet (ascending).

    ``have``: steps the next tier already holds (committed)."""
    items = sorted(infos, key=lambda i: (i.wall_time, i.step))
    chosen: Set[int] = {i.step for i in items if i.pinned}
    if every_s <= 0:
        chosen |= {i.step for i in items}
    else:
        first: Dict[float, CkptInfo] = {}
        for info in items:
            window = math.floor(info.wall_time / every_s) if math.isfinite(every_s) else 0.0
            first.setdefault(window, info)
        chosen |= {i.step for i in first.values()}
    return sorted(chosen - set(have))


def plan_cold_deletions(infos: Iterable[CkptInfo], now: float, keep_for_s: float) -> List[int]:
    """Steps the cold tier may delete (ascending): older than ``keep_for_s``, not
    pinned, and not its newest checkpoint."""
    items = sorted(infos, key=lambda i: (i.step, i.wall_time))
    if not items:
        return []
    newest = items[-1].step
    return sorted(
        {
            i.step
            for i in items
            if not i.pinned and i.step != newest and now - i.wall_time > keep_for_s
        }
    )
