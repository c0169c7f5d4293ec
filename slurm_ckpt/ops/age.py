"""Move checkpoints on along the tier chain (``pfs`` -> ``object`` -> ``cold``) by the
aging policy (:mod:`slurm_ckpt.core.aging`), and apply the cold tier's retention.

``ckpt-slurm gc`` runs this before the warm tiers' retention, so a checkpoint chosen to
age is copied - and verified *on the next tier*, by re-reading it there - before the
tier it comes from may drop it (:func:`owed`). Copies go through the one copy engine
(:func:`slurm_ckpt.tiers.copy.copy_checkpoint`), which checks every byte against the
manifest on the way.

Run as root (an admin's periodic gc), each copy runs in a child that has become the
checkpoint's owner (:func:`slurm_ckpt.node.asuser.run_as_user`), so root never writes
user data; a user's own run copies in-process. The child's tiers are built there as the
flushers' are (:func:`slurm_ckpt.node.warm.owner_tiers`: root's lent object-store keys,
root's sealed botocore session, every request kept below the owner's prefix).

What counts as aged: a step whose committed manifest on the next tier has exactly the
source's bytes (:func:`aged_steps`), and - before the source's copy may be deleted -
whose copy there verifies (``gc`` checks that, :mod:`slurm_ckpt.ops.gc`). A step that is
merely *listed* there proves nothing: on an object store any holder of bucket keys can
PUT a checksum-valid manifest under anyone's prefix. What a user could have planted is
never a reason to delete.
"""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

from slurm_ckpt.core.aging import plan_aging, plan_cold_deletions
from slurm_ckpt.core.config import Config
from slurm_ckpt.core.retention import CkptInfo
from slurm_ckpt.errors import CkptError
from slurm_ckpt.node.asuser import run_as_user
from slurm_ckpt.node.warm import lend_credentials, owner_tiers
from slurm_ckpt.tiers.base import Tier
from slurm_ckpt.tiers.copy import copy_checkpoint
from slurm_ckpt.tiers.registry import shared_tiers, tiers_from_config

__all__ = [
    "AgeResult",
    "age_series",
    "aged_steps",
    "aging_plan",
    "chain",
    "gc_cold_series",
    "owed",
    "run_aging",
]


@dataclass
class AgeResult:
    """What aging did to one series between two tiers."""

    src: str
    dst: str
    user: str
    key: str
    copied: List[int] = field(default_factory=list)
    planned: List[int] = field(default_factory=list)
    errors: List[str] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        return {
            "from": self.src,
            "to": self.dst,
            "user": self.user,
            "key": self.key,
            "planned": self.planned,
            "copied": self.copied,
            "errors": self.errors,
        }


def chain(cfg: Config, tiers: Dict[str, Tier]) -> List[Tuple[Tier, Tier, float]]:
    """``(from, to, every_s)`` for each link of the configured chain."""
    names = [n for n in shared_tiers(cfg) if n in tiers]
    links = []
    for a, b in zip(names, names[1:]):
        # A tier after the warm one says how often it takes a copy (its ``every``).
        every = getattr(cfg.tiers, b).every
        links.append((tiers[a], tiers[b], float(every)))
    return links


def _infos(tier: Tier, user: str, key: str) -> List[CkptInfo]:
    return [
        CkptInfo(
            step=s.step,
            wall_time=s.manifest.wall_time,
            nbytes=s.nbytes,
            pinned=s.manifest.meta.get("pinned") is True,
        )
        for s in tier.steps(user, key)
    ]


def aging_plan(src: Tier, user: str, key: str, every_s: float) -> Set[int]:
    """Steps of ``src`` the aging policy passes on to the next tier (there or not)."""
    return set(plan_aging(_infos(src, user, key), set(), every_s))


def _manifest_bytes(tier: Tier, user: str, key: str, step: int) -> Optional[bytes]:
    try:
        return tier.manifest_bytes(user, key, step)
    except (CkptError, OSError):
        return None


def aged_steps(src: Tier, dst: Tier, user: str, key: str, steps: Set[int]) -> Set[int]:
    """Of ``steps``, those committed on ``dst`` with exactly the manifest bytes they have
    on ``src`` (see the module docstring). CkptError when ``dst`` cannot be listed."""
    listed = {s.step for s in dst.steps(user, key)}
    out = set()
    for step in sorted(steps & listed):
        mine = _manifest_bytes(src, user, key, step)
        if mine is not None and mine == _manifest_bytes(dst, user, key, step):
            out.add(step)
    return out


