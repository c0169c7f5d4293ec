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

from slurm_ckpt.core.chunks import PIECE, BandwidthLimiter, hash_pieces, run_chunks
from slurm_ckpt.core.manifest import FileEntry, Manifest
from slurm_ckpt.core.progress import ProgressFn, report
from slurm_ckpt.core.verify import VerifyReport, verdict
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
    return hash_pieces(src.readinto, offset, length, None, limiter, piece)


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
    return verdict(manifest, where, [s is not None for s in sources], digests, problems, t0)
