"""``ckpt-slurm gc``: retention on the shared tiers (PFS, and cold when configured).

The policy is :func:`slurm_ckpt.core.retention.plan_warm_deletions` with the site's
``[retention]`` values; this module decides what each checkpoint's ``verified`` flag is,
and that is where the safety lies. A checkpoint counts as verified only if it verifies
*now* (every byte re-hashed against its manifest): a copy that rotted since it was written
must not be what lets retention delete the last good one.

Re-hashing a whole PFS on every run would be too slow, so :func:`plan_series` verifies
exactly the checkpoints whose verified status lets something else be deleted: the newest
``keep_warm`` (at least one) of those presumed good, and a window keeper of
``keep_warm_every`` whose window holds a checkpoint planned for deletion. Everything not
yet verified is presumed good while planning; when a verification fails, that checkpoint
stops counting and the plan is made again (the next one in line then gets verified). The
result is the plan with every safety-relevant ``verified`` flag measured, so:

* the newest checkpoint that verifies is never deleted (it may be the only good copy);
* a corrupt newest checkpoint does not count towards ``keep_warm``: one more older one is
  kept (the corrupt one too, by the policy's rule for unverified newer copies);
* with nothing verifying, nothing is deleted.

Damaged step directories (:mod:`slurm_ckpt.ops.damage`: a manifest that does not
check, a commit that never finished, unreadable, or another series' manifest) are
reported; a CORRUPT-manifest or INCOMPLETE one is reclaimed when a newer checkpoint of the
series verified in this run (:func:`~slurm_ckpt.ops.damage.reclaimable`). UNREADABLE and
FOREIGN ones are never deleted.

Pins: a checkpoint is pinned when its manifest's ``meta`` has ``"pinned": true`` (set at
save time) or when a marker ``<key>/.pin-step-NNNNNNNNNN`` exists beside it (``touch`` it
to pin after the fact). A PFS checkpoint being archived right now (a
``.partial-step-N.<writer>`` on the cold tier) is kept until that copy is done.

Aging's trust: a step the aging policy passes on to the next tier is kept here until the
next tier holds a copy with identical manifest bytes (:func:`~slurm_ckpt.ops.age.aged_steps`),
and is deleted here only once that copy verifies now (``verify_next``): a manifest that is
merely listed there - on an object store anyone with bucket keys can PUT one under any
prefix - is never a reason to delete.

Deletion goes through :meth:`Tier.delete` (manifest first, under the step lock), the
oldest first, so an interrupted run leaves the newer checkpoints in place. Verification
reads every byte of the checkpoints it checks: on an HSM-backed cold tier that recalls
them. A checkpoint that cannot be read (permissions included) counts as not verified,
which only ever keeps more.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from slurm_ckpt.core.config import Config
from slurm_ckpt.core.layout import parse_partial_dirname, step_dirname
from slurm_ckpt.core.lineage import SeriesView, lineage_of
from slurm_ckpt.core.names import validate_key, validate_user
from slurm_ckpt.core.progress import ProgressFn
from slurm_ckpt.core.retention import CkptInfo, RetentionPolicy, plan_warm_deletions
from slurm_ckpt.errors import CkptError
from slurm_ckpt.ops.age import AgeResult, aged_steps, aging_plan, chain, gc_cold_series, run_aging
from slurm_ckpt.ops.damage import reclaimable, scan_series
from slurm_ckpt.tiers.base import StepInfo, Tier
from slurm_ckpt.tiers.registry import tiers_from_config, warm_tiers

log = logging.getLogger(__name__)

__all__ = [
    "PIN_PREFIX",
    "GcReport",
    "SeriesResult",
    "gc_series",
    "pin_name",
    "plan_series",
    "policy_from_config",
    "run_gc",
]

#: ``<key>/.pin-step-NNNNNNNNNN`` pins that step on a shared tier.
PIN_PREFIX = ".pin-"


def pin_name(step: int) -> str:
    """The marker file name that pins ``step``."""
    return PIN_PREFIX + step_dirname(step)


def policy_from_config(cfg: Config) -> RetentionPolicy:
    r = cfg.retention
    return RetentionPolicy(
        keep_local=r.keep_local,
        flush_every=r.flush_every,
        keep_warm=r.keep_warm,
        keep_warm_every_s=r.keep_warm_every,
    )


# --------------------------------------------------------------------------- planning


def _window(info: CkptInfo, every_s: float) -> float:
    """The retention window of ``info``, computed exactly as the planner does."""
    return math.floor(info.wall_time / every_s) if math.isfinite(every_s) else 0.0


def _must_verify(infos: List[CkptInfo], deleted: Set[int], policy: RetentionPolicy) -> List[int]:
    """Steps whose ``verified`` flag lets another checkpoint be deleted (newest first)."""
    ordered = sorted(infos, key=lambda i: (i.step, i.wall_time), reverse=True)
    presumed = [i for i in ordered if i.verified and not i.retired]
    must: List[int] = []
    for info in presumed:
        if len(must) >= max(policy.keep_warm, 1):
            break
        if info.step not in must:
            must.append(info.step)
    every = float(policy.keep_warm_every_s)
    if every > 0 and deleted:
        doomed_windows = {_window(i, every) for i in infos if i.step in deleted}
        for info in presumed:
            if (
                info.step not in deleted
                and info.step not in must
                and _window(info, every) in doomed_windows
            ):
                must.append(info.step)
    return must


def plan_series(
    infos: Sequence[CkptInfo],
    now: float,
    policy: RetentionPolicy,
    verify: Callable[[int], bool],
) -> Tuple[List[int], Dict[int, bool]]:
    """Deletions for one series, verifying (through ``verify(step)``) what they rest on.

    ``infos`` carry everything but ``verified`` (ignored). Returns the steps to delete
    (ascending) and the verification results, ``{step: ok}``, of the steps it checked.
    """
    results: Dict[int, bool] = {}
    while True:
        current = [replace(i, verified=results.get(i.step, True)) for i in infos]
        deletions = plan_warm_deletions(current, now, policy)
        todo = [s for s in _must_verify(current, set(deletions), policy) if s not in results]
        if not todo:
            return deletions, results
        for step in todo:
            results[step] = bool(verify(step))
            if not results[step]:
                break  # a failure changes who is kept: plan again before verifying more


# --------------------------------------------------------------------------- doing


@dataclass
class SeriesResult:
    """What gc did (or would do) to one series on one tier."""

    tier: str
    user: str
    key: str
    steps: List[int] = field(default_factory=list)
    keep: List[int] = field(default_factory=list)
    delete: List[int] = field(default_factory=list)
    deleted: List[int] = field(default_factory=list)
    verified: List[int] = field(default_factory=list)
    corrupt: List[int] = field(default_factory=list)
    pinned: List[int] = field(default_factory=list)
    bytes: int = 0
    problems: List[str] = field(default_factory=list)
    errors: List[str] = field(default_factory=list)
    #: Damaged step directories (:mod:`slurm_ckpt.ops.damage`), as dicts.
    damaged: List[Dict[str, Any]] = field(default_factory=list)
    #: Those of them gc deletes (dry run: would delete) / deleted.
    reclaim: List[int] = field(default_factory=list)
    reclaimed: List[int] = field(default_factory=list)

    @property
    def damaged_left(self) -> int:
        """Damaged entries gc leaves in place (a finding for the operator)."""
        gone = set(self.reclaimed)
        return sum(1 for d in self.damaged if d["step"] not in gone)

    def to_dict(self) -> Dict[str, Any]:
        return {
            "tier": self.tier,
            "user": self.user,
            "key": self.key,
            "checkpoints": len(self.steps),
            "keep": self.keep,
            "delete": self.delete,
            "deleted": self.deleted,
            "verified": self.verified,
            "corrupt": self.corrupt,
            "pinned": self.pinned,
            "bytes": self.bytes,
            "problems": self.problems,
            "errors": self.errors,
            "damaged": self.damaged,
            "reclaim": self.reclaim,
            "reclaimed": self.reclaimed,
        }


@dataclass
class GcReport:
    """One gc run over the selected series."""

    dry_run: bool
    time: float
    series: List[SeriesResult] = field(default_factory=list)
    aged: List[AgeResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(s.errors for s in self.series) and not any(a.errors for a in self.aged)

    def to_dict(self) -> Dict[str, Any]:
        return {
            "aged": [a.to_dict() for a in self.aged],
            "dry_run": self.dry_run,
            "time": self.time,
            "ok": self.ok,
            "totals": {
                "series": len(self.series),
                "checkpoints": sum(len(s.steps) for s in self.series),
                "delete": sum(len(s.delete) for s in self.series),
                "deleted": sum(len(s.deleted) for s in self.series),
                "bytes": sum(s.bytes for s in self.series),
                "verified": sum(len(s.verified) for s in self.series),
                "corrupt": sum(len(s.corrupt) for s in self.series),
                "errors": sum(len(s.errors) for s in self.series),
                "damaged": sum(len(s.damaged) for s in self.series),
                "reclaimed": sum(len(s.reclaimed) for s in self.series),
            },
            "series": [s.to_dict() for s in self.series],
        }


def _names(tier: Tier, user: str, key: str) -> Set[str]:
    dirs = tier.directory()
    if dirs is None:
        return set()  # an object store: pins are in the manifest's meta only
    try:
        with dirs.key_fd(user, key) as kfd:
            return set(os.listdir(kfd))
    except (CkptError, OSError):
        return set()


def gc_series(
    tier: Tier,
    user: str,
    key: str,
    policy: RetentionPolicy,
    now: float,
    *,
    dry_run: bool = False,
    next_tier: Optional[Tier] = None,
    progress: Optional[ProgressFn] = None,
    owed: Optional[Set[int]] = None,
    aged: Optional[Set[int]] = None,
    verify_next: Optional[Callable[[int], bool]] = None,
) -> SeriesResult:
    """Apply retention to ``user/key`` on ``tier``; see the module docstring.
    ``progress(nbytes)`` hears of every byte verified. ``owed``: steps the next tier
    must receive and has not (kept). ``aged``: steps it holds with identical manifest
    bytes; one of them is deleted here only once ``verify_next(step)`` says its copy
    there verifies (else it is kept as owed)."""
    res = SeriesResult(tier.name, user, key)
    good, damaged = scan_series(tier, user, key, now)
    res.damaged = [d.to_dict() for d in damaged]
    steps: Dict[int, StepInfo] = {s.step: s for s in good}
    res.steps = sorted(steps)
    if not steps:
        return res
    names = _names(tier, user, key)
    archiving: Set[int] = set()
    if next_tier is not None:
        for name in _names(next_tier, user, key):
            partial = parse_partial_dirname(name)
            if partial is not None:
                archiving.add(partial[0])
    view = SeriesView.of((s.step, s.manifest.meta, s.manifest.wall_time) for s in good)
    infos = []
    for step, s in sorted(steps.items()):
        pinned = s.manifest.meta.get("pinned") is True or pin_name(step) in names
        if pinned:
            res.pinned.append(step)
        infos.append(
            CkptInfo(
                step=step,
                wall_time=s.manifest.wall_time,
                nbytes=s.nbytes,
                pinned=pinned,
                next_tier_verified=False if step in archiving or step in (owed or ()) else None,
                retired=not view.active(step, s.manifest.meta),
                lineage=lineage_of(s.manifest.meta).name,
            )
        )

    measured: Dict[int, bool] = {}

    def verify(step: int) -> bool:
        if step in measured:
            return measured[step]
        try:
            rep = tier.verify(user, key, step, progress=progress)
        except CkptError as exc:
            res.problems.append(f"{tier.where(user, key, step)}: {exc}")
            measured[step] = False
            return False
        if not rep.ok:
            res.problems.extend(rep.problems[:3])
        measured[step] = rep.ok
        return rep.ok

    # A step aged to the next tier may go from here only once its copy there verifies;
    # one that does not is owed again (kept), and the plan is made anew.
    there: Dict[int, bool] = {}
    while True:
        deletions, results = plan_series(infos, now, policy, verify)
        todo = [s for s in deletions if s in (aged or ()) and s not in there]
        if not todo:
            break
        for step in todo:
            there[step] = verify_next is not None and bool(verify_next(step))
        infos = [
            replace(i, next_tier_verified=False) if there.get(i.step) is False else i for i in infos
        ]
    res.verified = sorted(s for s, ok in results.items() if ok)
    res.corrupt = sorted(s for s, ok in results.items() if not ok)
    res.delete = list(deletions)
    res.keep = sorted(set(steps) - set(deletions))
    res.bytes = sum(steps[s].nbytes for s in deletions)
    newest_ok = max(res.verified) if res.verified else None
    res.reclaim = [
        d.step  # type: ignore[misc]
        for d in damaged
        if reclaimable(d, newest_ok, pinned=d.step is not None and pin_name(d.step) in names)
    ]
    if dry_run:
        return res
    for step in deletions + res.reclaim:  # oldest first; then the damaged ones
        try:
            tier.delete(user, key, step)
        except (CkptError, OSError) as exc:
            res.errors.append(f"{tier.where(user, key, step)}: not deleted: {exc}")
            continue
        (res.deleted if step in steps else res.reclaimed).append(step)
    res.bytes = sum(steps[s].nbytes for s in res.deleted)
    return res


def _series(tier: Tier, user: Optional[str], key: Optional[str]) -> List[Tuple[str, str]]:
    out = []
    try:
        users = [user] if user is not None else tier.users()
    except CkptError:
        return out
    for u in users:
        try:
            validate_user(u)
            keys = [key] if key is not None else tier.keys(u)
        except CkptError:
            continue
        for k in keys:
            try:
                out.append((u, validate_key(k)))
            except CkptError:
                continue
    return out


def run_gc(
    cfg: Config,
    *,
    user: Optional[str] = None,
    key: Optional[str] = None,
    dry_run: bool = False,
    now: Optional[float] = None,
    progress: Optional[ProgressFn] = None,
    as_owner: Optional[bool] = None,
) -> GcReport:
    """Aging along the tier chain, then retention on the warm tiers (PFS, object store)
    and the cold tier's (``keep_for``, pins forever). ``as_owner``: copies as the
    series' user (default: when running as root)."""
    if user is not None:
        validate_user(user)
    if key is not None:
        validate_key(key)
    policy = policy_from_config(cfg)
    when = time.time() if now is None else now
    tiers = tiers_from_config(cfg)
    report = GcReport(dry_run, when)
    # Aging first (pfs -> object -> cold, each copy verified on the next tier), so that
    # retention below sees what has arrived; what is still owed is kept.
    report.aged = run_aging(cfg, user=user, key=key, dry_run=dry_run, as_owner=as_owner)
    links = {src.name: (dst, every) for src, dst, every in chain(cfg, tiers)}
    for name in warm_tiers(cfg):  # the shared tiers that take flushes, in flush order
        tier = tiers[name]
        following = links.get(name)
        for u, k in _series(tier, user, key):
            try:
                keep: Set[int] = set()
                aged: Set[int] = set()
                if following is not None:
                    try:
                        want = aging_plan(tier, u, k, following[1])
                        aged = aged_steps(tier, following[0], u, k, want)
                        keep = want - aged
                    except CkptError:
                        keep = {s.step for s in tier.steps(u, k)}  # next tier unknown: keep all
                nxt = None if following is None else following[0]
                res = gc_series(
                    tier,
                    u,
                    k,
                    policy,
                    when,
                    dry_run=dry_run,
                    next_tier=nxt,
                    progress=progress,
                    owed=keep,
                    aged=aged,
                    verify_next=None if nxt is None else _verifier(nxt, u, k),
                )
            except Exception as exc:  # noqa: BLE001 - one user's series never stops the rest
                res = _skipped(tier, u, k, exc)
            if res.steps or res.damaged or res.errors:
                report.series.append(res)
    cold = tiers.get("cold")
    if cold is not None and cfg.tiers.cold is not None:
        for u, k in _series(cold, user, key):
            try:
                res = SeriesResult("cold", u, k, steps=[s.step for s in cold.steps(u, k)])
                done, errors = gc_cold_series(cold, u, k, when, cfg.tiers.cold.keep_for, dry_run)
                res.delete = done
                res.deleted = [] if dry_run else done
                res.keep = sorted(set(res.steps) - set(done))
                res.errors = errors
            except Exception as exc:  # noqa: BLE001 - one user's series never stops the rest
                res = _skipped(cold, u, k, exc)
            if res.steps or res.errors:
                report.series.append(res)
    return report


def _verifier(tier: Any, user: str, key: str) -> Callable[[int], bool]:
    """``verify(step)``: does the copy on ``tier`` (the next one) verify now?"""

    def verify(step: int) -> bool:
        try:
            return bool(tier.verify(user, key, step).ok)
        except (CkptError, OSError):
            return False

    return verify


def _skipped(tier: Any, user: str, key: str, exc: BaseException) -> SeriesResult:
    """The result of a series whose gc failed: its error, nobody else's problem."""
    if not isinstance(exc, (CkptError, OSError)):
        log.exception("gc of %s/%s on %s failed", user, key, tier.name)
    res = SeriesResult(tier.name, user, key)
    text = " ".join(str(exc).split())[:300] or type(exc).__name__
    res.errors.append(f"{tier.where(user, key)}: skipped: {text}")
    return res
