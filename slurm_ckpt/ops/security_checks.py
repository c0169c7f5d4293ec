"""``ckpt-slurm doctor``'s security findings: what a user controls that root would use.

* **squatted user directories** on every tier, and in the partner rendezvous directory
  (``[partner] dir``): ``<root>/<name>`` owned by another user than ``name`` (made first
  on a root every user may write). Root's hooks and the user's own job both refuse such
  a directory, so nothing of ``name``'s is flushed there (or, in ``[partner] dir``, its
  jobs make no partner copies); the admin must move it aside - the finding says how;
* **node statuses** root would not trust (files in ``<pfs>/.slurm_ckpt/nodes`` that root
  did not write): ignored by ``maint``/``guard``/``status``, worth knowing about;
* **the config and the executable** root runs with: writable by a user at any level of
  their paths (:func:`~slurm_ckpt.ops.config_check.check_trust`).

No click here: :mod:`slurm_ckpt.ops.doctor` collects the findings.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, List, Tuple

from slurm_ckpt.core import trust
from slurm_ckpt.core.config import Config
from slurm_ckpt.core.names import validate_user
from slurm_ckpt.errors import InvalidName
from slurm_ckpt.ledger.status_store import status_store
from slurm_ckpt.ops.tier_roots import directory_roots

__all__ = ["PARTNER_DIR", "check_security", "squatted_dirs"]

#: How findings and ``status`` name the partner rendezvous directory (``[partner] dir``).
PARTNER_DIR = "partner-rendezvous"

#: Names looked at per tier root (a login node's PFS may hold many users).
_MAX_NAMES = 100_000


def squatted_dirs(root: Path) -> List[Any]:
    """``(path, user, owner uid)`` of every squatted ``<root>/<user>``."""
    out: List[Any] = []
    try:
        names = os.listdir(root)
    except OSError:
        return out
    for name in sorted(names)[:_MAX_NAMES]:
        try:
            validate_user(name)
        except InvalidName:
            continue
        path = root / name
        try:
            st = os.lstat(path)
        except OSError:
            continue
        owner = trust.squatter(st, name)
        if owner is not None:
            out.append((path, name, owner))
    return out


def check_security(cfg: Config, finding: Any) -> List[Any]:
    """The findings (built with ``finding(check, severity, message, fix)``)."""
    out: List[Any] = []
    # Every directory tier (an object store has no owners), whatever its kind.
    roots: List[Tuple[str, Any]] = list(directory_roots(cfg))
    if cfg.partner.dir is not None:
        roots.append((PARTNER_DIR, cfg.partner.dir))
    bad = 0
    for tier, root in roots:
        for path, name, owner in squatted_dirs(Path(root)):
            bad += 1
            text = trust.squat_message(f"{tier}:{path}", name, owner)
            msg, _sep, fix = text.partition(" (fix, as root: ")
            what = "partner copies are off" if tier == PARTNER_DIR else "flushes are refused"
            out.append(
                finding(
                    "squatted",
                    "error",
                    f"{msg}: {name}'s {what} until it is fixed",
                    fix.rstrip(")"),
                )
            )
    if not bad:
        out.append(finding("squatted", "ok", "no user directory is owned by another user"))
    notes: List[str] = []
    status_store(cfg).read(notes)  # the PFS, or signed objects in the bucket
    for text in notes[:10]:
        out.append(
            finding(
                "node_status",
                "warn",
                f"{text}: maint, guard and status ignore it",
                "remove it; root's hooks publish their own (a bad directory is moved aside)",
            )
        )
    from slurm_ckpt.ops.config_check import ERROR, check_trust

    for f in check_trust(cfg):
        out.append(
            finding(
                "trust",
                "error" if f.level == ERROR else "warn",
                f.text,
                "install slurm_ckpt into a root-owned venv for the hooks"
                if "installation" in f.text
                else "make it root's: chown root, chmod go-w (each directory on the way too)",
            )
        )
    return out
