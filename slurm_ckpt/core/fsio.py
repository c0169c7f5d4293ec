"""Filesystem primitives that never follow a symlink below a tier root.

Tier roots are configured by the admin and trusted; everything below them
(``<user>/<key>/step-N/...``) may be written by users and is treated as hostile: every
component is opened relative to its parent's file descriptor with ``O_NOFOLLOW``, so a
symlink planted anywhere in the tree fails the open instead of redirecting it. Durability
follows the classic rule: fsync the file, then fsync the directory that names it.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import stat
import time
from contextlib import contextmanager, suppress
from typing import Iterator, List, Optional, Sequence, Tuple, Union

from slurm_ckpt.core.faults import crashpoint
from slurm_ckpt.errors import CkptError, TierError

O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
O_NEWFILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
O_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
DIR_MODE = 0o700
FILE_MODE = 0o600
#: Marks the temporary files of :func:`atomic_replace` (``.<name>.tmp-<pid>-<rand>``).
TMP_MARK = ".tmp-"


class RefusedPath(TierError):
    """A path was refused rather than followed: a symlink or a non-directory where a
    directory belongs, or a file that is not a plain, singly linked file of its
    directory's owner (:class:`UnsafeFile`). Below a tier root that is the doing of
    whoever can write there, never of the node."""


class PermissionDenied(TierError):
    """EACCES/EPERM on a tier. Whose doing depends on where: below a user's own
    directory it is that user's (the flush child decides, knowing the owner:
    :func:`slurm_ckpt.node.owner_tasks.flush_as_user`), elsewhere the site's."""


class QuotaExceeded(TierError):
    """The writer's disk quota is used up: the quota's owner's doing, not the node's."""

    user_caused = True
    hold_code = "quota"


def tier_error(exc: OSError, what: str) -> CkptError:
    """Turn an OSError into a one-line :class:`TierError` that says what to do
    (:class:`RefusedPath` for a symlink, a non-directory or an unsafe file)."""
    if isinstance(exc, UnsafeFile):
        return RefusedPath(f"{what}: {exc.strerror}; refusing to touch it")
    reason = {
        errno.ENOSPC: "no space left on device",
        errno.EDQUOT: "disk quota exceeded",
        errno.EACCES: "permission denied",
        errno.EPERM: "operation not permitted",
        errno.EROFS: "read-only filesystem",
        errno.EIO: "I/O error",
        errno.ENOENT: "no such file or directory",
        errno.ELOOP: "refusing to follow a symbolic link",
        errno.ENOTDIR: "not a directory (or a symbolic link where a directory belongs)",
    }.get(exc.errno or 0, exc.strerror or str(exc))
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return RefusedPath(f"{what}: {reason}")
    if exc.errno == errno.EDQUOT:
        return QuotaExceeded(f"{what}: {reason}")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return PermissionDenied(f"{what}: {reason}")
    return TierError(f"{what}: {reason}")


def open_dir(path: str) -> int:
    """Open a trusted directory (a tier root); its last component must not be a symlink."""
    return os.open(path, O_DIR)


