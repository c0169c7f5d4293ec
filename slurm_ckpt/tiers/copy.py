"""The copy engine: move a committed checkpoint to another tier, verified, then commit it.

One pass through memory per byte: each stream reads a range of the source into its own
reusable buffer, hashes it, and writes it to the same offset of the destination. Every
range's digest is compared with the source manifest, so the bytes written are proven equal
to the bytes that were committed; only then is the destination committed with the same
protocol as a fresh write (data, fsync, rename, manifest last).

The copy is made in ``<key>/.partial-step-N/`` (a name fixed by the step, not by the
process) so that a copy interrupted by a crash is found and resumed by the next run: files
already complete and matching their hashes are kept, everything else is redone. Copies of
one step are serialised by a lock on the *source* tier (node-local, so flock is reliable
even when the destination is a parallel filesystem).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

from slurm_ckpt.core import fsio
from slurm_ckpt.core.chunks import hash_range, run_chunks
from slurm_ckpt.core.commit import read_manifest
from slurm_ckpt.core.faults import crashpoint
from slurm_ckpt.core.layout import partial_dirname, step_dirname
from slurm_ckpt.core.manifest import MANIFEST_NAME, Manifest
from slurm_ckpt.core.progress import ProgressFn, report
from slurm_ckpt.core.verify import open_payload, verify_files
from slurm_ckpt.errors import CkptError, VerifyError
from slurm_ckpt.tiers.posix import PosixTier


@dataclass
class CopyResult:
    """What one copy did: bytes moved, time, and whether it resumed or found it done."""

    step: int
    nbytes: int
    copied_bytes: int
    seconds: float
    already_present: bool = False
    resumed_files: int = 0

    @property
    def rate(self) -> float:
        return self.copied_bytes / self.seconds if self.seconds > 0 else 0.0


class SourceCorrupt(VerifyError):
    """The source's bytes do not match its own manifest; it must not be propagated."""


def copy_checkpoint(
    src: PosixTier,
    dst: PosixTier,
    user: str,
    key: str,
    step: int,
    *,
    streams: Optional[int] = None,
    reread: bool = False,
    progress: Optional[ProgressFn] = None,
) -> CopyResult:
    """Copy ``user/key/step`` from ``src`` to ``dst``; verified, resumable, idempotent.

    ``reread`` additionally drops the destination from the page cache after fsync and
    hashes it again from the device (twice the I/O; for sites that distrust their storage
    path). The bandwidth cap of ``dst`` applies to the copy. ``progress(nbytes)`` hears
    of every copied (or already present) byte, for progress bars.
    """
    streams = streams or dst.streams
    t0 = time.monotonic()
    with src.step_lock(user, key, step), src.step_fd(user, key, step) as sfd:
        where_src = src.where(user, key, step)
        raw = fsio.read_small(sfd, MANIFEST_NAME)
        manifest = Manifest.from_bytes(raw, where_src)
        if (manifest.user, manifest.key, manifest.step) != (user, key, step):
            raise VerifyError(f"{where_src}: manifest names another checkpoint")
        with dst.key_fd(user, key, create=True) as kfd:
            where_dst = dst.where(user, key, step)
            if _committed_same(kfd, step, raw, where_dst):
                report(progress, manifest.total_bytes)
                return CopyResult(
                    step, manifest.total_bytes, 0, time.monotonic() - t0, already_present=True
                )
            try:
                copied, resumed = _copy_into(
                    sfd, kfd, manifest, raw, streams, dst, where_dst, reread, progress
                )
            except SourceCorrupt:
                _discard(kfd, partial_dirname(step))
                raise
            except OSError as exc:
                # ENOSPC and friends: give the space back, keep nothing half-made.
                _discard(kfd, partial_dirname(step))
                raise fsio.tier_error(exc, f"copy to {where_dst}") from None
    return CopyResult(
        step, manifest.total_bytes, copied, time.monotonic() - t0, resumed_files=resumed
    )


def _committed_same(kfd: int, step: int, raw: bytes, where: str) -> bool:
    """True when the destination already holds this exact checkpoint, committed."""
    try:
        sfd = os.open(step_dirname(step), fsio.O_DIR, dir_fd=kfd)
    except FileNotFoundError:
        return False
    try:
        existing = fsio.read_small(sfd, MANIFEST_NAME)
    except FileNotFoundError:
        os.close(sfd)
        fsio.remove_tree(kfd, step_dirname(step))  # debris of a crashed commit
        return False
    os.close(sfd)
    if existing != raw:
        raise CkptError(f"{where}: a different checkpoint with this step is already committed")
    return True


def _discard(kfd: int, name: str) -> None:
    with contextlib.suppress(OSError):
        fsio.remove_tree(kfd, name)


