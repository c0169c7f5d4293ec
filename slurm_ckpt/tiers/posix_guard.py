"""Root's guards over a POSIX tier: what it checks before it touches a user's tree.

Root runs the hooks over directories users write. On a POSIX tier a user can plant a
symlink, a hard link to someone else's file, a special file, a million empty files, or
create another user's ``<root>/<user>`` first on a shared root. These guards see each of
those without following a link and refuse (:mod:`slurm_ckpt.tiers.unsafe`). They belong
to the POSIX kind (:meth:`PosixTier.guard_user`/``guard_step``): no other kind has links
or owners; an object store checks who it writes as instead (:mod:`slurm_ckpt.tiers.s3`).
"""

from __future__ import annotations

import errno
import os
import resource
import stat
from typing import Optional

from slurm_ckpt.core import fsio, trust
from slurm_ckpt.core.manifest import MANIFEST_NAME, Manifest
from slurm_ckpt.errors import CkptError, NotFound, VerifyError
from slurm_ckpt.tiers.base import KeyDirs
from slurm_ckpt.tiers.copy import SourceCorrupt
from slurm_ckpt.tiers.unsafe import SquattedUserDir, UnsafeCheckpoint, UnsafeUserDir

__all__ = [
    "MAX_DEPTH",
    "MAX_ENTRIES",
    "check_step_files",
    "check_user_dir",
    "max_dirs",
    "read_committed_manifest",
]

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


def check_step_files(tier: KeyDirs, user: str, key: str, step: int, uid: int) -> None:
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


def check_user_dir(tier: KeyDirs, user: str, uid: int) -> None:
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


def read_committed_manifest(tier: KeyDirs, user: str, key: str, step: int) -> Optional[bytes]:
    """The committed manifest's exact bytes read below the step's directory without
    following a link, or None when there is none (or it cannot be read)."""
    try:
        with tier.step_fd(user, key, step) as sfd:
            return fsio.read_small(sfd, MANIFEST_NAME)
    except (CkptError, OSError):
        return None
