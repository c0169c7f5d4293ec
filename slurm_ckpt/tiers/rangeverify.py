"""Verify a checkpoint through ranged reads: for tiers that have no file descriptors
(an object store), and for checking what a writer put there before its commit.

The same rules as :func:`slurm_ckpt.core.verify.verify_files`: every file of the
manifest must exist with its size, and every chunk must hash to its digest; problems
come back one line each. Chunks are read in parallel (``streams``), each in pieces of
``piece`` bytes into a reusable per-thread buffer, hashed as they arrive.
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional

import xxhash

from slurm_ckpt.core.chunks import PIECE, BandwidthLimiter, io_buffer, run_chunks
from slurm_ckpt.core.hashing import combine
from slurm_ckpt.core.manifest import FileEntry, Manifest
from slurm_ckpt.core.progress import ProgressFn, report
from slurm_ckpt.core.verify import VerifyReport
from slurm_ckpt.errors import CkptError
from slurm_ckpt.tiers.base import RangeSource

__all__ = ["hash_source_range", "verify_sources"]


def hash_source_range(
    src: RangeSource,
    offset: int,
    length: int,
    limiter: Optional[BandwidthLimiter] = None,
    piece: int = PIECE,
) -> str:
    """xxh3-128 of ``length`` bytes at ``offset`` of ``src`` (a short read is an error)."""
    h = xxhash.xxh3_128()
    buf = io_buffer(piece)
    pos, end = offset, offset + length
    while pos < end:
        n = min(piece, end - pos)
        if limiter is not None:
            limiter.acquire(n)
        got = src.readinto(buf[:n], pos)
        if got <= 0:
            raise OSError(f"unexpected end of object at offset {pos}")
        h.update(buf[:got])
        pos += got
    return h.hexdigest()


def _reported(digest: str, progress: Optional[ProgressFn], n: int) -> str:
    report(progress, n)
    return digest


def verify_sources(
    open_source: Callable[[FileEntry], RangeSource],
    manifest: Manifest,
    where: str,
    streams: int = 4,
    limiter: Optional[BandwidthLimiter] = None,
    piece: int = PIECE,
    progress: Optional[ProgressFn] = None,
) -> VerifyReport:
    """Check every payload file of ``manifest`` as opened by ``open_source``
    (``progress(nbytes)`` hears of every chunk hashed)."""
    t0 = time.monotonic()
    problems: List[str] = []
    sources: List[Optional[RangeSource]] = []
    sizes: List[int] = []
    for entry in manifest.files:
        try:
            src = open_source(entry)
        except CkptError as exc:
            problems.append(f"{entry.path}: {exc}")
            sources.append(None)
            sizes.append(0)
            continue
        if src.size != entry.size:
            problems.append(f"{entry.path}: size {src.size} != {entry.size}")
            src.close()
            sources.append(None)
            sizes.append(0)
            continue
        sources.append(src)
        sizes.append(entry.size)
    try:
        digests = run_chunks(
            sizes,
            manifest.chunk_size,
            lambda fi, ci, off, n: _reported(
                hash_source_range(sources[fi], off, n, limiter, piece),  # type: ignore[arg-type]
                progress,
                n,
            ),
            lambda fi: None,
            streams,
        )
    except (OSError, CkptError) as exc:
        problems.append(f"read failed: {exc}")
        digests = []
    finally:
        for s in sources:
            if s is not None:
                s.close()
    for entry, src, got in zip(manifest.files, sources, digests):
        if src is None:
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
