"""What a node owes, published where login nodes can read it.

Each node writes a small JSON summary of its ledger (pending flushes, copies in flight,
failures, per-job progress) to ``<pfs root>/.slurm_ckpt/nodes/<node>.json``; ``ckpt-slurm
status`` and ``maint`` on login nodes read them instead of reaching into every node.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import stat
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from slurm_ckpt.core import fsio
from slurm_ckpt.core.names import validate_node
from slurm_ckpt.errors import TierError
from slurm_ckpt.ledger.codec import VERSION
from slurm_ckpt.ledger.ledger import Ledger
from slurm_ckpt.ledger.record import FAILED_STATES, LIVE_LOCAL, State, is_pending

log = logging.getLogger("slurm_ckpt.ledger")

__all__ = [
    "STATUS_FORMAT",
    "node_status",
    "publish_status",
    "read_node_statuses",
    "status_path",
]

STATUS_FORMAT = "slurm_ckpt.node_status"
_MAX_STATUS_BYTES = 4 * 1024 * 1024
_STATUS_LIST_CAP = 50
_STALE_STATUS_TMP_S = 3600.0


def node_status(ledger: Ledger, extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The summary of ``ledger`` that :func:`publish_status` writes."""
    data = ledger.snapshot()
    now = ledger.clock()
    pending_count = pending_bytes = 0
    in_flight: List[Dict[str, Any]] = []
    failed: List[Dict[str, Any]] = []
    jobs: Dict[str, Dict[str, Any]] = {}
    for raw in Ledger.select(data, None, None, None):
        tiers = raw.get("tiers") or {}
        job = str(raw.get("job"))
        js = jobs.setdefault(
            job,
            {
                "checkpoints": 0,
                "pending": 0,
                "pending_bytes": 0,
                "in_flight": 0,
                "failed": 0,
                "keys": [],
                "latest_step": None,
                "latest_pfs_verified_step": None,
                "last_commit_at": None,
            },
        )
        js["checkpoints"] += 1
        uk = f"{raw['user']}/{raw['key']}"
        if uk not in js["keys"]:
            js["keys"].append(uk)
        step = raw["step"]
        if tiers.get("local") in LIVE_LOCAL:
            js["latest_step"] = max(step, js["latest_step"] or 0)
        if tiers.get("pfs") == State.VERIFIED.value:
            js["latest_pfs_verified_step"] = max(step, js["latest_pfs_verified_step"] or 0)
        committed = (raw.get("committed_at") or {}).get("local")
        if committed is not None:
            js["last_commit_at"] = max(committed, js["last_commit_at"] or 0.0)
        if is_pending(tiers, raw.get("selected_for_flush"), raw.get("forced")):
            pending_count += 1
            pending_bytes += int(raw.get("nbytes", 0))
            js["pending"] += 1
            js["pending_bytes"] += int(raw.get("nbytes", 0))
        for tier, st in tiers.items():
            if st == State.FLUSHING.value:
                js["in_flight"] += 1
                in_flight.append(
                    {
                        "user": raw["user"],
                        "key": raw["key"],
                        "step": step,
                        "tier": tier,
                        "nbytes": raw.get("nbytes", 0),
                        "since": (raw.get("flush_started_at") or {}).get(tier),
                        "attempts": raw.get("attempts", 0),
                    }
                )
            elif st in FAILED_STATES:
                js["failed"] += 1
                failed.append(
                    {
                        "user": raw["user"],
                        "key": raw["key"],
                        "step": step,
                        "tier": tier,
                        "state": st,
                        "reason": raw.get("error"),
                        "attempts": raw.get("attempts", 0),
                        "at": raw.get("updated_at"),
                    }
                )
    failed.sort(key=lambda f: f.get("at") or 0.0, reverse=True)
    return {
        "format": STATUS_FORMAT,
        "version": VERSION,
        "node": ledger.node,
        "time": now,
        "records": len(data.records),
        "pending": {"count": pending_count, "bytes": pending_bytes},
        "in_flight": in_flight[:_STATUS_LIST_CAP],
        "in_flight_count": len(in_flight),
        "failed": failed[:_STATUS_LIST_CAP],
        "failed_count": len(failed),
        "failures": dict(data.failures),
        "jobs": jobs,
        "extra": dict(extra or {}),
    }


