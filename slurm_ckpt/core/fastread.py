"""Read whole payload files into fresh memory at device speed, verifying as they arrive.

Why not plain buffered reads into ``torch.empty`` tensors: a restore is the one moment a
job waits for storage with nothing else to do, and on this path three costs pile up that
have nothing to do with the device:

* **the page cache copy**: a buffered read lands in the page cache and is then copied
  into the destination, and the kernel's readahead keeps one stream's queue shallow;
* **first-touch page faults**: a fresh 1 GiB allocation takes ~262,000 faults of 4 KiB
  pages (zeroing included) before a single byte is read;
* **a second pass to verify**.

So a file is read into one anonymous, private mapping per file, advised for transparent
huge pages (512x fewer faults), with ``O_DIRECT`` requests of a whole hash chunk each
(the block layer splits one into many requests in flight, so a few threads keep the
device's queue deep), and each chunk is hashed by the thread that read it, right after
its read, while other chunks are still in flight. When a chunk is already in the page
cache (a requeue on the same node restores what it wrote minutes ago) a direct read would
fetch it from the device again, so ``cachestat(2)`` is asked first and a cached chunk is
copied from the cache instead.

Each feature degrades on its own: no ``O_DIRECT`` (tmpfs, some FUSE mounts) or a refused
alignment means buffered reads; no ``cachestat`` (kernels before 6.5) means direct reads
of cached data too; no THP means 4 KiB pages.

The callers build their objects as views into the returned mapping (each view keeps it
alive), so the bytes are never copied again.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, List, NamedTuple, Optional, Sequence

import xxhash

from slurm_ckpt.core.hashing import combine
from slurm_ckpt.core.manifest import FileEntry
from slurm_ckpt.errors import VerifyError

__all__ = ["DIO_ALIGN", "READ_STREAMS", "ReadJob", "alloc", "read_files"]

#: Offsets, lengths and addresses of direct reads are multiples of this (covers 512-byte
#: and 4 KiB logical blocks).
DIO_ALIGN = 4096
#: Reader threads: each one mostly waits for its direct read, so this is about the
#: device's queue (8 x 64 MiB in flight reached the device's rate on virtio and NVMe),
#: not about the number of cores.
READ_STREAMS = 8
_HUGE = 2 * 2**20
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _round_up(n: int, a: int) -> int:
    return -(-n // a) * a


def alloc(nbytes: int) -> mmap.mmap:
    """Fresh private anonymous memory for ``nbytes`` (at least one page), advised for
    transparent huge pages, with slack so a direct read may round its length up."""
    size = max(_round_up(nbytes + DIO_ALIGN, _HUGE if nbytes >= _HUGE else DIO_ALIGN), DIO_ALIGN)
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None and nbytes >= _HUGE:
        with contextlib.suppress(OSError):  # THP "never": 4 KiB pages, still correct
            mm.madvise(advice)
    return mm


class ReadJob(NamedTuple):
    """One payload file to read: its manifest entry and an open fd (buffered), or,
    where there is no fd (an object store), a ``source`` with ``size`` and
    ``readinto(buf, offset)`` (each chunk is then one ranged read into its memory)."""

    name: str
    entry: FileEntry
    fd: Optional[int]
    source: Any = None


def _open_direct(fd: int) -> Optional[int]:
    """A second, ``O_DIRECT`` descriptor of the file open on ``fd`` (None: unsupported).

    Re-opened through ``/proc/self/fd`` so that it is the very same inode (no path
    lookup a user could race); checked with fstat anyway."""
    if not _O_DIRECT:
        return None
    try:
        dfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC | _O_DIRECT)
    except OSError:
        return None
    a, b = os.fstat(fd), os.fstat(dfd)
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):  # pragma: no cover - cannot happen
        os.close(dfd)
        return None
    return dfd


class _CacheStat:
    """``cachestat(2)`` (Linux 6.5+): how much of a file range is in the page cache,
    asked without reading it. (A ``RWF_NOWAIT`` probe would answer too, but on a miss it
    starts readahead of the range, which then competes with the direct read.)"""

    NR = {"x86_64": 451, "aarch64": 451, "ppc64le": 451, "riscv64": 451, "s390x": 451}

    class _Range(ctypes.Structure):
        _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]

    class _Stat(ctypes.Structure):
        _fields_ = [(n, ctypes.c_uint64) for n in ("cache", "dirty", "wb", "ev", "rev")]

    def __init__(self) -> None:
        self.nr = self.NR.get(os.uname().machine)
        self.fn: Optional[Callable[..., int]] = None
        self.page = mmap.PAGESIZE
        if self.nr is not None:
            with contextlib.suppress(OSError, AttributeError):
                self.fn = ctypes.CDLL(None, use_errno=True).syscall

    def cached(self, fd: int, offset: int, length: int) -> Optional[bool]:
        """True when every page of the range is cached; None when the kernel cannot tell."""
        if self.fn is None:
            return None
        rng, st = self._Range(offset, length), self._Stat()
        rc = self.fn(
            ctypes.c_long(self.nr), ctypes.c_int(fd), ctypes.byref(rng), ctypes.byref(st), 0
        )
        if rc != 0:
            self.fn = None  # ENOSYS (older kernel) or blocked by seccomp: stop asking
            return None
        pages = (offset + length - 1) // self.page - offset // self.page + 1
        return st.cache >= pages


_CACHESTAT = _CacheStat()


def _read_direct(dfd: int, mm_view: memoryview, start: int, end: int, offset: int) -> int:
    """Direct reads of ``[start, end)`` of the chunk at file ``offset`` into ``mm_view``
    (which has room to round the length up); returns the position reached."""
    pos = start
    while pos < end:
        length = _round_up(end - pos, DIO_ALIGN)
        n = os.preadv(dfd, [mm_view[pos : pos + length]], offset + pos)
        if n <= 0:
            break
        pos += n
        if n % DIO_ALIGN:  # end of file
            break
    return min(pos, end)


def _read_buffered(fd: int, view: memoryview, start: int, offset: int) -> int:
    pos = start
    while pos < len(view):
        n = os.preadv(fd, [view[pos:]], offset + pos)
        if n <= 0:
            break
        pos += n
    return pos


def _read_source(source: Any, view: memoryview, offset: int) -> int:
    """Ranged reads of a whole chunk from a descriptor-less source."""
    pos = 0
    while pos < len(view):
        n = source.readinto(view[pos:], offset + pos)
        if n <= 0:
            break
        pos += n
    return pos


def read_files(
    jobs: Sequence[ReadJob],
    chunk_size: int,
    *,
    streams: int = READ_STREAMS,
    where: str = "checkpoint",
    cancelled: Callable[[], bool] = lambda: False,
) -> List[mmap.mmap]:
    """Read every file of ``jobs`` into its own fresh mapping and verify it chunk by chunk
    against its manifest entry; returns the mappings in ``jobs`` order.

    Raises :class:`VerifyError` on a size or hash mismatch or a read error, and
    :class:`InterruptedError` when ``cancelled()`` turns true (checked between chunks).
    """
    bufs: List[mmap.mmap] = []
    dfds: List[Optional[int]] = []  # per job; None once direct reads are refused
    opened: List[int] = []
    tasks = []
    try:
        for i, job in enumerate(jobs):
            entry = job.entry
            size = os.fstat(job.fd).st_size if job.fd is not None else int(job.source.size)
            if size != entry.size:
                raise VerifyError(f"{where}: {job.name}: size {size} != {entry.size}")
            if combine(entry.chunks) != entry.hash:
                raise VerifyError(f"{where}: {job.name}: manifest hash inconsistent")
            mm = alloc(entry.size)
            bufs.append(mm)
            dfd = _open_direct(job.fd) if job.fd is not None and entry.size >= DIO_ALIGN else None
            dfds.append(dfd)
            if dfd is not None:
                opened.append(dfd)
            for ci, want in enumerate(entry.chunks):
                c0 = ci * chunk_size
                tasks.append((i, c0, min(c0 + chunk_size, entry.size), want))

        def run(task: tuple) -> None:  # type: ignore[type-arg]
            i, c0, c1, want = task
            if cancelled():
                raise InterruptedError("read cancelled")
            job, dfd = jobs[i], dfds[i]
            whole = memoryview(bufs[i])
            view = whole[c0:c1]
            pos = 0
            try:
                if job.fd is None:
                    pos = _read_source(job.source, view, c0)
                elif dfd is not None and not _CACHESTAT.cached(job.fd, c0, c1 - c0):
                    try:
                        pos = _read_direct(dfd, whole[c0:], 0, c1 - c0, c0)
                    except OSError as exc:
                        if exc.errno != errno.EINVAL:
                            raise
                        dfds[i] = None  # alignment refused: buffered from here on
                if pos < len(view) and job.fd is not None:
                    pos = _read_buffered(job.fd, view, pos, c0)
            except OSError as exc:
                raise VerifyError(
                    f"{where}: {job.name}: read failed ({exc.strerror or exc})"
                ) from None
            if pos < len(view):
                raise VerifyError(f"{where}: {job.name}: unexpected end of file at {c0 + pos}")
            if xxhash.xxh3_128_hexdigest(view) != want:
                raise VerifyError(f"{where}: {job.name}: content hash mismatch (bytes {c0}-{c1})")

        if len(tasks) <= 1 or streams <= 1:
            for t in tasks:
                run(t)
        else:
            with ThreadPoolExecutor(
                max_workers=min(streams, len(tasks)), thread_name_prefix="ckpt-read"
            ) as pool:
                futures = [pool.submit(run, t) for t in tasks]
                try:
                    for fut in futures:
                        fut.result()
                except BaseException:
                    for fut in futures:
                        fut.cancel()
                    raise
    finally:
        for dfd in opened:
            os.close(dfd)
    return bufs