def owed(src: Tier, dst: Tier, user: str, key: str, every_s: float) -> Set[int]:
    """Steps of ``src`` that must reach ``dst`` and have no identical committed copy
    there yet: the retention of ``src`` keeps them."""
    want = aging_plan(src, user, key, every_s)
    return want - aged_steps(src, dst, user, key, want)


def _copy_and_verify(src: Tier, dst: Tier, user: str, key: str, step: int) -> Dict[str, Any]:
    res = copy_checkpoint(src, dst, user, key, step)
    rep = dst.verify(user, key, step)  # verified *there*, read back from the next tier
    if not rep.ok:
        dst.delete(user, key, step)
        raise CkptError(f"{rep.where}: copy does not verify: {'; '.join(rep.problems[:2])}")
    return {"copied": res.copied_bytes, "already": res.already_present}


def _copy_as_owner(
    cfg: Config, src: str, dst: str, user: str, key: str, step: int
) -> Dict[str, Any]:
    """In the child that has become ``user``: the tiers as the flushers' owner children
    build them (root's lent keys and sealed session; never the user's AWS files)."""
    tiers = owner_tiers(cfg)
    return _copy_and_verify(tiers[src], tiers[dst], user, key, step)


def _as_owner(user: str) -> bool:
    if os.geteuid() != 0:
        return False
    try:
        pwd.getpwnam(user)
    except KeyError:
        raise CkptError(f"user {user!r} unknown on this host: not copied as root") from None
    return True


def age_series(
    src: Tier,
    dst: Tier,
    user: str,
    key: str,
    every_s: float,
    *,
    dry_run: bool = False,
    as_owner: Optional[bool] = None,
    cfg: Optional[Config] = None,
) -> AgeResult:
    """Copy (and verify on ``dst``) what the aging policy owes ``dst`` of one series.
    ``as_owner``: run each copy as the series' user (default: when running as root);
    with ``cfg`` that child builds its tiers from it (:func:`_copy_as_owner`), as it
    must when the object tier's keys are root's."""
    out = AgeResult(src.name, dst.name, user, key)
    try:
        out.planned = sorted(owed(src, dst, user, key, every_s))
    except CkptError as exc:
        out.errors.append(str(exc))
        return out
    if dry_run:
        return out
    for step in out.planned:
        try:
            if (as_owner if as_owner is not None else _as_owner(user)) and cfg is not None:
                run_as_user(
                    user,
                    _copy_as_owner,
                    cfg,
                    src.name,
                    dst.name,
                    user,
                    key,
                    step,
                    what=f"age {user}/{key} step {step}",
                )
            elif as_owner if as_owner is not None else _as_owner(user):
                run_as_user(
                    user,
                    _copy_and_verify,
                    src,
                    dst,
                    user,
                    key,
                    step,
                    what=f"age {user}/{key} step {step}",
                )
            else:
                _copy_and_verify(src, dst, user, key, step)
        except (CkptError, OSError) as exc:
            out.errors.append(f"{dst.where(user, key, step)}: not aged: {exc}")
            continue
        out.copied.append(step)
    return out


def gc_cold_series(
    tier: Tier, user: str, key: str, now: float, keep_for_s: float, dry_run: bool = False
) -> Tuple[List[int], List[str]]:
    """The cold tier's retention for one series: ``(deleted or planned, errors)``."""
    errors: List[str] = []
    plan = plan_cold_deletions(_infos(tier, user, key), now, keep_for_s)
    if dry_run:
        return plan, errors
    done = []
    for step in plan:
        try:
            tier.delete(user, key, step)
            done.append(step)
        except (CkptError, OSError) as exc:
            errors.append(f"{tier.where(user, key, step)}: not deleted: {exc}")
    return done, errors


def run_aging(
    cfg: Config,
    *,
    user: Optional[str] = None,
    key: Optional[str] = None,
    dry_run: bool = False,
    as_owner: Optional[bool] = None,
) -> List[AgeResult]:
    """Age every selected series along the configured chain (see the module docstring)."""
    tiers = tiers_from_config(cfg)
    if not dry_run:
        lend_credentials(cfg)  # root, before its owner children fork (node.warm)
    results = []
    for src, dst, every in chain(cfg, tiers):
        try:
            series = [
                (u, k)
                for u, k in src.series()
                if (user is None or u == user) and (key is None or k == key)
            ]
        except CkptError as exc:
            results.append(
                AgeResult(src.name, dst.name, user or "*", key or "*", errors=[str(exc)])
            )
            continue
        for u, k in series:
            res = age_series(src, dst, u, k, every, dry_run=dry_run, as_owner=as_owner, cfg=cfg)
            if res.planned or res.errors:
                results.append(res)
    return results
