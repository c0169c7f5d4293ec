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
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import xxhash

from slurm_ckpt.core.hashing import combine
from slurm_ckpt.core.manifest import FileEntry
from slurm_ckpt.errors import VerifyError

__all__ = [
    "DIO_ALIGN",
    "READ_STREAMS",
    "ChunkReader",
    "ReadJob",
    "alloc",
    "chunk_ok",
    "read_files",
    "run_tasks",
]

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


class ChunkReader:
    """The files of ``jobs`` open for chunk-by-chunk reads into fresh mappings (one per
    file, :attr:`bufs`), each chunk verified against its manifest hash by the thread
    that read it. :func:`read_files` reads every chunk; a restore shared by a replica
    group (:mod:`slurm_ckpt.job.replica_read`) reads only its own stripe and receives the
    others. ``nbytes_read`` counts what came from storage (for the "read once" claim).
    A context manager: closes the direct descriptors it opened (not the mappings)."""

    def __init__(self, jobs: Sequence[ReadJob], chunk_size: int, where: str) -> None:
        self.jobs, self.chunk_size, self.where = list(jobs), chunk_size, where
        self.bufs: List[mmap.mmap] = []
        self.dfds: List[Optional[int]] = []  # per job; None once direct reads are refused
        self.nbytes_read = 0
        self._lock = threading.Lock()
        self._opened: List[int] = []
        try:
            for job in self.jobs:
                entry = job.entry
                size = os.fstat(job.fd).st_size if job.fd is not None else int(job.source.size)
                if size != entry.size:
                    raise VerifyError(f"{where}: {job.name}: size {size} != {entry.size}")
                if combine(entry.chunks) != entry.hash:
                    raise VerifyError(f"{where}: {job.name}: manifest hash inconsistent")
                self.bufs.append(alloc(entry.size))
                dfd = None
                if job.fd is not None and entry.size >= DIO_ALIGN:
                    dfd = _open_direct(job.fd)
                self.dfds.append(dfd)
                if dfd is not None:
                    self._opened.append(dfd)
        except BaseException:
            self.close()
            raise

    def tasks(self) -> List[Tuple[int, int, int, str]]:
        """Every chunk: ``(file index, start, end, expected hash)``, in file order."""
        out = []
        for i, job in enumerate(self.jobs):
            for ci, want in enumerate(job.entry.chunks):
                c0 = ci * self.chunk_size
                out.append((i, c0, min(c0 + self.chunk_size, job.entry.size), want))
        return out

    def read(self, task: Tuple[int, int, int, str]) -> None:
        """Read one chunk into its place and verify it (:class:`VerifyError` if not)."""
        i, c0, c1, want = task
        job, dfd = self.jobs[i], self.dfds[i]
        whole = memoryview(self.bufs[i])
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
                    self.dfds[i] = None  # alignment refused: buffered from here on
            if pos < len(view) and job.fd is not None:
                pos = _read_buffered(job.fd, view, pos, c0)
        except OSError as exc:
            raise VerifyError(
                f"{self.where}: {job.name}: read failed ({exc.strerror or exc})"
            ) from None
        with self._lock:
            self.nbytes_read += pos
        if pos < len(view):
            raise VerifyError(f"{self.where}: {job.name}: unexpected end of file at {c0 + pos}")
        if not chunk_ok(view, want):
            raise VerifyError(f"{self.where}: {job.name}: content hash mismatch (bytes {c0}-{c1})")

    def close(self) -> None:
        opened, self._opened = self._opened, []
        for dfd in opened:
            os.close(dfd)

    def __enter__(self) -> ChunkReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def chunk_ok(view: Any, want: str) -> bool:
    """Whether a chunk's bytes hash to ``want`` (the manifest's chunk hash)."""
    return bool(xxhash.xxh3_128_hexdigest(view) == want)


def run_tasks(
    fn: Callable[[Any], None], tasks: Sequence[Any], streams: int, name: str = "ckpt-read"
) -> None:
    """``fn`` over ``tasks`` on up to ``streams`` threads; the first error is raised
    (the tasks not yet started are cancelled)."""
    if len(tasks) <= 1 or streams <= 1:
        for t in tasks:
            fn(t)
        return
    with ThreadPoolExecutor(max_workers=min(streams, len(tasks)), thread_name_prefix=name) as pool:
        futures = [pool.submit(fn, t) for t in tasks]
        try:
            for fut in futures:
                fut.result()
        except BaseException:
            for fut in futures:
                fut.cancel()
            raise


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
    with ChunkReader(jobs, chunk_size, where) as cr:

        def run(task: Tuple[int, int, int, str]) -> None:
            if cancelled():
                raise InterruptedError("read cancelled")
            cr.read(task)

        run_tasks(run, cr.tasks(), streams)
        return cr.bufs
