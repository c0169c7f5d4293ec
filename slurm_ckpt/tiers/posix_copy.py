"""Placing one file's bytes into a POSIX tier's work directory, without copying where
the filesystem allows: the file copy engine of the POSIX kind.

A file a user or a framework already wrote (a sealed directory, a framework's checkpoint
directory) becomes part of a step by being placed in the tier writer's work directory
(:attr:`~slurm_ckpt.core.commit.CheckpointWriter.work_fd`) and recorded with its hash.
The cheapest placement is a reflink clone (``FICLONE``: btrfs, XFS with reflink,
bcachefs; the extents are shared, nothing is copied, and the clone is a file of its
own); else the kernel copies (``copy_file_range``: server-side on NFS, extents shared on
some filesystems); else a plain read and write. Written once here, beside the POSIX
tier, so that no module outside ``tiers/`` runs a copy loop of its own (the streamed,
hashed copy between tiers is :mod:`slurm_ckpt.tiers.copy`).

Works on open descriptors only: the caller has opened both files beneath their roots
(no link followed), and decides what a failure means.
"""

from __future__ import annotations

import errno
import fcntl
import os

from slurm_ckpt.core import fsio

__all__ = ["FICLONE", "PIECE", "clone_or_copy", "copy_fd", "reflink"]

#: ``ioctl(dst, FICLONE, src)``: make ``dst`` share ``src``'s extents (linux/fs.h).
FICLONE = 0x40049409
#: Bytes per ``copy_file_range`` / read call when a file cannot be cloned.
PIECE = 8 * 2**20
#: ``copy_file_range`` errors that mean "not here" (another filesystem, no support):
#: the bytes then go through a buffer.
_NO_KERNEL_COPY = (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP)


def reflink(src: int, dst: int) -> bool:
    """True when ``dst`` (an empty file) became a reflink clone of ``src``; False when
    the filesystem cannot clone it (``dst`` is then left empty)."""
    try:
        fcntl.ioctl(dst, FICLONE, src)
        return True
    except OSError:
        return False


def copy_fd(src: int, dst: int, piece: int = PIECE) -> None:
    """Copy all of ``src`` into ``dst`` from offset 0: in the kernel where it can
    (``copy_file_range``), else through a buffer. Not fsynced: the caller hashes and
    syncs what it placed."""
    off = 0
    try:
        while True:
            n = os.copy_file_range(src, dst, piece, off, off)
            if n == 0:
                return
            off += n
    except OSError as exc:
        if exc.errno not in _NO_KERNEL_COPY:
            raise
    while True:
        b = os.pread(src, piece, off)
        if not b:
            return
        fsio.write_all(dst, memoryview(b), off)
        off += len(b)


def clone_or_copy(src: int, dst: int, piece: int = PIECE) -> bool:
    """Place ``src``'s bytes in the empty file ``dst``: True when cloned (no data
    copied), False when copied (:func:`reflink`, else :func:`copy_fd`)."""
    if reflink(src, dst):
        return True
    copy_fd(src, dst, piece)
    return False
