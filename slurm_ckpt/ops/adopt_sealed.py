"""``adopt DIR --key K``: a sealed directory (``seal``) becomes a step of a series on a tier.

Once it is a step of ``<user>/<key>`` on the local or warm tier, everything that looks
after our own checkpoints looks after it: ``flush`` copies it to the warm tier, ``gc``
ages it to the object and cold tiers and applies retention, ``restore``/``drill``/
``verify KEY`` find it, and a job's ``Checkpointer(key=K).restore_path()`` hands it back
(the files sit under ``rank-00000/``, the manifest says ``state_format`` is a directory
checkpoint: the layout of :meth:`~slurm_ckpt.Checkpointer.adopt`, one rank).

Without copying where the tier allows: each file is cloned into the tier's work
directory with ``FICLONE`` (a reflink: btrfs, XFS with reflink, bcachefs; the extents are
shared, nothing is copied, and the clone is a file of its own), else copied in the kernel
(``copy_file_range``: server-side on NFS, extents shared on some filesystems): the POSIX
tier's file copy (:mod:`slurm_ckpt.tiers.posix_copy`). Hard links
are never used: ``verify`` refuses a file with more than one link (a link could pull
someone else's file into a checkpoint), so a link would make both the sealed directory
and the tier's copy fail verification.

Every byte placed on the tier is then read back and hashed against the seal's chunk
digests before the tier's manifest is committed (last, atomically, by the tier's
writer): a sealed directory that was damaged since it was sealed is refused with the
file and byte range, and nothing is committed. The sealed directory itself is left as it
was.
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass
from typing import List, Optional, Set

from slurm_ckpt.core import fsio
from slurm_ckpt.core.chunks import hash_range, run_chunks
from slurm_ckpt.core.commit import AlreadyCommitted
from slurm_ckpt.core.manifest import FileEntry, Manifest
from slurm_ckpt.core.names import current_user, validate_key
from slurm_ckpt.core.verify import open_payload
from slurm_ckpt.errors import CkptError, VerifyError
from slurm_ckpt.job.output import DIR_FORMAT
from slurm_ckpt.job.restore import shard_prefix
from slurm_ckpt.ops.seal import SEALED_META
from slurm_ckpt.ops.verify_path import PathProblem, manifest_at
from slurm_ckpt.tiers.base import Tier
from slurm_ckpt.tiers.posix_copy import clone_or_copy

__all__ = ["Adopted", "adopt_sealed"]

#: A new file opened for reading too (its bytes are read back and hashed).
_O_NEW_RW = (fsio.O_NEWFILE & ~os.O_ACCMODE) | os.O_RDWR


@dataclass
class Adopted:
    """What ``adopt`` committed."""

    source: str
    where: str
    manifest: Manifest
    cloned: int  # files cloned (reflink): no data copied
    copied: int  # files copied (another filesystem, or no reflinks)
    seconds: float


def adopt_sealed(
    target: str, tier: Tier, key: str, step: Optional[int] = None, streams: int = 4
) -> Adopted:
    """Commit the sealed directory ``target`` as step ``step`` (default: the seal's) of
    the caller's series ``key`` on ``tier`` (a directory tier). See the module docstring."""
    t0 = time.monotonic()
    validate_key(key)
    if tier.directory() is None:
        raise CkptError(
            f"adopt: the {tier.name} tier is not a directory tier (adopt into local or a "
            "PFS; flush and gc take it on from there)"
        )
    path = os.path.abspath(target)
    try:
        sfd = os.open(path, fsio.O_DIR)
    except FileNotFoundError:
        raise PathProblem(f"{path}: no such directory") from None
    except PermissionError:
        raise PathProblem(f"{path}: permission denied") from None
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP):
            raise PathProblem(f"{path}: not a directory (or a symlink, never followed)") from None
        raise PathProblem(f"{path}: {exc.strerror or exc}") from None
    try:
        try:
            sealed = manifest_at(sfd, path)
        except PathProblem:
            raise PathProblem(f"{path}: not sealed (run ckpt-slurm seal {path} first)") from None
        if SEALED_META not in sealed.meta:
            raise PathProblem(
                f"{path}: a checkpoint of ours, not a sealed directory (restore or copy it)"
            )
        user = current_user()
        if sealed.user != user:
            raise PathProblem(f"{path}: sealed as {sealed.user}'s: adopt it as {sealed.user}")
        step = sealed.step if step is None else step
        prefix = shard_prefix(0)
        # ``sealed`` goes: this step lives in a series now (verify DIR of a copy of it
        # says "moved" like for any of ours); ``adopted`` keeps which tool wrote it.
        meta = {k: v for k, v in sealed.meta.items() if k != SEALED_META}
        meta.update(
            adopted=sealed.meta[SEALED_META],
            rank=0,
            world_size=1,
            base_key=key,
            reason="adopted",
            state_format=DIR_FORMAT,
        )
        try:
            w = tier.writer(
                user, key, step, job=sealed.job, node=sealed.node, meta=meta,
                chunk_size=sealed.chunk_size,
            )  # fmt: skip
        except AlreadyCommitted:
            raise CkptError(
                f"{tier.where(user, key, step)}: step {step} is already committed "
                "(give another --step)"
            ) from None
        try:
            cloned = _place(sfd, w.work_fd, prefix, sealed, path, streams)
            for e in sealed.files:
                w.add_entry(FileEntry(f"{prefix}/{e.path}", e.size, e.hash, e.chunks))
            m = w.commit()
        except BaseException:
            w.abort()
            raise
    finally:
        os.close(sfd)
    n = len(sealed.files)
    where = tier.where(user, key, step)
    return Adopted(path, where, m, cloned, n - cloned, time.monotonic() - t0)


