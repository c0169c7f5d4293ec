"""Guards that keep root-run code safe over user data, and the node checks a job needs.

Root runs the hooks over directories users write. Before it touches anything there it
asks these guards: is ``<tier>/<user>`` really that user's own directory, is every file
of a checkpoint a regular file with one link owned by its user, is the ledger directory
root's alone, is the local tier mounted with room for a job. A checkpoint that fails a
guard is the owner's doing: it is marked and left alone (never a reason to keep a node
drained), see :class:`UnsafeCheckpoint`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from pathlib import Path

from slurm_ckpt.core import fsio
from slurm_ckpt.core.config import Config
from slurm_ckpt.core.units import format_bytes
from slurm_ckpt.errors import CkptError, TierError
from slurm_ckpt.node.flush import Unflushable
from slurm_ckpt.tiers.posix import PosixTier

log = logging.getLogger("slurm_ckpt.node")

__all__ = [
    "NodeCheckFailed",
    "UnsafeCheckpoint",
    "check_local_tier",
    "check_step_files",
    "check_user_dir",
    "ensure_ledger_dir",
    "required_free",
]


class NodeCheckFailed(CkptError):
    """A node check failed: the local tier cannot take a job's checkpoints."""

    exit_code = 1


class UnsafeCheckpoint(Unflushable):
    """A checkpoint holds something root-run code must not touch (a symlink, a special
    file, a hard link, a file of another owner). It is the owner's own doing, so it is
    marked ``BAD`` on its tier and left alone - it must not keep a node drained."""


def check_step_files(tier: PosixTier, user: str, key: str, step: int, uid: int) -> None:
    """Refuse a checkpoint that root-run code must not touch: anything but regular files,
    a file with more than one hard link (it may be someone else's file linked in), or a
    file not owned by ``uid``. Directories are walked with O_NOFOLLOW."""
    where = tier.where(user, key, step)
    with tier.step_fd(user, key, step) as sfd:
        try:
            files, problems = fsio.walk_files(sfd)
        except OSError as exc:
            raise fsio.tier_error(exc, where) from None
    if problems:
        raise UnsafeCheckpoint(f"{where}: {problems[0]}; refusing to touch it")
    for rel, st in files:
        if st.st_nlink != 1:
            raise UnsafeCheckpoint(
                f"{where}/{rel}: has {st.st_nlink} hard links; refusing to touch it"
            )
        if st.st_uid != uid:
            raise UnsafeCheckpoint(
                f"{where}/{rel}: owned by uid {st.st_uid}, not by {user} ({uid}); "
                "refusing to touch it"
            )


def check_user_dir(tier: PosixTier, user: str, uid: int) -> None:
    """``<tier root>/<user>`` must be the user's own: a real directory owned by ``uid`` that
    no one else can write. On a shared root that every user may write (mode 1777, as a
    PFS checkpoint root often is) another user could have created it first; writing a
    checkpoint into their directory would let them replace it (and a restore would load
    their bytes). A missing directory is fine: it is created by the user, mode 0700."""
    try:
        st = os.lstat(os.path.join(tier.root, user))
    except FileNotFoundError:
        return
    except OSError as exc:
        raise fsio.tier_error(exc, f"{tier.name}:{tier.root}/{user}") from None
    where = f"{tier.name}:{tier.root}/{user}"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise TierError(f"{where}: not a directory (symlink?); refusing to use it")
    if st.st_uid != uid:
        raise TierError(f"{where}: owned by uid {st.st_uid}, not by {user}; refusing to use it")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        mode = stat.S_IMODE(st.st_mode)
        raise TierError(f"{where}: writable by others (mode {mode:o}); refusing to use it")


def ensure_ledger_dir(path: Path) -> None:
    """Make sure the ledger directory is root's alone.

    Root opens the ledger and its lock file by path; in a directory a user can write,
    a planted symlink would turn that into a write anywhere. So the directory must be a
    real directory owned by root and writable by no one else. Anything else sitting at
    that name (a user's directory, a symlink, a file) is moved aside, never followed or
    deleted, and a fresh directory is made.
    """
    parent = path.parent
    try:
        pfd = fsio.open_dir(str(parent))
    except OSError as exc:
        raise fsio.tier_error(exc, f"ledger parent directory {parent}") from None
    try:
        try:
            st = os.stat(path.name, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None:
            ok = (
                stat.S_ISDIR(st.st_mode)
                and st.st_uid == os.geteuid()
                and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
            )
            if ok:
                return
            aside = f".{path.name.lstrip('.')}.untrusted-{int(time.time())}-{os.getpid()}"
            os.rename(path.name, aside, src_dir_fd=pfd, dst_dir_fd=pfd)
            log.warning("ledger directory %s was not root's own; moved it to %s", path, aside)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path.name, 0o755, dir_fd=pfd)
        fd = os.open(path.name, fsio.O_DIR, dir_fd=pfd)
        try:
            st2 = os.fstat(fd)
            if st2.st_uid != os.geteuid():
                raise TierError(f"ledger directory {path}: taken over while being created")
            os.fchmod(fd, 0o755)
        finally:
            os.close(fd)
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