def publish_status(ledger: Ledger, pfs_root: Path, extra: Optional[Dict[str, Any]] = None) -> Path:
    """Write ``ledger``'s node status to ``<pfs_root>/.slurm_ckpt/nodes/<node>.json``.

    Atomic and symlink-safe: the directories below ``pfs_root`` are opened with
    ``O_NOFOLLOW`` and the file is replaced with :func:`~slurm_ckpt.core.fsio.atomic_replace`.
    """
    blob = json.dumps(node_status(ledger, extra), separators=(",", ":"), default=str).encode()
    root = Path(pfs_root)
    final = status_path(root, ledger.node)
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise TierError(f"PFS root {root} is not usable: {exc.strerror or exc}") from exc
    try:
        dir_fd = _open_subdir(root_fd, (".slurm_ckpt", "nodes"), root)
    finally:
        os.close(root_fd)
    try:
        fsio.remove_stale_temps(dir_fd, final.name, _STALE_STATUS_TMP_S, ledger.clock())
        fsio.atomic_replace(dir_fd, final.name, blob, 0o644)
    except OSError as exc:
        raise TierError(f"cannot write node status {final}: {exc.strerror or exc}") from exc
    finally:
        os.close(dir_fd)
    return final


def _open_subdir(parent_fd: int, parts: Tuple[str, ...], root: Path) -> int:
    """Open (creating, mode 0o755) ``parts`` below ``parent_fd`` without following links."""
    fd = os.dup(parent_fd)
    where = root
    try:
        for part in parts:
            where = where / part
            try:
                os.mkdir(part, 0o755, dir_fd=fd)
                with contextlib.suppress(OSError):
                    os.chmod(part, 0o755, dir_fd=fd, follow_symlinks=False)
            except FileExistsError:
                pass
            try:
                child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise TierError(f"{where} is not a directory (symlink?); refusing") from exc
                raise TierError(f"cannot open {where}: {exc.strerror or exc}") from exc
            os.close(fd)
            fd = child
        return fd
    except BaseException:
        os.close(fd)
        raise


def status_path(pfs_root: Path, node: str) -> Path:
    """Where ``node`` publishes its status below ``pfs_root``."""
    return Path(pfs_root) / ".slurm_ckpt" / "nodes" / f"{validate_node(node)}.json"


def read_node_statuses(pfs_root: Path) -> List[Dict[str, Any]]:
    """Every node status under ``<pfs_root>/.slurm_ckpt/nodes``, sorted by node name.

    Unreadable, oversized, non-regular (symlinks included) or corrupt files are skipped
    with a warning; a missing directory gives an empty list.
    """
    directory = Path(pfs_root) / ".slurm_ckpt" / "nodes"
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    except OSError as exc:
        log.warning("cannot list node statuses in %s: %s", directory, exc.strerror or exc)
        return []
    out: List[Dict[str, Any]] = []
    for name in names:
        if not name.endswith(".json") or name.startswith("."):
            continue
        path = directory / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            log.warning("skipping node status %s: %s", path, exc.strerror or exc)
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                log.warning("skipping node status %s: not a regular file", path)
                continue
            if st.st_size > _MAX_STATUS_BYTES:
                log.warning("skipping node status %s: too large (%d bytes)", path, st.st_size)
                continue
            with os.fdopen(os.dup(fd), "rb") as fh:
                blob = fh.read(_MAX_STATUS_BYTES + 1)
        except OSError as exc:
            log.warning("skipping node status %s: %s", path, exc.strerror or exc)
            continue
        finally:
            os.close(fd)
        try:
            doc = json.loads(blob)
        except (ValueError, UnicodeDecodeError):
            log.warning("skipping node status %s: not valid JSON", path)
            continue
        if not isinstance(doc, dict) or not isinstance(doc.get("node"), str):
            log.warning("skipping node status %s: not a node status", path)
            continue
        out.append(doc)
    out.sort(key=lambda d: d["node"])
    return out
