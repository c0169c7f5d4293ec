"""What a node owes, published where login nodes can read it.

Each node's root-run hooks write a small JSON summary of its ledger (pending flushes,
copies in flight, failures, per-job progress) to
``<pfs root>/.slurm_ckpt/nodes/<node>.json``; ``ckpt-slurm status``, ``maint`` and
``guard`` on login nodes read them instead of reaching into every node.

``maint`` reboots a node when its status says nothing is left to flush, so these files
are trusted only when root wrote them where only root can: ``.slurm_ckpt`` and
``nodes`` are created by root, mode 0755, and one that is anything else (a directory a
user made first on a 1777 PFS root, a symlink) is moved aside before root writes
(:func:`~slurm_ckpt.core.trust.ensure_private_dir`); a reader takes a file only when the
directories and the file are root's, not writable by anyone else, and the file is a
regular file with one link. A training job never writes here: it publishes its own
status in its user's directory (:mod:`slurm_ckpt.ledger.user_status`).

Every status carries ``seq``, a per-node sequence number that only grows (the larger of
the last one this node published, plus one, and the time in microseconds: a ledger
directory lost with a reimaged disk does not start it again at 1), next to ``time``, the
moment root published it. A reader that decides (``maint``, ``guard``) takes only a
status newer than the moment it saw the node's jobs gone, with a ``seq`` above every one
it saw before: a status replayed from earlier, even one signed by root, is stale.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path
from typing import Any, Dict, List, Optional

from slurm_ckpt.core import fsio, trust
from slurm_ckpt.core.config import LEDGER_SUBDIR
from slurm_ckpt.core.names import validate_node
from slurm_ckpt.errors import TierError
from slurm_ckpt.ledger.codec import VERSION
from slurm_ckpt.ledger.ledger import Ledger
from slurm_ckpt.ledger.record import (
    FAILED_STATES,
    LIVE_LOCAL,
    WARM_SLOT,
    State,
    is_held,
    is_pending,
)

log = logging.getLogger(__name__)

__all__ = [
    "STATUS_FORMAT",
    "node_status",
    "open_status_dir",
    "next_seq",
    "publish_status",
    "published_status",
    "read_node_statuses",
    "status_path",
    "status_seq",
]

STATUS_FORMAT = "slurm_ckpt.node_status"
SEQ_NAME = "status-seq"
_MAX_STATUS_BYTES = 4 * 1024 * 1024
_STATUS_LIST_CAP = 50
_STALE_STATUS_TMP_S = 3600.0


def node_status(
    ledger: Ledger, extra: Optional[Dict[str, Any]] = None, user: Optional[str] = None
) -> Dict[str, Any]:
    """The summary of ``ledger`` that :func:`publish_status` writes (``user``: of that
    user's records only). ``pending`` counts everything owed to the PFS; ``drain`` what
    of it keeps the node drained (not held: see :func:`~slurm_ckpt.ledger.record.is_held`)."""
    data = ledger.snapshot()
    now = ledger.clock()
    pending_count = pending_bytes = 0
    drain_count = drain_bytes = held_count = 0
    in_flight: List[Dict[str, Any]] = []
    failed: List[Dict[str, Any]] = []
    jobs: Dict[str, Dict[str, Any]] = {}
    job_user: Dict[str, str] = {}
    for raw in Ledger.select(data, user, None, None):
        tiers = raw.get("tiers") or {}
        job = str(raw.get("job"))
        # A job id comes from a manifest, which its user writes: one user claiming
        # another's job id gets an entry of their own ("<job>#<user>"), never a share
        # of the other's.
        first = job_user.setdefault(job, raw["user"])
        if first != raw["user"]:
            job = f"{job}#{raw['user']}"
        js = jobs.setdefault(
            job,
            {
                "user": raw["user"],
                "checkpoints": 0,
                "pending": 0,
                "pending_bytes": 0,
                "in_flight": 0,
                "failed": 0,
                "keys": [],
                "latest_step": None,
                "latest_warm_verified_step": None,
                # The old name of latest_warm_verified_step, kept one release for readers
                # of an older version (mixed-version clusters).
                "latest_pfs_verified_step": None,
                "last_commit_at": None,
                "partner_copies": 0,
                "latest_partner_step": None,
            },
        )
        js["checkpoints"] += 1
        uk = f"{raw['user']}/{raw['key']}"
        if uk not in js["keys"]:
            js["keys"].append(uk)
        step = raw["step"]
        if tiers.get("local") in LIVE_LOCAL:
            js["latest_step"] = max(step, js["latest_step"] or 0)
            if raw.get("partner_of"):  # another node's checkpoint, copied here
                js["partner_copies"] += 1
                js["latest_partner_step"] = max(step, js["latest_partner_step"] or 0)
        if tiers.get(WARM_SLOT) == State.VERIFIED.value:
            newest = max(step, js["latest_warm_verified_step"] or 0)
            js["latest_warm_verified_step"] = js["latest_pfs_verified_step"] = newest
        committed = (raw.get("committed_at") or {}).get("local")
        if committed is not None:
            js["last_commit_at"] = max(committed, js["last_commit_at"] or 0.0)
        if is_pending(tiers, raw.get("selected_for_flush"), raw.get("forced")):
            pending_count += 1
            pending_bytes += int(raw.get("nbytes", 0))
            js["pending"] += 1
            js["pending_bytes"] += int(raw.get("nbytes", 0))
            if is_held(raw):
                held_count += 1
            else:
                drain_count += 1
                drain_bytes += int(raw.get("nbytes", 0))
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
                        "hold": raw.get("hold"),
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
        "drain": {"count": drain_count, "bytes": drain_bytes},
        "held_count": held_count,
        "in_flight": in_flight[:_STATUS_LIST_CAP],
        "in_flight_count": len(in_flight),
        "failed": failed[:_STATUS_LIST_CAP],
        "failed_count": len(failed),
        "failures": dict(data.failures),
        "jobs": jobs,
        "extra": dict(extra or {}),
    }


def next_seq(ledger: Ledger, now: float) -> int:
    """The next sequence number of ``ledger``'s node (see the module docstring), kept in
    ``<ledger dir>/status-seq`` (root's own directory, like the ledger).
    Without a usable file the time alone still orders this node's statuses."""
    last = 0
    try:
        dfd = fsio.open_dir(str(ledger.directory))
    except OSError:
        return int(now * 1e6)
    try:
        try:
            last = int(fsio.read_small(dfd, SEQ_NAME, 64).decode().strip() or 0)
        except (OSError, ValueError, UnicodeDecodeError):
            last = 0
        seq = max(last + 1, int(now * 1e6))
        try:
            fsio.atomic_replace(dfd, SEQ_NAME, f"{seq}\n".encode(), 0o644, durable=False)
        except OSError as exc:
            log.warning("status sequence not saved in %s: %s", ledger.directory, exc)
        return seq
    finally:
        os.close(dfd)


def published_status(ledger: Ledger, extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """:func:`node_status` with the next ``seq``: what a publisher writes."""
    doc = node_status(ledger, extra)
    doc["seq"] = next_seq(ledger, doc["time"])
    return doc


def status_seq(doc: Dict[str, Any]) -> Optional[int]:
    """A status's ``seq`` (None when absent or not an integer: such a status never
    decides)."""
    seq = doc.get("seq")
    return seq if isinstance(seq, int) and not isinstance(seq, bool) else None


def publish_status(ledger: Ledger, pfs_root: Path, extra: Optional[Dict[str, Any]] = None) -> Path:
    """Write ``ledger``'s node status to ``<pfs_root>/.slurm_ckpt/nodes/<node>.json``.

    Atomic and symlink-safe: the directories below ``pfs_root`` are opened with
    ``O_NOFOLLOW`` and must be this process's own (see the module docstring: anything
    else is moved aside), and the file is replaced with
    :func:`~slurm_ckpt.core.fsio.atomic_replace`.
    """
    blob = json.dumps(published_status(ledger, extra), separators=(",", ":"), default=str)
    blob = blob.encode()
    root = Path(pfs_root)
    final = status_path(root, ledger.node)
    dir_fd = open_status_dir(root)
    try:
        fsio.remove_stale_temps(dir_fd, final.name, _STALE_STATUS_TMP_S, ledger.clock())
        fsio.atomic_replace(dir_fd, final.name, blob, 0o644)
    except OSError as exc:
        raise TierError(f"cannot write node status {final}: {exc.strerror or exc}") from exc
    finally:
        os.close(dir_fd)
    return final


def open_status_dir(pfs_root: Path) -> int:
    """``<pfs_root>/.slurm_ckpt/nodes``, made and checked as this process's own (see
    the module docstring); the fd (the caller closes it), or TierError."""
    root = Path(pfs_root)
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise TierError(f"PFS root {root} is not usable: {exc.strerror or exc}") from exc
    fd = root_fd
    where = root
    try:
        for part in (LEDGER_SUBDIR, "nodes"):
            where = where / part
            try:
                child = trust.ensure_private_dir(fd, part, str(where))
            except OSError as exc:
                raise TierError(f"cannot use {where}: {exc.strerror or exc}") from exc
            os.close(fd)
            fd = child
        return fd
    except BaseException:
        os.close(fd)
        raise


def status_path(pfs_root: Path, node: str) -> Path:
    """Where ``node`` publishes its status below ``pfs_root``."""
    return Path(pfs_root) / ".slurm_ckpt" / "nodes" / f"{validate_node(node)}.json"


def read_node_statuses(
    pfs_root: Path, problems: Optional[List[str]] = None
) -> List[Dict[str, Any]]:
    """Every *trusted* node status under ``<pfs_root>/.slurm_ckpt/nodes``, sorted by node
    name: root's files in root's directories (see the module docstring). Anything else -
    a directory a user made, a symlink, a file a user wrote or linked in, an oversized or
    corrupt one - is skipped with a warning (and a line in ``problems``); a missing
    directory gives an empty list."""
    notes: List[str] = [] if problems is None else problems
    base = Path(pfs_root)
    try:
        fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            log.warning("cannot read node statuses in %s: %s", base, exc.strerror or exc)
        return []
    where = base
    try:
        for part in (LEDGER_SUBDIR, "nodes"):
            where = where / part
            try:
                child = os.open(part, fsio.O_DIR, dir_fd=fd)
            except FileNotFoundError:
                return []
            except OSError as exc:
                _skip(notes, f"{where}: {fsio.tier_error(exc, 'open')}; node statuses ignored")
                return []
            os.close(fd)
            fd = child
            why = trust.unsafe_dir(os.fstat(fd), trust.ROOT_UID)
            if why is not None:
                _skip(notes, f"{where} is {why}, not root's: node statuses there ignored")
                return []
        try:
            names = sorted(os.listdir(fd))
        except OSError as exc:
            _skip(notes, f"cannot list node statuses in {where}: {exc.strerror or exc}")
            return []
        out: List[Dict[str, Any]] = []
        for name in names:
            if not name.endswith(".json") or name.startswith("."):
                continue
            doc = _read_trusted(fd, name, where / name, notes)
            if doc is not None:
                out.append(doc)
        out.sort(key=lambda d: d["node"])
        return out
    finally:
        os.close(fd)


def _skip(notes: List[str], text: str) -> None:
    log.warning("%s", text)
    notes.append(text)


def _read_trusted(dfd: int, name: str, path: Path, notes: List[str]) -> Optional[Dict[str, Any]]:
    """One node status file, if root wrote it (else None, noted)."""
    try:
        blob, st = fsio.read_regular(dfd, name, _MAX_STATUS_BYTES)
    except OSError as exc:
        _skip(notes, f"skipping node status {path}: {exc.strerror or exc}")
        return None
    if st.st_uid != trust.ROOT_UID or st.st_mode & 0o022:
        _skip(notes, f"skipping node status {path}: not written by root (uid {st.st_uid})")
        return None
    try:
        doc = json.loads(blob)
    except (ValueError, UnicodeDecodeError):
        _skip(notes, f"skipping node status {path}: not valid JSON")
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("node"), str):
        _skip(notes, f"skipping node status {path}: not a node status")
        return None
    if doc["node"] != name[: -len(".json")]:
        _skip(notes, f"skipping node status {path}: it is about node {doc['node']!r}")
        return None
    return doc
