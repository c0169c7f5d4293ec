"""Whole files into a POSIX tier's open writer: a reflink, else a hard link, else a copy.

:meth:`~slurm_ckpt.tiers.posix.PosixTier.adopt_file` is the door (``Checkpointer.adopt()``
snapshots a framework's directory with it, :mod:`slurm_ckpt.job.output`). Why here:
the tiers own every byte copied between files (the one copy engine); a copy loop of
its own outside ``tiers/`` was a second engine. Every name is opened below a directory
descriptor without following links (the same rule as the rest of the POSIX tier).
"""

from __future__ import annotations

import errno
import os
from typing import Optional, Tuple

from slurm_ckpt.core import fsio
from slurm_ckpt.tiers.posix_copy import copy_fd, reflink

__all__ = ["adopt_file"]

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
                if reflink(fd, out):
                    return None
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
                copy_fd(fd, out)
            finally:
                os.close(out)
            return None
        finally:
            os.close(fd)
    finally:
        os.close(spfd)
        os.close(dpfd)
