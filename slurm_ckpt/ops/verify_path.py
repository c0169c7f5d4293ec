"""``verify PATH``: any checkpoint directory, wherever it is (issue 11, item 2).

A checkpoint directory is self-describing: its manifest names the user, key and step and
holds every file's size and hashes. So a byte-identical copy made elsewhere (``cp -a`` to
scratch, a restore from tape) verifies exactly like the original; where it lives is only
worth a note: when its place (``.../<user>/<key>/step-NNNNNNNNNN``) does not match what
the manifest says, the report says it was *moved* and where it came from.

What cannot be verified gets its own message (:class:`PathProblem`, exit 1):

* the path does not exist;
* the path is a symlink (never followed: give the directory itself);
* permission denied (on the path, the directory or its manifest);
* not a directory, or a directory without a manifest (not a committed checkpoint);
* a manifest that does not parse or check (reported as a CORRUPT result instead).
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass, field
from typing import Any, List, Optional

from slurm_ckpt.core import fsio
from slurm_ckpt.core.layout import step_dirname
from slurm_ckpt.core.manifest import Manifest
from slurm_ckpt.core.progress import ProgressFn
from slurm_ckpt.core.verify import VerifyReport, unlisted_files, verify_files
from slurm_ckpt.errors import CkptError, VerifyError
from slurm_ckpt.ops.damage import read_manifest
from slurm_ckpt.ops.seal import SEALED_META

__all__ = ["PathProblem", "PathVerify", "manifest_at", "verify_path"]


class PathProblem(CkptError):
    """PATH is not something that can be verified (missing, symlink, no permission...)."""


@dataclass
class PathVerify:
    """The outcome of verifying one directory by path."""

    path: str
    report: VerifyReport
    manifest: Optional[Manifest] = None
    moved: bool = False
    notes: List[str] = field(default_factory=list)

    @property
    def origin(self) -> Optional[str]:
        m = self.manifest
        return None if m is None else f"{m.user}/{m.key}/{step_dirname(m.step)}"


def _check_path(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        parent = os.path.dirname(path) or "."
        if not os.path.isdir(parent):
            raise PathProblem(f"{path}: no such file or directory (nor its parent)") from None
        raise PathProblem(f"{path}: no such file or directory") from None
    except PermissionError:
        raise PathProblem(
            f"{path}: permission denied (a directory on the way is not searchable; run as "
            "the owner or root)"
        ) from None
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(path)
        raise PathProblem(
            f"{path}: is a symlink (to {target}); symlinks are never followed: give the "
            "checkpoint directory itself"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise PathProblem(f"{path}: not a directory (a checkpoint is a step-NNNNNNNNNN directory)")


def _open(path: str) -> int:
    try:
        return os.open(path, fsio.O_DIR)
    except PermissionError:
        raise PathProblem(f"{path}: permission denied (run as the owner or root)") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # replaced by a symlink since the check
            raise PathProblem(f"{path}: is a symlink; symlinks are never followed") from None
        raise PathProblem(f"{path}: {exc.strerror or exc}") from None


def manifest_at(sfd: int, path: str) -> Manifest:
    """The manifest of the open directory ``sfd`` (PathProblem, or VerifyError if bad)."""
    try:
        data = read_manifest(sfd)
    except FileNotFoundError:
        raise PathProblem(
            f"{path}: no manifest.json: not a committed checkpoint (a commit that never "
            "finished, or not a checkpoint directory)"
        ) from None
    except PermissionError:
        raise PathProblem(
            f"{path}/manifest.json: permission denied (run as the owner or root)"
        ) from None
    except OSError as exc:
        raise VerifyError(f"{path}: manifest: {exc.strerror or exc}") from None
    return Manifest.from_bytes(data, path)


def verify_path(
    target: str,
    streams: int = 4,
    progress: Optional[ProgressFn] = None,
    expected_size: Optional[List[int]] = None,
) -> PathVerify:
    """Re-hash every byte of the checkpoint directory ``target`` against its manifest.

    ``expected_size``, when given, receives the manifest's byte count before hashing
    starts (so a caller can size its progress bar).
    """
    path = os.path.abspath(target)
    _check_path(path)
    sfd = _open(path)
    try:
        try:
            m = manifest_at(sfd, path)
        except VerifyError as exc:
            rep = VerifyReport(f"path:{path}", -1, False, problems=[str(exc)])
            return PathVerify(path, rep)
        if expected_size is not None:
            expected_size.append(m.total_bytes)
        try:
            rep = verify_files(sfd, m, f"path:{path}", streams, progress=progress)
            extra = unlisted_files(sfd, m)
            if SEALED_META in m.meta:  # another tool's empty directories: see below
                extra = [e for e in extra if not _holds_no_file(sfd, e)]
            note_unlisted(rep, extra)
        except PermissionError:
            raise PathProblem(f"{path}: permission denied reading its files") from None
    finally:
        os.close(sfd)
    out = PathVerify(path, rep, m)
    parts = path.rstrip("/").split("/")
    here = tuple(parts[-3:]) if len(parts) >= 3 else tuple(parts)
    if here != (m.user, m.key, step_dirname(m.step)) and SEALED_META not in m.meta:
        # (a directory ``seal`` sealed in place lives where its tool put it: not moved)
        out.moved = True
        origin = f"{m.user}/{m.key} step {m.step}"
        where = f" (written on {m.node}" + (f" by job {m.job})" if m.job else ")") if m.node else ""
        out.notes.append(f"moved: this is {origin}{where}")
    return out


def _holds_no_file(sfd: int, rel: str) -> bool:
    """Whether the unlisted entry ``rel`` of a sealed directory is a directory tree without
    a single file in it.

    Why: a seal records files (their bytes are the checkpoint), and the tools it seals
    may leave empty directories behind (an OCDBT ``d/`` that got no data, say); naming
    those on every verify would fail a directory that holds exactly what was sealed. A
    file anywhere below one, a symlink or anything else is still named. Opened without
    following any symlink, and the walk is bounded (a huge empty tree is named)."""
    if not rel.endswith("/"):
        return False
    try:
        fd = fsio.open_beneath(sfd, rel.rstrip("/").split("/"))
    except OSError:
        return False
    try:
        files, problems = fsio.walk_files(fd, max_entries=1000, max_depth=32)
    except OSError:
        return False
    finally:
        os.close(fd)
    return not files and not problems


#: How ``verify`` words a file in a step directory that the manifest does not list.
UNLISTED_NOTE = "not in the manifest"


def note_unlisted(rep: VerifyReport, extra: List[str]) -> None:
    """Add each unlisted entry of a step directory to ``rep`` as a problem (``verify``
    exits 1 on them; see :func:`~slurm_ckpt.core.verify.unlisted_files`)."""
    if extra:
        rep.problems.extend(f"{p}: {UNLISTED_NOTE}" for p in extra)
        rep.ok = False


def unlisted_on_tier(tier: Any, user: str, key: str, step: int) -> List[str]:
    """:func:`~slurm_ckpt.core.verify.unlisted_files` of a checkpoint on a directory tier
    (none on the object tier, whose keys under a step are all read by its verify)."""
    step_fd = getattr(tier, "step_fd", None)
    if step_fd is None:
        return []
    try:
        m = tier.manifest(user, key, step)
        with step_fd(user, key, step) as sfd:
            return unlisted_files(sfd, m)
    except (CkptError, OSError):
        return []  # the verify report already says what is wrong with it
