"""A warm copy that ``ckpt-slurm verify`` finds damaged is taken out of use (issue 28).

A damaged copy on the warm tier is worse than none: every node's ledger believes the step
is safe there, so nothing flushes it again, and local retention may then delete the only
good copy. The hooks' scrub (:mod:`slurm_ckpt.node.scrub`) fixes that for what it reads
back; ``verify`` does the same for what it finds: the copy is **uncommitted** on the warm
tier (its manifest moved aside as ``manifest.json.damaged``, :meth:`PosixTier.uncommit
<slurm_ckpt.tiers.posix.PosixTier.uncommit>`), so it stops counting for every restore and
``status``. Every node that still holds the checkpoint learns it at its next hook or
stager pass (their scrub looks at each warm copy's manifest every time) and flushes its
good local copy again.

Only the copy's owner or root may do it; anyone else who can read the copy gets the
report and nothing changes. Root never acts on what it read itself: a child running as
the owner re-reads the copy (no symlink below the tier root followed, no file but a
regular one opened), and uncommits it only if it is still damaged and its manifest is
still the one it verified - never a copy committed again meanwhile.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, List, Optional

from slurm_ckpt.core.config import Config
from slurm_ckpt.core.names import current_user, user_ids
from slurm_ckpt.errors import CkptError, NotFound
from slurm_ckpt.ledger.record import one_line
from slurm_ckpt.node.asuser import alive, run_as
from slurm_ckpt.node.work import CHILD_LIMIT_FACTOR
from slurm_ckpt.tiers.base import Tier

__all__ = ["Uncommitted", "uncommit_damaged"]


@dataclass(frozen=True)
class Uncommitted:
    """What became of one damaged warm copy: ``done`` when it was uncommitted now, and a
    one-line ``note`` for the report either way."""

    done: bool
    note: str


def _recheck(tier: Tier, user: str, key: str, step: int) -> List[Any]:
    """As the owner: ``[outcome, reason]``, the copy read again and uncommitted when it is
    still damaged (``uncommitted``); ``ok`` when it now verifies, ``changed`` when its
    manifest is no longer the one read here (committed again, or uncommitted already),
    ``unreadable`` when the owner cannot read it either."""
    try:
        expect = tier.manifest_bytes(user, key, step)
    except NotFound:
        return ["changed", "no longer committed"]
    rep = tier.verify(user, key, step, progress=lambda _n: alive())
    if rep.ok:
        return ["ok", ""]
    if rep.problems and all("permission denied" in p for p in rep.problems):
        return ["unreadable", rep.problems[0]]
    if not tier.uncommit(user, key, step, expect):
        return ["changed", "its manifest changed meanwhile"]
    return ["uncommitted", rep.problems[0] if rep.problems else "verify failed"]


def _me() -> Optional[str]:
    try:
        return current_user()
    except CkptError:
        return None  # a uid without a passwd entry owns no one's checkpoints


def uncommit_damaged(
    cfg: Config, tier: Tier, user: str, key: str, step: int, nbytes: int
) -> Optional[Uncommitted]:
    """Take ``user/key/step`` on the warm ``tier``, found damaged by ``verify``, out of
    use (see the module docstring). None when ``tier`` is not the warm tier (a damaged
    local copy is its node's to replace; the report says it is damaged)."""
    if tier.name != cfg.tiers.warm:
        return None
    if os.geteuid() == 0:
        h = cfg.hooks
        try:
            ids = user_ids(user)
            got = run_as(
                ids.uid,
                ids.gid,
                _recheck,
                tier,
                user,
                key,
                step,
                user=ids.name,
                timeout=CHILD_LIMIT_FACTOR * h.child_timeout + max(0, nbytes) / h.min_flush_rate,
                stall_timeout=h.child_timeout,
                what="verify",
            )
        except CkptError as exc:
            return Uncommitted(False, f"not uncommitted: {exc}")
    elif _me() == user:
        try:
            got = _recheck(tier, user, key, step)
        except CkptError as exc:
            return Uncommitted(False, f"not uncommitted: {exc}")
    else:
        return Uncommitted(False, f"not uncommitted: only {user} or root may take it out of use")
    outcome = got[0] if isinstance(got, list) and got else ""
    if outcome == "uncommitted":
        return Uncommitted(
            True,
            "uncommitted on the warm tier (manifest.json.damaged): nodes still holding "
            "the checkpoint flush it again",
        )
    if outcome == "ok":
        return Uncommitted(False, "not uncommitted: it verifies when read again")
    if outcome in ("changed", "unreadable") and len(got) == 2:
        return Uncommitted(False, f"not uncommitted: {one_line(got[1])}")
    return Uncommitted(False, "not uncommitted: garbled answer from the owner's check")
