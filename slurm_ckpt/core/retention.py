"""Retention: which checkpoints to flush, and which may be deleted on each tier.

Pure policy: no I/O, no clock (the caller passes ``now``), no randomness. The callers
(job layer, stager daemon, GC) gather :class:`CkptInfo` entries for **one checkpoint
series** (one ``(user, key)``) on one tier and act on the plans returned here.

Conventions
-----------
* ``seq`` is **0-based**: the first local save of a run has ``seq == 0`` and is therefore
  always flushed (``0 % flush_every == 0``); with ``flush_every=5`` the saves with seq
  0, 5, 10, ... are flushed.
* "Newest" means highest ``step`` (ties: later ``wall_time``). Steps only grow within a
  series, and ordering by step does not depend on clocks that may differ between nodes.
* A flush decision is made once, when the checkpoint is saved, and recorded in
  :attr:`CkptInfo.selected_for_flush` (or :attr:`CkptInfo.forced` for preemption / final
  saves). The planners trust the recorded decision, not ``policy.flush_every``, so a policy
  change never strands a checkpoint the stager was told to copy.

The rule no policy value can change
-----------------------------------
A local checkpoint that is selected for flushing (or forced) is never planned for deletion
before its warm copy is verified (:attr:`CkptInfo.warm_verified`). ``keep_local=0`` or any
other value only affects checkpoints that are not protected by that rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Set

from slurm_ckpt.errors import ConfigError

__all__ = [
    "CkptInfo",
    "RetentionPolicy",
    "needs_flush",
    "plan_local_deletions",
    "plan_warm_deletions",
    "selected_for_flush",
]


def _check_count(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"retention.{name}: expected a whole number, got {value!r}")
    if value < minimum:
        raise ConfigError(f"retention.{name}: must be at least {minimum}, got {value!r}")


@dataclass(frozen=True)
class RetentionPolicy:
    """How many checkpoints each tier keeps.

    * ``keep_local``: newest local checkpoints kept (0 allowed: keep only what still waits
      for its warm copy).
    * ``flush_every``: flush one local save in ``flush_every`` (1 = every save).
    * ``keep_warm``: newest verified warm-tier checkpoints kept.
    * ``keep_warm_every_s``: also keep one warm-tier checkpoint per window of this many seconds
      (windows aligned to the epoch; the oldest verified checkpoint of each window is kept).
      0 disables the windows; ``inf`` keeps the single oldest verified checkpoint.
    """

    keep_local: int = 2
    flush_every: int = 1
    keep_warm: int = 3
    keep_warm_every_s: float = 86400.0

    def __post_init__(self) -> None:
        _check_count("keep_local", self.keep_local, 0)
        _check_count("flush_every", self.flush_every, 1)
        _check_count("keep_warm", self.keep_warm, 0)
        w = self.keep_warm_every_s
        if isinstance(w, bool) or not isinstance(w, (int, float)) or math.isnan(w) or w < 0:
            raise ConfigError(f"retention.keep_warm_every_s: expected seconds >= 0, got {w!r}")


DEFAULT_POLICY = RetentionPolicy()


@dataclass
class CkptInfo:
    """What the planners need to know about one checkpoint on one tier.

    * ``wall_time``: commit time on this tier (epoch seconds).
    * ``verified``: the copy on *this* tier passed verification against its manifest.
    * ``warm_verified``: for local entries, a verified copy exists on the warm tier.
    * ``next_tier_verified``: for warm-tier entries, ``None`` when no next tier (cold) is
      configured or required for it, else whether the copy there is verified.

    The defaults are the cautious ones: an entry built without saying otherwise is
    selected for flush, not verified and not on the warm tier, so the planners keep it.
    """

    step: int
    wall_time: float = 0.0
    seq: int = 0
    nbytes: int = 0
    selected_for_flush: bool = True
    forced: bool = False
    pinned: bool = False
    verified: bool = False
    warm_verified: bool = False
    next_tier_verified: Optional[bool] = None
    #: A step of a lineage abandoned by a rollback (:mod:`slurm_ckpt.core.lineage`):
    #: never counted among the newest kept; ``lineage`` names it (the warm tier keeps the
    #: newest verified step of each retired lineage as its history).
    retired: bool = False
    lineage: Optional[str] = None


def selected_for_flush(seq: int, policy: Optional[RetentionPolicy] = None) -> bool:
    """Whether the ``seq``-th (0-based) local save of a run is copied to the warm tier.

    Saves 0, N, 2N, ... are selected (``N = policy.flush_every``). A negative ``seq``
    (unknown position, e.g. a checkpoint found on disk without a ledger record) is always
    selected: copying too much is safe, losing a checkpoint is not.
    """
    p = policy or DEFAULT_POLICY
    if seq < 0:
        return True
    return seq % p.flush_every == 0


def needs_flush(info: CkptInfo) -> bool:
    """The recorded decision: this checkpoint must reach the warm tier."""
    return bool(info.selected_for_flush or info.forced)


def _newest_first(infos: Iterable[CkptInfo]) -> List[CkptInfo]:
    return sorted(infos, key=lambda i: (i.step, i.wall_time), reverse=True)


def _local_protected(info: CkptInfo) -> bool:
    """Kept whatever the policy says."""
    if info.pinned:
        return True
    # The rule that cannot be configured away.
    return needs_flush(info) and not info.warm_verified


def plan_local_deletions(
    local: List[CkptInfo], policy: Optional[RetentionPolicy] = None
) -> List[int]:
    """Steps that may be deleted from the local tier (ascending, no duplicates).

    Kept: the newest ``keep_local`` current checkpoints (retired steps, of a lineage a
    rollback abandoned, are not counted: they go like any superseded step); every pinned
    one; every one selected for flush (or forced) whose warm copy is not verified yet.
    Everything else may go: a checkpoint not selected for flush once it is superseded, a
    flushed one once its warm copy is verified and it is outside the newest ``keep_local``.

    ``local`` must hold one series. A step listed more than once is deleted only if no
    entry for it is protected.
    """
    p = policy or DEFAULT_POLICY
    ordered = _newest_first(local)
    keep: Set[int] = set()
    newest_steps: List[int] = []
    for info in ordered:
        if len(newest_steps) >= p.keep_local:
            break
        if info.step not in newest_steps and not info.retired:
            newest_steps.append(info.step)
    keep.update(newest_steps)
    for info in ordered:
        if _local_protected(info):
            keep.add(info.step)
    return sorted({i.step for i in ordered} - keep)


def _warm_window_keepers(verified: List[CkptInfo], every_s: float) -> Set[int]:
    """One step per epoch-aligned window: the oldest verified checkpoint in it.

    The oldest (not the newest) so that later checkpoints landing in the same window never
    change the choice: repeated runs do not churn.
    """
    if every_s <= 0 or not verified:
        return set()
    chosen: Dict[float, CkptInfo] = {}
    for info in verified:
        window = math.floor(info.wall_time / every_s) if math.isfinite(every_s) else 0.0
        best = chosen.get(window)
        if best is None or (info.wall_time, info.step) < (best.wall_time, best.step):
            chosen[window] = info
    return {i.step for i in chosen.values()}


def plan_warm_deletions(
    warm: List[CkptInfo], now: float, policy: Optional[RetentionPolicy] = None
) -> List[int]:
    """Steps that may be deleted from the warm tier (ascending, no duplicates).

    Kept:

    * the newest ``keep_warm`` verified checkpoints;
    * the oldest verified checkpoint of each ``keep_warm_every_s`` window (epoch-aligned, so
      the choice is stable from run to run);
    * pinned checkpoints;
    * the newest verified checkpoint, always (even with ``keep_warm=0``): it may be the only
      verified copy anywhere;
    * unverified checkpoints newer than the newest verified one (a copy or a verification
      may still be in progress);
    * checkpoints whose copy on the next tier is required but not verified
      (``next_tier_verified is False``);
    * checkpoints committed after ``now`` (clock skew between nodes: judge them later);
    * retired steps (of a lineage a rollback abandoned) count for none of the "newest"
      rules above; of each retired lineage its newest verified step is kept, as history.

    Everything else may go, including unverified (bad) copies older than the newest
    verified checkpoint.
    """
    p = policy or DEFAULT_POLICY
    ordered = _newest_first(warm)
    history: Dict[Optional[str], int] = {}
    for info in ordered:
        if info.retired and info.verified and info.lineage not in history:
            history[info.lineage] = info.step
    ordered_all, ordered = ordered, [i for i in ordered if not i.retired]
    verified = [i for i in ordered if i.verified]
    keep: Set[int] = set()
    newest_verified = verified[0] if verified else None
    if newest_verified is not None:
        keep.add(newest_verified.step)
    count: List[int] = []
    for info in verified:
        if len(count) >= p.keep_warm:
            break
        if info.step not in count:
            count.append(info.step)
    keep.update(count)
    keep |= _warm_window_keepers(verified, float(p.keep_warm_every_s))
    keep.update(history.values())
    for info in ordered_all:
        if (
            info.pinned
            or info.next_tier_verified is False
            or info.wall_time > now
            or (
                not info.verified
                and not info.retired
                and (newest_verified is None or info.step > newest_verified.step)
            )
        ):
            keep.add(info.step)
    return sorted({i.step for i in ordered_all} - keep)
