"""The node checks a job needs, and the guard over root's own ledger directory.

Root runs the hooks over directories users write. The guards over a user's checkpoints
belong to each tier kind (:meth:`~slurm_ckpt.tiers.base.Tier.guard_user`,
:meth:`~slurm_ckpt.tiers.base.Tier.guard_step`; the POSIX ones in
:mod:`slurm_ckpt.tiers.posix_guard`, their errors in :mod:`slurm_ckpt.tiers.unsafe`,
named here too for the hooks). What stays here is the node's: is the ledger directory
root's alone, is the local tier mounted with room for a job, and a permission the owner
denied on their own tree (:class:`OwnPermissionDenied`).
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from slurm_ckpt.core import fsio, trust
from slurm_ckpt.core.config import Config
from slurm_ckpt.core.units import format_bytes
from slurm_ckpt.errors import EXIT_FAILED, CkptError
from slurm_ckpt.tiers.posix_guard import MAX_DEPTH, MAX_ENTRIES
from slurm_ckpt.tiers.unsafe import SquattedUserDir, Unflushable, UnsafeCheckpoint, UnsafeUserDir

log = logging.getLogger(__name__)

__all__ = [
    "MAX_DEPTH",
    "MAX_ENTRIES",
    "NodeCheckFailed",
    "OwnPermissionDenied",
    "SquattedUserDir",
    "UnsafeCheckpoint",
    "UnsafeUserDir",
    "check_local_tier",
    "ensure_ledger_dir",
    "required_free",
]


class NodeCheckFailed(CkptError):
    """A node check failed: the local tier cannot take a job's checkpoints."""

    exit_code = EXIT_FAILED


class OwnPermissionDenied(Unflushable):
    """Permission denied below the owner's own directories (``chmod 000`` on their
    payload file, ``chmod 500`` on their PFS user or key directory): only the owner can
    have set those modes. Held (destination ``FAILED``), retried after its backoff."""

    hold_code = "permission"
    bad_source = False


def ensure_ledger_dir(path: Path) -> None:
    """Make sure the ledger directory is root's alone.

    Root opens the ledger and its lock file by path; in a directory a user can write,
    a planted symlink would turn that into a write anywhere. So the directory must be a
    real directory owned by root and writable by no one else. Anything else sitting at
    that name (a user's directory, a symlink, a file) is moved aside, never followed or
    deleted, and a fresh directory is made (:func:`~slurm_ckpt.core.trust.ensure_private_dir`).
    """
    parent = path.parent
    try:
        pfd = fsio.open_dir(str(parent))
    except OSError as exc:
        raise fsio.tier_error(exc, f"ledger parent directory {parent}") from None
    try:
        os.close(trust.ensure_private_dir(pfd, path.name, f"ledger directory {path}"))
    except OSError as exc:
        raise fsio.tier_error(exc, f"ledger directory {path}") from None
    finally:
        os.close(pfd)


def required_free(cfg: Config) -> int:
    """Bytes that must be free on the local tier for a job to start."""
    need = cfg.tiers.local.min_free
    if cfg.hooks.expected_checkpoint_size:
        need += cfg.hooks.expected_checkpoint_size * (cfg.retention.keep_local + 1)
    return need


def _explain_need(cfg: Config) -> str:
    parts = []
    if cfg.hooks.expected_checkpoint_size:
        parts.append(
            f"hooks.expected_checkpoint_size {format_bytes(cfg.hooks.expected_checkpoint_size)}"
            f" x (retention.keep_local {cfg.retention.keep_local} + 1)"
        )
    parts.append(f"tiers.local.min_free {format_bytes(cfg.tiers.local.min_free)}")
    return " + ".join(parts)


def check_local_tier(cfg: Config, check_space: bool = True) -> int:
    """Root exists, is a mount of its own (unless allowed otherwise), has room.

    Returns the free bytes. Raises :class:`NodeCheckFailed` with the reason.
    """
    root = str(cfg.tiers.local.root)
    try:
        st = os.stat(root)
    except FileNotFoundError:
        raise NodeCheckFailed(f"local tier root {root} does not exist") from None
    except OSError as exc:
        raise NodeCheckFailed(str(fsio.tier_error(exc, f"local tier root {root}"))) from None
    if not stat.S_ISDIR(st.st_mode):
        raise NodeCheckFailed(f"local tier root {root} is not a directory")
    if cfg.tiers.local.require_mount and st.st_dev == os.stat("/").st_dev:
        raise NodeCheckFailed(
            f"local tier root {root} is on the root filesystem, not a mount of its own "
            "(set tiers.local.require_mount = false to allow)"
        )
    sv = os.statvfs(root)
    free = sv.f_bavail * sv.f_frsize
    if check_space:
        need = required_free(cfg)
        if free < need:
            raise NodeCheckFailed(
                f"local tier {root}: {format_bytes(free)} free, need {format_bytes(need)} "
                f"({_explain_need(cfg)})"
            )
    return free
