"""What a training job publishes about itself: a per-user status, never the node's.

A job runs as its user, so anything it writes is the user's to forge. It therefore never
writes the node status that ``maint`` and ``guard`` decide on
(:mod:`slurm_ckpt.ledger.node_status`: root's alone). It writes its own progress - the
same summary, of its own user's records - into the user's own PFS directory::

    <pfs root>/<user>/.slurm_ckpt/nodes/<node>.json

``ckpt-slurm status`` reads these for the *job* rows (steps at risk while a job runs,
between the hooks' publications), never for node readiness or drains. A reader takes a
file only from a real directory ``<pfs>/<user>`` owned by that user (not squatted), as
a regular file with one link owned by that user, and only the job entries whose series
belong to that user: a user can say things about their own jobs, nothing else.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

from slurm_ckpt.core import fsio, trust
from slurm_ckpt.core.config import LEDGER_SUBDIR
from slurm_ckpt.core.config_schema import PFS
from slurm_ckpt.core.names import validate_node, validate_user
from slurm_ckpt.errors import CkptError, TierError
from slurm_ckpt.ledger.ledger import Ledger
from slurm_ckpt.ledger.node_status import node_status

log = logging.getLogger(__name__)

__all__ = ["publish_user_status", "read_user_statuses"]

_MAX_BYTES = 4 * 1024 * 1024


def publish_user_status(ledger: Ledger, pfs_root: Path, user: str) -> Path:
    """Write ``user``'s records of ``ledger`` to their own status file on the PFS (this
    process must be that user, or root)."""
    validate_user(user)
    node = validate_node(ledger.node)
    doc = node_status(ledger, None, user=user)
    doc["user"] = user
    blob = json.dumps(doc, separators=(",", ":"), default=str).encode()
    where = Path(pfs_root) / user / LEDGER_SUBDIR / "nodes"
    try:
        rfd = fsio.open_dir(str(pfs_root))
        try:
            dfd = trust.open_user_subdir(rfd, user, [LEDGER_SUBDIR, "nodes"], True, PFS)
        finally:
            os.close(rfd)
        try:
            fsio.atomic_replace(dfd, f"{node}.json", blob, 0o600, durable=False)
        finally:
            os.close(dfd)
    except OSError as exc:
        raise TierError(f"cannot write {where}/{node}.json: {exc.strerror or exc}") from exc
    return where / f"{node}.json"


def read_user_statuses(pfs_root: Path, users: Iterable[str]) -> List[Dict[str, Any]]:
    """The per-user statuses of ``users`` this process may read (see the module
    docstring for what is trusted); each carries ``user`` and only that user's jobs."""
    out: List[Dict[str, Any]] = []
    try:
        rfd = fsio.open_dir(str(pfs_root))
    except OSError:
        return out
    try:
        for user in users:
            try:
                dfd = trust.open_user_subdir(
                    rfd, validate_user(user), [LEDGER_SUBDIR, "nodes"], False, PFS
                )
            except (OSError, CkptError):
                continue  # none, not readable by us, or squatted
            try:
                owner = os.fstat(dfd).st_uid
                for name in sorted(os.listdir(dfd)):
                    if name.endswith(".json") and not name.startswith("."):
                        doc = _read(dfd, name, user, owner)
                        if doc is not None:
                            out.append(doc)
            except OSError:
                pass
            finally:
                os.close(dfd)
    finally:
        os.close(rfd)
    return out


def _read(dfd: int, name: str, user: str, owner: int) -> Optional[Dict[str, Any]]:
    try:
        blob, st = fsio.read_regular(dfd, name, _MAX_BYTES)
        doc = json.loads(blob)
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if st.st_uid != owner or not isinstance(doc, dict) or not isinstance(doc.get("node"), str):
        return None
    jobs = doc.get("jobs") if isinstance(doc.get("jobs"), dict) else {}
    mine = {
        job: js
        for job, js in jobs.items()
        if isinstance(js, dict)
        and all(str(k).split("/", 1)[0] == user for k in js.get("keys") or [])
    }
    return {
        "node": doc["node"],
        "time": doc.get("time"),
        "user": user,
        "jobs": mine,
        "failed": [
            f for f in doc.get("failed") or [] if isinstance(f, dict) and f.get("user") == user
        ],
    }
