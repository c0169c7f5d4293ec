"""Bringing a node's ledger in line with what its tiers hold (:meth:`Ledger.reconcile
<slurm_ckpt.ledger.ledger.Ledger.reconcile>`, which documents the rules): the ledger is a
cache of the tiers, and this is how a hook rebuilds it from a scan without undoing what
another writer did while the scan ran.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from slurm_ckpt.ledger.codec import Data, from_raw, to_raw
from slurm_ckpt.ledger.record import LIVE_LOCAL, WARM_SLOT, Record, State

__all__ = ["reconcile_data"]

Ident3 = Tuple[str, str, int]


def reconcile_data(
    data: Data,
    local_map: Dict[Ident3, int],
    warm_map: Dict[Ident3, int],
    now: float,
    *,
    prune: bool,
    jobs: Dict[Ident3, Optional[str]],
    since: Optional[float],
) -> Dict[str, int]:
    """Apply one reconcile to ``data`` (the ledger lock is held); returns the counts
    ``added``, ``fixed``, ``pruned``. ``local_map``/``warm_map`` map ``(user, key, step)``
    to its size."""
    counts = {"added": 0, "fixed": 0, "pruned": 0}

    def newer(raw: Dict[str, Any]) -> bool:
        return since is not None and float(raw.get("updated_at") or 0.0) >= since

    for ident, nbytes in local_map.items():
        raw = data.get(ident)
        if raw is None:
            rec = Record(*ident, nbytes=nbytes, created_at=now, updated_at=now)
            rec.job = jobs.get(ident)
            rec.tiers["local"] = State.COMMITTED
            rec.committed_at["local"] = now
            rec.selected_for_flush = True
            verified = ident in warm_map
            rec.tiers[WARM_SLOT] = State.VERIFIED if verified else State.FLUSH_PENDING
            if ident in warm_map:
                rec.verified_at[WARM_SLOT] = now
            rec.extra["reconciled"] = True
            data.put(to_raw(rec))
            counts["added"] += 1
        elif newer(raw):
            continue
        elif (raw.get("tiers") or {}).get("local") not in LIVE_LOCAL:
            if _held_bad(raw, now):
                continue  # refused as unsafe: looked at again after its backoff
            rec = from_raw(raw)
            rec.tiers["local"] = State.COMMITTED
            rec.committed_at.setdefault("local", now)
            if not rec.nbytes:
                rec.nbytes = nbytes
            rec.job = rec.job or jobs.get(ident)
            rec.updated_at = now
            data.put(to_raw(rec))
            counts["fixed"] += 1
        elif not raw.get("job") and jobs.get(ident):
            rec = from_raw(raw)
            rec.job = jobs[ident]
            rec.updated_at = now
            data.put(to_raw(rec))
            counts["fixed"] += 1
    for ident, nbytes in warm_map.items():
        raw = data.get(ident)
        if raw is None or newer(raw):
            continue
        if (raw.get("tiers") or {}).get(WARM_SLOT) == State.VERIFIED.value:
            continue
        rec = from_raw(raw)
        rec.tiers[WARM_SLOT] = State.VERIFIED
        rec.verified_at.setdefault(WARM_SLOT, now)
        if not rec.nbytes:
            rec.nbytes = nbytes
        rec.updated_at = now
        data.put(to_raw(rec))
        counts["fixed"] += 1
    if prune:
        for raw in data.decode_all():
            if newer(raw):
                continue
            ident = (raw["user"], raw["key"], raw["step"])
            tiers = raw.get("tiers") or {}
            changed = False
            rec = from_raw(raw)
            if tiers.get("local") in LIVE_LOCAL and ident not in local_map:
                rec.tiers["local"] = State.DELETED
                changed = True
            if tiers.get(WARM_SLOT) == State.VERIFIED.value and ident not in warm_map:
                if rec.tiers.get("local") in LIVE_LOCAL and rec.needs_flush:
                    del rec.tiers[WARM_SLOT]
                    rec.verified_at.pop(WARM_SLOT, None)
                else:
                    rec.tiers[WARM_SLOT] = State.DELETED
                changed = True
            if changed:
                rec.updated_at = now
                data.put(to_raw(rec))
                counts["pruned"] += 1
    return counts


def _held_bad(raw: Dict[str, Any], now: float) -> bool:
    """A local copy found BAD (unsafe or corrupt) whose retry time has not come: a scan
    that still lists it must not make it flushable again before then."""
    retry_at = raw.get("retry_at")
    return (
        (raw.get("tiers") or {}).get("local") == State.BAD.value
        and isinstance(retry_at, (int, float))
        and retry_at > now
    )
