"""``ckpt-slurm drill KEY``: the recovery drill - prove that a restart would get its state
back, and how long that takes.

1. Pick the checkpoint a restart would pick: the job layer's
   :class:`~slurm_ckpt.job.restore.Restorer` over every configured tier, fastest first:
   local, PFS, object store, cold (newest complete step first; within a step the fastest
   tier's copy first).
2. Copy it into scratch space with the copy engine, which checks every byte against the
   manifest on the way (a copy that does not verify is skipped, as a restart would skip
   it: the same step from the next tier, else the previous step). The default scratch
   space is a temporary directory on the tier the chosen copy lives on - where a restart
   would read from.
3. Load the scratch copy with the job layer's restore (``restore(weights_only=True)``,
   then ``restore_rest()``; torch tensors when the payload is a torch state) and report the
   time to the weights and the time to the full state. A payload that is not a
   ``slurm_ckpt`` state (plain files) is verified only.

The drill changes nothing: no ledger update, nothing marked bad, the scratch copy is
removed. Exit status 1 when nothing is restorable.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

from slurm_ckpt.core.config import Config
from slurm_ckpt.core.names import current_user, validate_key, validate_user
from slurm_ckpt.core.progress import ProgressFn
from slurm_ckpt.errors import NotFound, TierError, VerifyError

__all__ = ["run_drill"]

_RANK_RE = re.compile(r"^(?P<base>.+)\.rank(?P<rank>[0-9]{5})$")


def _series(tiers: List[Any], user: str, key: str) -> Tuple[str, int, int]:
    """``(base key, rank, world size)`` of KEY as the Restorer names it (a multi-rank
    shard is stored as ``<base>.rankNNNNN`` with ``rank``/``world_size`` in its meta)."""
    newest = None
    for tier in tiers:
        try:
            steps = tier.steps(user, key)
        except (TierError, OSError):
            continue
        if steps and (newest is None or steps[-1].step > newest.step):
            newest = steps[-1]
    if newest is not None:
        meta = newest.manifest.meta or {}
        ws, rank = int(meta.get("world_size", 1) or 1), int(meta.get("rank", 0) or 0)
        m = _RANK_RE.match(key)
        if ws > 1 and m and int(m.group("rank")) == rank:
            return m.group("base"), rank, ws
    return key, 0, 1


def _drilled_series(tiers: Dict[str, Any], user: str, key: str) -> str:
    """``key`` itself when it has checkpoints; for a multi-rank job's key (only
    ``KEY.rankNNNNN`` series exist), rank 0's series: what a restart of rank 0 reads; for
    a DCP job's key (``KEY.dcp.rankNNNNN`` parts), rank 0's part likewise."""
    from slurm_ckpt.ops.catalog import series_under

    found = series_under(tiers, user, key)
    rank0 = next((k for k in (f"{key}.rank00000", f"{key}.dcp.rank00000") if k in found), None)
    if found == [key] or rank0 is None:
        return key
    for tier in tiers.values():
        try:
            if tier.steps(user, key):
                return key
        except (TierError, OSError):
            continue
    return rank0


def _scratch_dir(base: Optional[str], tier_root: str, user: str) -> str:
    """A fresh private directory for the copy (caller removes it)."""
    if base is None:
        # As root: in the tier root (only root writes there); as a user: in their own
        # directory of that tier (names starting with '.' are never listed as keys).
        own = os.path.join(tier_root, user)
        base = own if os.geteuid() != 0 and os.path.isdir(own) else tier_root
    try:
        return tempfile.mkdtemp(prefix=".slurm_ckpt-drill-", dir=base)
    except OSError as exc:
        raise TierError(f"scratch space {base}: {exc.strerror or exc}") from None


def _scratch_root(cfg: Config, tier: Any) -> str:
    """Where the scratch copy of a checkpoint on ``tier`` goes by default: that tier's own
    root (a POSIX tier: where a restart reads from); for an object-store copy, which a
    restart reads into memory, the local tier when this host has one, else the system's
    temporary directory (a login node)."""
    root = getattr(tier, "root", None)
    if root is not None:
        return str(root)
    local = str(cfg.tiers.local.root)
    return local if os.path.isdir(local) else tempfile.gettempdir()


def _identity(value: int) -> int:
    return value


def run_drill(
    cfg: Config,
    key: str,
    user: Optional[str] = None,
    scratch: Optional[str] = None,
    progress: Optional[ProgressFn] = None,
) -> Dict[str, Any]:
    """Run the drill (see the module docstring); the report as a dict.
    ``progress(nbytes)`` hears of every byte copied and verified."""
    from slurm_ckpt.job.restore import Restorer, shard_key
    from slurm_ckpt.job.state import INDEX_NAME
    from slurm_ckpt.tiers.copy import copy_checkpoint
    from slurm_ckpt.tiers.registry import directory_tier, tiers_from_config

    user = validate_user(user) if user else current_user()
    validate_key(key)
    tiers = tiers_from_config(cfg)
    # What Checkpointer.restore() looks at: every configured tier, fastest first (local,
    # pfs, object, cold).
    order = list(tiers.values())
    key = _drilled_series(tiers, user, key)
    base, rank, ws = _series(order, user, key)
    restorer = Restorer(order, user, base, rank, ws)
    own = restorer.own_steps()
    own_key = shard_key(base, rank, ws)
    skipped: List[Dict[str, Any]] = []
    report: Dict[str, Any] = {"user": user, "key": key, "ok": False, "skipped": skipped}
    t_start = time.monotonic()
    for step in restorer.complete_steps():
        for tier, manifest in own.get(step, []):
            parent = _scratch_dir(scratch, _scratch_root(cfg, tier), user)
            try:
                dst = directory_tier(
                    "scratch", parent, chunk_size=tier.chunk_size, streams=cfg.copy.streams
                )
                t0 = time.monotonic()
                try:
                    res = copy_checkpoint(tier, dst, user, own_key, step, progress=progress)
                except (VerifyError, TierError, NotFound) as exc:
                    skipped.append({"tier": tier.name, "step": step, "error": str(exc)})
                    continue
                copy_s = time.monotonic() - t0
                index = f"{restorer.prefix}/{INDEX_NAME}"
                is_state = any(f.path == index for f in manifest.files)
                report.update(
                    ok=True,
                    step=step,
                    tokens=manifest.tokens,
                    tier=tier.name,
                    path=tier.step_path(user, own_key, step),
                    scratch=parent,
                    bytes=res.nbytes,
                    copy_s=round(copy_s, 4),
                    copy_rate_bps=round(res.nbytes / copy_s) if copy_s > 0 else None,
                )
                if not is_state:
                    report.update(
                        payload="files",
                        load="verified only (not a slurm_ckpt state)",
                        time_to_weights_s=None,
                        time_to_full_state_s=round(copy_s, 4),
                    )
                    return report
                loader = Restorer([dst], user, base, rank, ws, agree=_identity)
                t1 = time.monotonic()
                weights = loader.restore(weights_only=True)
                if weights is None or weights.step != step:
                    where = dst.where(user, own_key, step)
                    raise VerifyError(f"{where}: scratch copy not loadable")
                weights_s = time.monotonic() - t1
                t2 = time.monotonic()
                rest = loader.restore_rest()
                rest_s = time.monotonic() - t2
                report.update(
                    payload="state",
                    load="torch" if _has_torch([weights.state, rest.state]) else "numpy",
                    tensors=_count_leaves(weights.state) + _count_leaves(rest.state),
                    weights_load_s=round(weights_s, 4),
                    rest_load_s=round(rest_s, 4),
                    time_to_weights_s=round(copy_s + weights_s, 4),
                    time_to_full_state_s=round(copy_s + weights_s + rest_s, 4),
                )
                return report
            except (VerifyError, TierError, NotFound) as exc:
                report["ok"] = False
                skipped.append({"tier": tier.name, "step": step, "error": str(exc)})
            finally:
                shutil.rmtree(parent, ignore_errors=True)
    report["seconds"] = round(time.monotonic() - t_start, 4)
    return report


def _leaves(obj: Any) -> List[Any]:
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _leaves(v)]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in _leaves(v)]
    return [obj]


def _has_torch(obj: Any) -> bool:
    return any(type(x).__module__.startswith("torch") for x in _leaves(obj))


def _count_leaves(obj: Any) -> int:
    return sum(1 for x in _leaves(obj) if hasattr(x, "shape") and hasattr(x, "dtype"))
