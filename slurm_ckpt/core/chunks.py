"""Parallel work over the fixed-size chunks of many files, plus a bandwidth cap.

Both the writer (memory -> tier) and the copy engine (tier -> tier) move data as
independent chunks so that several streams keep a disk or a parallel filesystem busy, and
so that each chunk is hashed while it is in memory anyway. A file is fsynced by the
stream that finishes its last chunk.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Optional, Sequence

import xxhash

from slurm_ckpt.core.fsio import write_all


class BandwidthLimiter:
    """A token bucket shared by all streams, so a flush cannot flood a shared filesystem."""

    def __init__(self, bytes_per_s: float, burst_s: float = 0.25) -> None:
        self.rate = float(bytes_per_s)
        self.capacity = max(self.rate * burst_s, 1.0)
        self._tokens = self.capacity
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def acquire(self, n: int) -> None:
        """Block until ``n`` bytes may pass (n may exceed the burst; debt is paid by waiting)."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.capacity, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)


ChunkOp = Callable[[int, int, int, int], str]


def run_chunks(
    sizes: Sequence[int],
    chunk_size: int,
    op: ChunkOp,
    on_file_done: Callable[[int], None],
    streams: int = 4,
) -> List[List[str]]:
    """Run ``op(file, chunk, offset, length) -> digest`` over every chunk of every file.

    Returns the digests per file in chunk order. ``on_file_done(file)`` runs once per file
    after its last chunk (at once for empty files). The first error stops the remaining
    work and is re-raised.
    """
    digests: List[List[Optional[str]]] = [
        [None] * ((s + chunk_size - 1) // chunk_size) for s in sizes
    ]
    remaining = [len(d) for d in digests]
    lock = threading.Lock()
    failed: List[BaseException] = []

    for i, n in enumerate(remaining):
        if n == 0:
            on_file_done(i)

    def work(fi: int, ci: int) -> None:
        if failed:
            return
        off = ci * chunk_size
        try:
            digests[fi][ci] = op(fi, ci, off, min(chunk_size, sizes[fi] - off))
            with lock:
                remaining[fi] -= 1
                last = remaining[fi] == 0
            if last:
                on_file_done(fi)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            failed.append(exc)

    items = [(fi, ci) for fi, d in enumerate(digests) for ci in range(len(d))]
    if streams <= 1 or len(items) <= 1:
        for fi, ci in items:
            work(fi, ci)
    else:
        with ThreadPoolExecutor(max_workers=streams, thread_name_prefix="ckpt-io") as pool:
            for f in [pool.submit(work, fi, ci) for fi, ci in items]:
                f.result()
    if failed:
        raise failed[0]
    return [[d for d in ds if d is not None] for ds in digests]


_tls = threading.local()
PIECE = 16 * 2**20


def io_buffer(size: int) -> memoryview:
    """A reusable, page-aligned I/O buffer per thread (allocated once, never per chunk)."""
    buf = getattr(_tls, "buf", None)
    if buf is None or len(buf) < size:
        buf = _tls.buf = memoryview(mmap.mmap(-1, size))
    return buf


#: ``read(buf, offset) -> bytes read``; ``write(view, offset)``.
ReadAt = Callable[[memoryview, int], int]
WriteAt = Callable[[memoryview, int], None]


class ShortRead(OSError):
    """A read ended at ``at``, before the bytes the manifest promises: the file is shorter
    than its manifest says (truncated), or shrank under us. An ``OSError`` with EIO (what
    callers caught before), with the offset kept so that a copy can say what ``verify``
    says of the same file: ``size AT != SIZE``."""

    def __init__(self, at: int) -> None:
        super().__init__(errno.EIO, f"unexpected end of file at offset {at}")
        self.at = at


def hash_pieces(
    read: ReadAt,
    offset: int,
    length: int,
    write: Optional[WriteAt] = None,
    limiter: Optional[BandwidthLimiter] = None,
    piece: int = PIECE,
    into: Optional[Callable[[int, int], memoryview]] = None,
) -> str:
    """Read ``length`` bytes at ``offset`` in pieces into this thread's reusable buffer,
    hash them, and optionally write each piece to the same offset elsewhere: one pass
    through memory, for copy and verify alike, on any tier (``read``/``write`` are a
    file's ``preadv``/``pwrite``, or an object store's ranged GET and part upload).
    With ``into(pos, n)`` (the destination's own memory for those bytes, e.g. an object
    part's buffer) pieces are read straight there and ``write`` only hears that they
    are: no copy between two buffers.

    A short read (the file shrank under us) raises EIO-like ``OSError``.
    """
    h = xxhash.xxh3_128()
    buf = io_buffer(piece) if into is None else None
    end = offset + length
    pos = offset
    while pos < end:
        n = min(piece, end - pos)
        if limiter is not None:
            limiter.acquire(n)
        target = buf[:n] if buf is not None else into(pos, n)  # type: ignore[misc]
        got = read(target, pos)
        if got <= 0:
            raise ShortRead(pos)
        view = target[:got]
        h.update(view)
        if write is not None:
            write(view, pos)
        pos += got
    return h.hexdigest()


def hash_range(
    fd: int,
    offset: int,
    length: int,
    out_fd: Optional[int] = None,
    limiter: Optional[BandwidthLimiter] = None,
    piece: int = PIECE,
) -> str:
    """:func:`hash_pieces` over file descriptors (``out_fd``: also copy there)."""
    write = None if out_fd is None else (lambda view, pos: write_all(out_fd, view, pos))
    return hash_pieces(
        lambda buf, pos: os.preadv(fd, [buf], pos), offset, length, write, limiter, piece
    )