def _place(sfd: int, wfd: int, prefix: str, sealed: Manifest, path: str, streams: int) -> int:
    """Clone or copy every file of the seal below ``wfd/prefix``, read the placed bytes
    back against the seal's digests, fsync files and directories; the number cloned."""
    cloned = 0
    fds: List[int] = []
    dirs: Set[str] = {prefix}
    try:
        for e in sealed.files:
            parts = [prefix, *e.path.split("/")]
            dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
            pfd = fsio.open_beneath(wfd, parts[:-1], True)
            try:
                out = os.open(parts[-1], _O_NEW_RW, fsio.FILE_MODE, dir_fd=pfd)
            finally:
                os.close(pfd)
            fds.append(out)
            try:
                src = open_payload(sfd, e.path)
            except OSError as exc:
                raise VerifyError(f"{path}/{e.path}: {exc.strerror or exc}") from None
            try:
                if os.fstat(src).st_size != e.size:
                    raise VerifyError(
                        f"{path}/{e.path}: size {os.fstat(src).st_size} != {e.size} "
                        f"(changed since it was sealed: ckpt-slurm verify {path})"
                    )
                cloned += int(clone_or_copy(src, out))
            finally:
                os.close(src)
        digests = run_chunks(
            [e.size for e in sealed.files],
            sealed.chunk_size,
            lambda fi, _ci, off, n: hash_range(fds[fi], off, n),
            lambda fi: os.fsync(fds[fi]),
            streams,
        )
        for e, got in zip(sealed.files, digests):
            bad = [i for i, (a, b) in enumerate(zip(got, e.chunks)) if a != b]
            if bad:
                cs = sealed.chunk_size
                at = f"bytes {bad[0] * cs}-{min((bad[0] + 1) * cs, e.size)}"
                raise VerifyError(
                    f"{path}/{e.path}: does not match its seal ({at}): nothing adopted"
                )
    finally:
        for fd in fds:
            os.close(fd)
    for d in sorted(dirs, key=len, reverse=True):
        fd = fsio.open_beneath(wfd, d.split("/"))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return cloned
