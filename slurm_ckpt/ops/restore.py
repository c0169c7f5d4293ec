"""Bring one checkpoint back from any tier into a directory: ``ckpt-slurm restore``.

For the rollbacks the cold tier exists for ("back to three days ago"): the checkpoint
``user/key/step`` is copied from the chosen tier (or the fastest one holding it) through
the one copy engine, every byte checked against the manifest on the way, and committed
in ``DIR/<user>/<key>/step-NNNNNNNNNN/`` - a tier root of its own, so ``ckpt-slurm
verify DIR/<user>/<key>/step-...`` and ``Checkpointer(local=DIR, ...)`` read it as is.
A copy that does not verify is skipped for the same step on the next tier.

Lineages (:mod:`slurm_ckpt.core.lineage`): without ``--step`` the newest *current* step
is taken, never one a rollback retired; ``--lineage L`` takes the newest (or the given
step) of lineage L, retired or not. What was restored names its lineage.

Without ``--step`` the choice is automatic, so it follows the job's own ``restore()``
(:func:`slurm_ckpt.core.replicas.not_automatic`): a step whose replicas did not agree
(``suspect``), or one after the ``last_healthy`` pin that was saved before the pin, is
passed over, and the result says so (``skipped``). ``--step N`` still reads it.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional

from slurm_ckpt.core.config import Config
from slurm_ckpt.core.lineage import SeriesView, lineage_of
from slurm_ckpt.core.names import current_user, validate_key, validate_user
from slurm_ckpt.core.progress import ProgressFn
from slurm_ckpt.core.replicas import newest_pin, not_automatic, pin_of
from slurm_ckpt.errors import NotFound, TierError, UsageError, VerifyError
from slurm_ckpt.ops.catalog import series_under
from slurm_ckpt.tiers.copy import copy_checkpoint
from slurm_ckpt.tiers.registry import ORDER, directory_tier, tiers_from_config

__all__ = ["restore_to"]


def restore_to(
    cfg: Config,
    key: str,
    to: str,
    *,
    user: Optional[str] = None,
    tier: Optional[str] = None,
    step: Optional[int] = None,
    progress: Optional[ProgressFn] = None,
    lineage: Optional[str] = None,
    sized: Optional[Callable[[int], None]] = None,
) -> Dict[str, Any]:
    """Copy a committed, verifying checkpoint of ``key`` into ``to`` (see the module
    docstring): the given ``step`` (default: the newest on the tiers looked at), from
    ``tier`` (default: every tier, fastest first). Returns what was done. ``sized(n)``
    hears the size of each copy before it starts (a progress bar's total)."""
    user = validate_user(user) if user else current_user()
    validate_key(key)
    tiers = tiers_from_config(cfg)
    if tier is not None:
        if tier not in tiers:
            word = "warm" if tier == cfg.tiers.warm else tier  # the name --tier takes
            raise UsageError(f"--tier {word}: not configured (configured: {', '.join(tiers)})")
        tiers = {tier: tiers[tier]}
    found: List[Any] = []
    for t in tiers.values():
        try:
            found += [(t, i) for i in t.steps(user, key)]
        except (TierError, OSError):
            continue
    view = SeriesView.of((i.step, i.manifest.meta, i.manifest.wall_time) for _, i in found)
    pin = newest_pin(pin_of(i.manifest.meta) for _, i in found)
    passed: Dict[int, str] = {}

    def wanted(info: Any, current_only: bool) -> bool:
        if step is not None and info.step != step:
            return False
        if lineage is not None:
            ok = lineage_of(info.manifest.meta).name == lineage
        else:
            ok = not current_only or view.active(info.step, info.manifest.meta)
        if ok and step is None:  # an automatic choice: never a suspect or unhealthy step
            why = not_automatic(info.step, info.manifest.meta, info.manifest.wall_time, pin)
            if why is not None:
                passed.setdefault(info.step, why)
                return False
        return ok

    holders: Dict[int, List[Any]] = {}
    # Current steps first; a step asked for by number that only a retired lineage holds
    # is still restored (it was asked for), and the result says it is retired.
    for current_only in (True, False):
        for t, info in found:
            if wanted(info, current_only):
                holders.setdefault(info.step, []).append((t, info.manifest))
        if holders or step is None:
            break
    if not holders:
        word = "warm" if tier == cfg.tiers.warm else tier  # the name --tier takes
        where = f" on the {word} tier" if tier else ""
        at = f" at step {step}" if step is not None else ""
        at += f" in lineage {lineage}" if lineage is not None else ""
        if passed:
            newest = max(passed)
            raise NotFound(
                f"no checkpoint of {user}/{key}{at}{where} that an automatic restore may "
                f"take: step {newest} is {passed[newest]}; give --step N to read one anyway"
            )
        hint = _ranks_hint(tiers, user, key, found)
        raise NotFound(f"no committed checkpoint of {user}/{key}{at}{where}{hint}")
    to = os.path.abspath(to)
    os.makedirs(to, exist_ok=True)
    skipped: List[str] = []
    for s in sorted(holders, reverse=True):
        for t, manifest in sorted(holders[s], key=lambda x: ORDER.index(x[0].name)):
            meta = manifest.meta
            if sized is not None:
                sized(manifest.total_bytes)
            dst = directory_tier("restore", to, chunk_size=t.chunk_size, streams=cfg.copy.streams)
            try:
                res = copy_checkpoint(t, dst, user, key, s, progress=progress)
            except (VerifyError, TierError, NotFound) as exc:
                skipped.append(str(exc))
                continue
            return {
                "user": user,
                "key": key,
                "step": s,
                "tier": t.name,
                "lineage": lineage_of(meta).name,
                "retired": not view.active(s, meta),
                "path": dst.step_path(user, key, s),
                "bytes": res.nbytes,
                "seconds": round(res.seconds, 3),
                # the newer steps an automatic choice passed over, then copies that failed
                "skipped": [
                    f"passing over step {n}: {why}"
                    for n, why in sorted(passed.items(), reverse=True)
                    if n > s
                ]
                + skipped,
            }
    raise VerifyError(f"no copy of {user}/{key} verifies: {skipped[0]}")


def _ranks_hint(tiers: Dict[str, Any], user: str, key: str, found: List[Any]) -> str:
    """A multi-rank job keeps one series per rank (``KEY.rank00000``, DCP parts
    ``KEY.dcp.rank00000``), and one directory holds one series' step: when ``KEY`` itself
    has none, name its ranks' series, which ``restore`` takes one at a time."""
    if found:
        return ""
    ranks = [k for k in series_under(tiers, user, key) if k != key]
    if not ranks:
        return ""
    shown = ", ".join(ranks[:2]) + (f" ... ({len(ranks)} series)" if len(ranks) > 2 else "")
    return f"; it is saved per rank ({shown}): restore each, e.g. ckpt-slurm restore {ranks[0]}"
