"""Whole files into a POSIX tier's open writer: a reflink, else a hard link, else a copy.

:meth:`~slurm_ckpt.tiers.posix.PosixTier.adopt_file` is the door (``Checkpointer.adopt()``
snapshots a framework's directory with it, :mod:`slurm_ckpt.job.output`). Why here:
the tiers own every byte copied between files (the one copy engine); a copy loop of
its own outside ``tiers/`` was a second engine. Every name is opened below a directory
descriptor without following links (the same rule as the rest of the POSIX tier).
"""

from __future__ import annotations

import errno
import fcntl
import os
from typing import Optional, Tuple

from slurm_ckpt.core import fsio
from slurm_ckpt.core.chunks import PIECE

__all__ = ["FICLONE", "adopt_file", "copy_whole"]

#: Ioctl that clones a file's extents (btrfs, XFS with reflink, bcachefs): linux/fs.h.
FICLONE = 0x40049409

#: A hard link's errors that mean "cannot link here" (another filesystem, a policy):
#: the file is copied instead.
_NO_LINK = (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EACCES, errno.EOPNOTSUPP)


def adopt_file(sfd: int, dfd: int, rel: str) -> Optional[Tuple[int, int]]:
    """Put the file ``rel`` below directory ``sfd`` at the same place below ``dfd``: a
    reflink clone (its own inode, no data copied), else a hard link, else a copy.

    Returns ``(size, mtime_ns)`` when it made a hard link: the file still shares the
    source's inode, and the caller must copy it apart before the commit (and refuse it
    if it changed from that); None when the file is one of its own."""
    parts = rel.split("/")
    spfd = fsio.open_beneath(sfd, parts[:-1])
    try:
        dpfd = fsio.open_beneath(dfd, parts[:-1], True)
    except BaseException:
        os.close(spfd)
        raise
    name = parts[-1]
    try:
        fd = os.open(name, fsio.O_READ | os.O_NONBLOCK, dir_fd=spfd)
        try:
            st = os.fstat(fd)
            out = os.open(name, fsio.O_NEWFILE, fsio.FILE_MODE, dir_fd=dpfd)
            try:
                try:
                    fcntl.ioctl(out, FICLONE, fd)
                    return None
                except OSError:
                    pass
            finally:
                os.close(out)
            os.unlink(name, dir_fd=dpfd)
            try:
                os.link(name, name, src_dir_fd=spfd, dst_dir_fd=dpfd, follow_symlinks=False)
                return (st.st_size, st.st_mtime_ns)
            except OSError as exc:
                if exc.errno not in _NO_LINK:
                    raise
            out = os.open(name, fsio.O_NEWFILE, fsio.FILE_MODE, dir_fd=dpfd)
            try:
                copy_whole(fd, out)
            finally:
                os.close(out)
            return None
        finally:
            os.close(fd)
    finally:
        os.close(spfd)
        os.close(dpfd)


def copy_whole(src: int, dst: int) -> None:
    """Copy a whole file: in the kernel where it can (``copy_file_range``: server-side on
    NFS, extents shared on some filesystems), else through a buffer."""
    off = 0
    try:
        while True:
            n = os.copy_file_range(src, dst, PIECE, off, off)
            if n == 0:
                return
            off += n
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise
    while True:
        b = os.pread(src, PIECE, off)
        if not b:
            return
        fsio.write_all(dst, memoryview(b), off)
        off += len(b)