def open_beneath(
    base_fd: int, parts: Sequence[str], create: bool = False, mode: int = DIR_MODE
) -> int:
    """Open the directory ``base/parts[0]/parts[1]/...`` without following any symlink.

    With ``create``, missing components are made with ``mode``. Returns a new fd.
    """
    fd = os.dup(base_fd)
    try:
        for part in parts:
            try:
                nfd = os.open(part, O_DIR, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(part, mode, dir_fd=fd)
                    os.fsync(fd)
                except FileExistsError:
                    pass
                nfd = os.open(part, O_DIR, dir_fd=fd)
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


@contextmanager
def dir_fd(base_fd: int, parts: Sequence[str], create: bool = False) -> Iterator[int]:
    fd = open_beneath(base_fd, parts, create=create)
    try:
        yield fd
    finally:
        os.close(fd)


def write_all(fd: int, data: object, offset: Optional[int] = None) -> None:
    """Write a whole buffer, looping over short writes (pwrite when offset is given)."""
    mv = memoryview(data).cast("B")
    while len(mv):
        n = os.write(fd, mv) if offset is None else os.pwrite(fd, mv, offset)
        if offset is not None:
            offset += n
        mv = mv[n:]


def read_small(dfd: int, name: str, limit: int = 64 * 2**20) -> bytes:
    """Read a whole regular file (manifests, status files) without following symlinks."""
    return read_regular(dfd, name, limit)[0]


class UnsafeFile(OSError):
    """A file that root-run code must not read: not a regular file (a FIFO would hang the
    reader, a device is not ours), more than one hard link (someone else's file linked
    in), or an owner other than its directory's. ``errno`` is EINVAL, so callers that
    sort errors by errno treat it as "not a checkpoint file"."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EINVAL, message)


def check_file(fd: int, name: str, dir_fd: Optional[int] = None) -> os.stat_result:
    """fstat an open file and refuse it (:class:`UnsafeFile`) unless it is a regular file
    with one link and - when ``dir_fd`` is given - owned by the owner of that directory
    (the files of a checkpoint are written by whoever wrote its directory)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFile(f"{name} is not a regular file")
    if st.st_nlink != 1:
        raise UnsafeFile(f"{name} has {st.st_nlink} hard links")
    if dir_fd is not None:
        owner = os.fstat(dir_fd).st_uid
        if st.st_uid != owner:
            raise UnsafeFile(f"{name} is owned by uid {st.st_uid}, not by its directory's owner")
    return st


def open_regular(dfd: int, name: str) -> Tuple[int, os.stat_result]:
    """Open ``name`` below ``dfd`` for reading without following a symlink or blocking:
    ``O_NONBLOCK`` and checked with :func:`check_file` *before* any read, so a FIFO,
    socket or device planted in its place is refused at once instead of hanging the
    reader, and so is a hard link or a file of a foreign owner. Returns ``(fd, stat)``."""
    fd = os.open(name, O_READ | os.O_NONBLOCK, dir_fd=dfd)
    try:
        return fd, check_file(fd, name, dfd)
    except BaseException:
        os.close(fd)
        raise


def read_regular(dfd: int, name: str, limit: int = 64 * 2**20) -> Tuple[bytes, os.stat_result]:
    """A whole regular file and its stat, opened with :func:`open_regular` (no symlink,
    no blocking open, one link, the directory owner's)."""
    fd, st = open_regular(dfd, name)
    try:
        if st.st_size > limit:
            raise OSError(errno.EFBIG, f"{name} is larger than {limit} bytes")
        chunks = []
        while True:
            b = os.read(fd, max(st.st_size + 1, 1 << 16) if not chunks else 1 << 20)
            if not b:
                return b"".join(chunks), st
            chunks.append(b)
            if sum(len(c) for c in chunks) > limit:
                raise OSError(errno.EFBIG, f"{name} is larger than {limit} bytes")
    finally:
        os.close(fd)


def temp_name(name: str) -> str:
    """The hidden, unique temporary name :func:`atomic_replace` writes ``name`` under."""
    return f".{name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"


def atomic_replace(
    dfd: int, name: str, data: bytes, mode: int = FILE_MODE, *, durable: bool = True
) -> None:
    """Replace ``name`` in directory ``dfd`` atomically: temp file, fsync, rename, fsync dir.

    The one way this toolkit replaces a file (manifests, the ledger, node statuses, event
    summaries, hook scripts): a reader, or a crash, sees the old file or the complete new
    one, never a torn one. The temp file is created with ``O_EXCL | O_NOFOLLOW`` and its
    mode set with fchmod (independent of the umask); the rename replaces whatever sits at
    ``name`` - a planted symlink included - without following it. ``durable=False`` skips
    both fsyncs, for caches whose loss costs nothing.
    """
    tmp = temp_name(name)
    fd = os.open(tmp, O_NEWFILE, mode, dir_fd=dfd)
    try:
        os.fchmod(fd, mode)
        write_all(fd, data)
        crashpoint("atomic_write:written")
        if durable:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        unlink_quiet(dfd, tmp)
        raise
    os.close(fd)
    crashpoint("atomic_write:synced")
    try:
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        unlink_quiet(dfd, tmp)
        raise
    crashpoint("atomic_write:renamed")
    if durable:
        os.fsync(dfd)


def atomic_replace_path(
    path: Union[str, os.PathLike[str]], data: bytes, mode: int = FILE_MODE, *, durable: bool = True
) -> None:
    """:func:`atomic_replace` for a path whose directory is trusted (not below a tier
    root): the directory itself is opened without following a final symlink."""
    directory, name = os.path.split(os.path.abspath(os.fspath(path)))
    dfd = open_dir(directory)
    try:
        atomic_replace(dfd, name, data, mode, durable=durable)
    finally:
        os.close(dfd)


def remove_stale_temps(
    dfd: int, name: str, min_age_s: float = 0.0, now: Optional[float] = None
) -> None:
    """Remove temp files :func:`atomic_replace` left for ``name`` (a killed writer's).
    With ``min_age_s`` only those older than that: another process may be writing now."""
    prefix = f".{name}{TMP_MARK}"
    now = time.time() if now is None else now
    with suppress(OSError):
        for entry in os.listdir(dfd):
            if not entry.startswith(prefix):
                continue
            with suppress(OSError):
                if min_age_s > 0:
                    st = os.stat(entry, dir_fd=dfd, follow_symlinks=False)
                    if now - st.st_mtime <= min_age_s:
                        continue
                os.unlink(entry, dir_fd=dfd)


def unlink_quiet(dfd: int, name: str) -> None:
    with suppress(OSError):
        os.unlink(name, dir_fd=dfd)


def fd_path(fd: int) -> str:
    """The path the kernel has for an open directory fd (for rmtree and messages)."""
    return os.readlink(f"/proc/self/fd/{fd}")


def remove_tree(parent_fd: int, name: str) -> None:
    """Delete ``parent/name`` recursively: first renamed aside, then removed.

    The rename makes the removal look atomic to readers (the name disappears at once);
    shutil.rmtree on Linux uses fd-based traversal and never follows symlinks.
    """
    trash = f".trash-{name.lstrip('.')}-{secrets.token_hex(4)}"
    try:
        os.rename(name, trash, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
    except FileNotFoundError:
        return
    os.fsync(parent_fd)
    assert shutil.rmtree.avoids_symlink_attacks
    shutil.rmtree(os.path.join(fd_path(parent_fd), trash), ignore_errors=True)


def walk_files(
    dfd: int,
    prefix: str = "",
    *,
    max_entries: Optional[int] = None,
    max_depth: Optional[int] = None,
) -> Tuple[List[Tuple[str, os.stat_result]], List[str]]:
    """List regular files below an open directory: ([(relpath, stat)], [problems]).

    Symlinks, devices and other special files are reported as problems, never entered.
    ``max_entries``/``max_depth`` bound the walk (a tree of a million entries or a
    thousand levels is a problem, not something to walk: it is reported and the walk
    stops). Only one directory is open per level at a time.
    """
    files: List[Tuple[str, os.stat_result]] = []
    problems: List[str] = []
    count = [0]

    def walk(fd: int, pre: str, depth: int) -> bool:
        with os.scandir(fd) as it:
            names = [e.name for e in it]
        for name in names:
            count[0] += 1
            if max_entries is not None and count[0] > max_entries:
                problems.append(f"more than {max_entries} files and directories")
                return False
            rel = f"{pre}{name}"
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                if max_depth is not None and depth >= max_depth:
                    problems.append(f"{rel}: nested more than {max_depth} directories deep")
                    return False
                sub = os.open(name, O_DIR, dir_fd=fd)
                try:
                    if not walk(sub, rel + "/", depth + 1):
                        return False
                finally:
                    os.close(sub)
            elif stat.S_ISREG(st.st_mode):
                files.append((rel, st))
            else:
                problems.append(f"{rel}: not a regular file")
        return True

    walk(dfd, prefix, 0)
    return files, problems
