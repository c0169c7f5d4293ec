"""Guards that keep root-run code safe over user data, and the node checks a job needs.

Root runs the hooks over directories users write. Before it touches anything there it
asks these guards: is ``<tier>/<user>`` really that user's own directory, is every file
of a checkpoint a regular file with one link owned by its user, is the ledger directory
root's alone, is the local tier mounted with room for a job. A checkpoint that fails a
guard is the owner's doing: it is marked and left alone (never a reason to keep a node
drained), see :class:`UnsafeCheckpoint`.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import stat
from pathlib import Path

from slurm_ckpt.core import fsio, trust
from slurm_ckpt.core.config import Config
from slurm_ckpt.core.manifest import MANIFEST_NAME, Manifest
from slurm_ckpt.core.units import format_bytes
from slurm_ckpt.errors import EXIT_FAILED, CkptError, NotFound, VerifyError
from slurm_ckpt.node.flush_engine import Unflushable
from slurm_ckpt.tiers.copy import SourceCorrupt
from slurm_ckpt.tiers.posix import PosixTier

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
    "check_step_files",
    "check_user_dir",
    "ensure_ledger_dir",
    "required_free",
]


class NodeCheckFailed(CkptError):
    """A node check failed: the local tier cannot take a job's checkpoints."""

    exit_code = EXIT_FAILED


class UnsafeCheckpoint(Unflushable):
    """A checkpoint holds something root-run code must not touch (a symlink, a special
    file, a hard link, a file of another owner, more files than it may have, a manifest
    that lies about its files). It is the owner's own doing, so it is marked ``BAD`` on
    its tier and left alone - it must not keep a node drained."""


class UnsafeUserDir(Unflushable):
    """``<tier root>/<user>`` cannot be used: a symlink, not a directory, writable by
    others (the owner's doing), or owned by someone else (``squatted``: reported to the
    admin). Nothing of that user is flushed there until it is fixed."""

    hold_code = "unsafe_dir"
    bad_source = False


class OwnPermissionDenied(Unflushable):
    """Permission denied below the owner's own directories (``chmod 000`` on their
    payload file, ``chmod 500`` on their PFS user or key directory): only the owner can
    have set those modes. Held (destination ``FAILED``), retried after its backoff."""

    hold_code = "permission"
    bad_source = False


class SquattedUserDir(UnsafeUserDir):
    """Another user owns ``<tier root>/<user>`` (they created it first)."""

    hold_code = "squatted"


#: A checkpoint with more files and directories than this is refused as unsafe (root's
#: children walk and open them; a million empty files is an attack, not a model).
MAX_ENTRIES = 200_000
#: ... and so is one nested deeper than this.
MAX_DEPTH = 32


def max_dirs() -> int:
    """Directories a checkpoint may have: a copy keeps one descriptor open per directory
    it writes, so no more than a quarter of the open-file limit (at least 64)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_ENTRIES
    return max(64, soft // 4)


def check_step_files(tier: PosixTier, user: str, key: str, step: int, uid: int) -> None:
    """Refuse a checkpoint that root-run code must not touch: anything but regular files,
    a file with more than one hard link (it may be someone else's file linked in), a
    file not owned by ``uid``, more than :data:`MAX_ENTRIES` entries or
    :data:`MAX_DEPTH` levels, or a manifest whose files are not the files there (a
    manifest that claims petabytes would have the copy reserve them). Directories are
    walked with O_NOFOLLOW."""
    where = tier.where(user, key, step)
    with tier.step_fd(user, key, step) as sfd:
        try:
            files, problems = fsio.walk_files(sfd, max_entries=MAX_ENTRIES, max_depth=MAX_DEPTH)
            data = fsio.read_small(sfd, MANIFEST_NAME)
        except FileNotFoundError:
            raise NotFound(f"{where}: not committed") from None
        except OSError as exc:
            err = fsio.tier_error(exc, where)
            if isinstance(err, fsio.RefusedPath) or exc.errno in (errno.EMFILE, errno.ENFILE):
                raise UnsafeCheckpoint(f"{err}; refusing to touch it") from None
            raise err from None
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
    dirs = {rel[:i] for rel, _st in files for i, c in enumerate(rel) if c == "/"}
    limit = max_dirs()
    if len(dirs) > limit:
        raise UnsafeCheckpoint(
            f"{where}: {len(dirs)} directories, more than {limit} (a quarter of this "
            "process's open-file limit); refusing to copy it"
        )
    try:
        manifest = Manifest.from_bytes(data, where)
    except VerifyError as exc:
        raise SourceCorrupt(str(exc)) from None
    sizes = {rel: st.st_size for rel, st in files}
    for entry in manifest.files:
        have = sizes.get(entry.path)
        if have != entry.size:
            what = "missing" if have is None else f"{have} bytes"
            raise UnsafeCheckpoint(
                f"{where}: the manifest says {entry.path} has {entry.size} bytes, it is "
                f"{what}; refusing to copy it"
            )


def check_user_dir(tier: PosixTier, user: str, uid: int) -> None:
    """``<tier root>/<user>`` must be the user's own: a real directory owned by ``uid`` that
    no one else can write. On a shared root that every user may write (mode 1777, as a
    PFS checkpoint root often is) another user could have created it first; writing a
    checkpoint into their directory would let them replace it (and a restore would load
    their bytes). A missing directory is fine: it is created by the user, mode 0700.
    Raises :class:`UnsafeUserDir` (:class:`SquattedUserDir` for another owner)."""
    try:
        st = os.lstat(os.path.join(tier.root, user))
    except FileNotFoundError:
        return
    except OSError as exc:
        raise fsio.tier_error(exc, f"{tier.name}:{tier.root}/{user}") from None
    where = f"{tier.name}:{tier.root}/{user}"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafeUserDir(f"{where}: not a directory (symlink?); refusing to use it")
    if st.st_uid != uid:
        raise SquattedUserDir(trust.squat_message(where, user, st.st_uid))
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        mode = stat.S_IMODE(st.st_mode)
        raise UnsafeUserDir(
            f"{where}: writable by others (mode {mode:o}); refusing to use it "
            f"(fix: chmod 700 {tier.root}/{user})"
        )


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
