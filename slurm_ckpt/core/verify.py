"""Re-hash a committed checkpoint and compare every byte with its manifest.

Verification is what turns "a directory with files" into "a checkpoint we may resume
from": sizes, chunk digests and the file hash must all match, no file may be missing, and
no payload path may be a symlink or special file (those fail the ``O_NOFOLLOW`` open).
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from dataclasses import dataclass, field
from typing import List, Optional

from slurm_ckpt.core import fsio
from slurm_ckpt.core.chunks import PIECE, BandwidthLimiter, hash_range, run_chunks
from slurm_ckpt.core.hashing import combine
from slurm_ckpt.core.manifest import MANIFEST_NAME, Manifest
from slurm_ckpt.core.progress import ProgressFn, report


@dataclass
class VerifyReport:
    """Outcome of one verification; ``problems`` holds one line per mismatch."""

    where: str
    step: int
    ok: bool
    nbytes: int = 0
    seconds: float = 0.0
    problems: List[str] = field(default_factory=list)

    def summary(self) -> str:
        if self.ok:
            return f"{self.where}: OK ({self.nbytes} bytes in {self.seconds:.2f}s)"
        return f"{self.where}: CORRUPT: " + "; ".join(self.problems[:5])


def open_payload(step_fd: int, relpath: str) -> int:
    """Open a payload file for reading below ``step_fd`` without following symlinks or
    blocking, refused unless it is a regular file with one link owned by its directory's
    owner (:func:`~slurm_ckpt.core.fsio.open_regular`: a FIFO must not hang root's
    ``verify``, a hard link must not make it read someone else's file)."""
    parts = relpath.split("/")
    pfd = fsio.open_beneath(step_fd, parts[:-1])
    try:
        return fsio.open_regular(pfd, parts[-1])[0]
    finally:
        os.close(pfd)


def _hashed(digest: str, progress: Optional[ProgressFn], nbytes: int) -> str:
    report(progress, nbytes)
    return digest


def verify_files(
    step_fd: int,
    manifest: Manifest,
    where: str,
    streams: int = 4,
    limiter: Optional[BandwidthLimiter] = None,
    piece: int = PIECE,
    progress: Optional[ProgressFn] = None,
) -> VerifyReport:
    """Check every payload file of ``manifest`` in the open step directory.

    ``progress(nbytes)`` is called after each chunk is hashed (from the worker threads),
    so that a command can show how far a multi-GiB verification is.
    """
    t0 = time.monotonic()
    problems: List[str] = []
    fds: List[Optional[int]] = []
    sizes: List[int] = []
    for entry in manifest.files:
        fd: Optional[int] = None
        try:
            fd = open_payload(step_fd, entry.path)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                problems.append(f"{entry.path}: not a regular file")
            elif st.st_size != entry.size:
                problems.append(f"{entry.path}: size {st.st_size} != {entry.size}")
            else:
                fds.append(fd)
                sizes.append(entry.size)
                continue
        except OSError as exc:
            problems.append(f"{entry.path}: {fsio.tier_error(exc, 'open')}")
        if fd is not None:
            os.close(fd)
        fds.append(None)
        sizes.append(0)
    try:
        digests = run_chunks(
            sizes,
            manifest.chunk_size,
            lambda fi, ci, off, n: _hashed(
                hash_range(fds[fi], off, n, limiter=limiter, piece=piece),  # type: ignore[arg-type]
                progress,
                n,
            ),
            lambda fi: None,
            streams,
        )
    except OSError as exc:
        problems.append(str(fsio.tier_error(exc, "read")))
        digests = []
    finally:
        for fd in fds:
            if fd is not None:
                os.close(fd)
    return verdict(manifest, where, [fd is not None for fd in fds], digests, problems, t0)


#: At most this many unlisted entries are named (a directory full of debris is one finding).
UNLISTED_MAX = 20


def unlisted_files(step_fd: int, manifest: Manifest, limit: int = UNLISTED_MAX) -> List[str]:
    """Entries of the step directory that the manifest does not list (besides the
    manifest itself): a file dropped in after the commit, a directory of stray output.

    Their bytes are not part of the checkpoint, so they do not make it CORRUPT (a restore
    ignores them and the listed bytes may verify), but ``verify`` names them: a directory
    that is not exactly its manifest is a finding. Read without following symlinks; an
    unlisted directory is named once (``dir/``), not walked; a listed directory that cannot
    be opened is left to :func:`verify_files`, which names its missing files.
    """
    listed = {f.path for f in manifest.files} | {MANIFEST_NAME}
    dirs = {p.rsplit("/", i)[0] for p in listed for i in range(1, p.count("/") + 1)}
    out: List[str] = []
    stack = [(os.dup(step_fd), "")]
    try:
        while stack and len(out) < limit:
            fd, prefix = stack.pop()
            try:
                for name in sorted(os.listdir(fd)):
                    rel = prefix + name
                    if rel in listed:
                        continue
                    if rel in dirs:
                        with contextlib.suppress(OSError):
                            stack.append((os.open(name, fsio.O_DIR, dir_fd=fd), rel + "/"))
                        continue
                    try:
                        mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
                    except OSError:
                        mode = 0
                    out.append(rel + ("/" if stat.S_ISDIR(mode) else ""))
            finally:
                os.close(fd)
    finally:
        for fd, _ in stack:
            os.close(fd)
    return out[:limit]


def verdict(
    manifest: Manifest,
    where: str,
    read: List[bool],
    digests: List[List[str]],
    problems: List[str],
    t0: float,
) -> VerifyReport:
    """The verdict over every file of ``manifest``: ``digests`` are the chunk digests of the
    files that were ``read`` (in manifest order), compared with the manifest's; each
    mismatch says where it is. For verifiers of every tier."""
    for entry, was_read, got in zip(manifest.files, read, digests):
        if not was_read:
            continue
        bad = [i for i, (a, b) in enumerate(zip(got, entry.chunks)) if a != b]
        if bad or combine(got) != entry.hash:
            cs = manifest.chunk_size
            at = ", ".join(f"bytes {i * cs}-{min((i + 1) * cs, entry.size)}" for i in bad[:3])
            problems.append(f"{entry.path}: content hash mismatch ({at or 'file hash'})")
    return VerifyReport(
        where=where,
        step=manifest.step,
        ok=not problems,
        nbytes=manifest.total_bytes,
        seconds=time.monotonic() - t0,
        problems=problems,
    )
