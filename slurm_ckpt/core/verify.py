"""Re-hash a committed checkpoint and compare every byte with its manifest.

Verification is what turns "a directory with files" into "a checkpoint we may resume
from": sizes, chunk digests and the file hash must all match, no file may be missing, and
no payload path may be a symlink or special file (those fail the ``O_NOFOLLOW`` open).
One verifier (:func:`verify_sources`) for every tier: files below a step directory
(:func:`verify_files`) and objects read by range (the object tier, and what a writer put
there before its commit) alike.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Protocol

from slurm_ckpt.core import fsio
from slurm_ckpt.core.chunks import PIECE, BandwidthLimiter, hash_pieces, run_chunks
from slurm_ckpt.core.hashing import combine
from slurm_ckpt.core.manifest import MANIFEST_NAME, FileEntry, Manifest
from slurm_ckpt.core.progress import ProgressFn, report
from slurm_ckpt.errors import CkptError

__all__ = [
    "ChunkSource",
    "VerifyReport",
    "open_payload",
    "verdict",
    "verify_files",
    "verify_sources",
]


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


class ChunkSource(Protocol):
    """One payload file open for ranged reads: a file descriptor here, an object's ranged
    GETs on the object tier (its ``RangeSource`` has this shape)."""

    size: int

    def readinto(self, buf: memoryview, offset: int) -> int: ...

    def close(self) -> None: ...


class _FdSource:
    """A payload file's descriptor as a :class:`ChunkSource` (closes it on ``close``)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.size = os.fstat(fd).st_size

    def readinto(self, buf: memoryview, offset: int) -> int:
        return os.preadv(self.fd, [buf], offset)

    def close(self) -> None:
        os.close(self.fd)


def verify_files(
    step_fd: int,
    manifest: Manifest,
    where: str,
    streams: int = 4,
    limiter: Optional[BandwidthLimiter] = None,
    piece: int = PIECE,
    progress: Optional[ProgressFn] = None,
) -> VerifyReport:
    """Check every payload file of ``manifest`` in the open step directory (each opened
    with :func:`open_payload`): :func:`verify_sources` over file descriptors."""
    return verify_sources(
        lambda entry: _FdSource(open_payload(step_fd, entry.path)),
        manifest,
        where,
        streams,
        limiter,
        piece,
        progress,
    )


def _hashed(digest: str, progress: Optional[ProgressFn], nbytes: int) -> str:
    report(progress, nbytes)
    return digest


def verify_sources(
    open_source: Callable[[FileEntry], ChunkSource],
    manifest: Manifest,
    where: str,
    streams: int = 4,
    limiter: Optional[BandwidthLimiter] = None,
    piece: int = PIECE,
    progress: Optional[ProgressFn] = None,
) -> VerifyReport:
    """The one chunk verifier: check every payload file of ``manifest`` as opened by
    ``open_source`` (a file below a step directory, an object in a bucket). Every file
    must open with its size and every chunk hash to its digest; chunks are read in
    parallel (``streams``), each in pieces of ``piece`` bytes into a reusable per-thread
    buffer, hashed as they arrive. ``progress(nbytes)`` hears of every chunk hashed (from
    the worker threads), so a command can show how far a multi-GiB verification is."""
    t0 = time.monotonic()
    problems: List[str] = []
    sources: List[Optional[ChunkSource]] = []
    sizes: List[int] = []
    for entry in manifest.files:
        try:
            src = open_source(entry)
        except OSError as exc:
            problems.append(f"{entry.path}: {fsio.tier_error(exc, 'open')}")
        except CkptError as exc:
            problems.append(f"{entry.path}: {exc}")
        else:
            if src.size == entry.size:
                sources.append(src)
                sizes.append(entry.size)
                continue
            problems.append(f"{entry.path}: size {src.size} != {entry.size}")
            src.close()
        sources.append(None)
        sizes.append(0)
    try:
        digests = run_chunks(
            sizes,
            manifest.chunk_size,
            lambda fi, ci, off, n: _hashed(
                hash_pieces(sources[fi].readinto, off, n, None, limiter, piece),  # type: ignore[union-attr]
                progress,
                n,
            ),
            lambda fi: None,
            streams,
        )
    except OSError as exc:
        problems.append(str(fsio.tier_error(exc, "read")))
        digests = []
    except CkptError as exc:
        problems.append(f"read failed: {exc}")
        digests = []
    finally:
        for src in sources:
            if src is not None:
                src.close()
    return verdict(manifest, where, [src is not None for src in sources], digests, problems, t0)


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