def _copy_into(
    sfd: int,
    kfd: int,
    m: Manifest,
    raw: bytes,
    streams: int,
    dst: PosixTier,
    where: str,
    reread: bool,
    progress: Optional[ProgressFn] = None,
) -> tuple[int, int]:
    pname = partial_dirname(m.step)
    try:
        os.mkdir(pname, fsio.DIR_MODE, dir_fd=kfd)
        os.fsync(kfd)
    except FileExistsError:
        pass
    pfd = os.open(pname, fsio.O_DIR, dir_fd=kfd)
    dirs: Dict[str, int] = {"": pfd}
    src_fds: List[Optional[int]] = []
    dst_fds: List[Optional[int]] = []
    try:
        keep = _resumable(pfd, m, dirs)
        todo = [e for e in m.files if e.path not in keep]
        report(progress, sum(e.size for e in m.files if e.path in keep))
        for e in todo:
            parts = e.path.split("/")
            parent = _subdir(dirs, parts[:-1])
            src_fds.append(open_payload(sfd, e.path))
            fd = os.open(parts[-1], fsio.O_NEWFILE, fsio.FILE_MODE, dir_fd=parent)
            dst_fds.append(fd)
            if e.size:
                try:
                    os.posix_fallocate(fd, 0, e.size)  # fail fast on a full filesystem
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
        crashpoint("copy:files-created")

        def op(fi: int, ci: int, off: int, n: int) -> str:
            got = hash_range(
                src_fds[fi],
                off,
                n,
                dst_fds[fi],
                dst.limiter,
                dst.buffer_size,  # type: ignore[arg-type]
            )
            if got != todo[fi].chunks[ci]:
                raise SourceCorrupt(
                    f"source {todo[fi].path}: bytes {off}-{off + n} do not match the manifest"
                )
            crashpoint("copy:chunk")
            report(progress, n)
            return got

        def done(fi: int) -> None:
            os.fsync(dst_fds[fi])  # type: ignore[arg-type]
            crashpoint("copy:file-synced")

        run_chunks([e.size for e in todo], m.chunk_size, op, done, streams)
        if reread:
            for fd in dst_fds:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # type: ignore[arg-type]
            rep = verify_files(pfd, m, where, streams)
            if not rep.ok:
                raise VerifyError(f"{where}: re-read after copy failed: {rep.problems[0]}")
        for sub in sorted(dirs, key=len, reverse=True):
            os.fsync(dirs[sub])
        crashpoint("copy:dirs-synced")
        os.rename(pname, step_dirname(m.step), src_dir_fd=kfd, dst_dir_fd=kfd)
        crashpoint("copy:renamed")
        os.fsync(kfd)
        fsio.atomic_replace(pfd, MANIFEST_NAME, raw)
        crashpoint("copy:manifest")
        return sum(e.size for e in todo), len(keep)
    finally:
        for fd in src_fds + dst_fds:
            if fd is not None:
                os.close(fd)
        for fd in set(dirs.values()):
            os.close(fd)


def _subdir(dirs: Dict[str, int], parts: List[str]) -> int:
    key = "/".join(parts)
    if key not in dirs:
        parent = _subdir(dirs, parts[:-1])
        dirs[key] = fsio.open_beneath(parent, [parts[-1]], create=True)
    return dirs[key]


def _resumable(pfd: int, m: Manifest, dirs: Dict[str, int]) -> set[str]:
    """Files of an interrupted copy that are complete and correct; the rest is removed."""
    files, problems = fsio.walk_files(pfd)
    if not files and not problems:
        return set()
    wanted = {e.path: e for e in m.files}
    keep = set()
    for rel, st in files:
        e = wanted.get(rel)
        ok = False
        if e is not None and st.st_size == e.size:
            fd = open_payload(pfd, rel)
            try:
                ok = all(
                    hash_range(fd, i * m.chunk_size, min(m.chunk_size, e.size - i * m.chunk_size))
                    == c
                    for i, c in enumerate(e.chunks)
                )
            finally:
                os.close(fd)
        if ok:
            keep.add(rel)
        else:
            parts = rel.split("/")
            os.unlink(parts[-1], dir_fd=_subdir(dirs, parts[:-1]))
    if problems:
        # Symlinks or special files in our own work area: start the copy over.
        for fd in set(dirs.values()) - {pfd}:
            os.close(fd)
        for k in [k for k in dirs if k]:
            del dirs[k]
        for name in os.listdir(pfd):
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                fsio.remove_tree(pfd, name)
            else:
                os.unlink(name, dir_fd=pfd)
        return set()
    return keep


__all__ = ["copy_checkpoint", "CopyResult", "SourceCorrupt", "read_manifest"]
