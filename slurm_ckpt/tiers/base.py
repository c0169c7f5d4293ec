"""The Tier protocol: what every storage tier offers, so that the copy engine, restore,
verify, gc and the flush engine work the same over a POSIX tree (node-local NVMe, a
parallel filesystem, an HDD archive) and an object store.

A tier stores checkpoints as ``<user>/<key>/step-N`` and holds to one rule: **a
checkpoint exists once its manifest is committed, last, atomically**. A listing shows
only committed checkpoints; a reader sees a checkpoint whole or not at all; a writer that
dies leaves nothing listable (and, for copies, something :meth:`TierWriter.resumable`
recognises).

Writing
-------
``tier.writer(user, key, step, ...)`` returns a :class:`TierWriter`, a context manager
that **commits on a clean exit** (or at an explicit :meth:`~TierWriter.commit`) and
**aborts on an exception**. Two modes:

* **fresh** (a new checkpoint from memory): :meth:`~TierWriter.write_buffers` and
  :meth:`~TierWriter.open_stream` hash what they write; the manifest is built at commit.
* **copy** (``copy_of=manifest``: the same checkpoint from another tier): the manifest
  is given; payload files are written as ranges through :meth:`~TierWriter.file` sinks,
  in parallel; :meth:`~TierWriter.resumable` names the files an interrupted copy already
  completed; commit writes exactly the given manifest bytes, so both tiers hold the
  byte-identical checkpoint.

Within one chunk (``manifest.chunk_size``) of a file, writes arrive in order from one
thread; chunks of a file may arrive in any order from several threads. (An object store
uploads one part per chunk; a POSIX file takes ``pwrite``.)

Reading
-------
``tier.reader(user, key, step)`` returns a :class:`TierReader` (a context manager) with
the parsed manifest, its exact bytes, and :meth:`~TierReader.open` for each payload file
(a :class:`RangeSource`: ranged reads; ``fileno()`` for a POSIX fast path such as the
direct-I/O restore).

Root's questions
----------------
Root asks a tier before it touches a user's checkpoint there: :meth:`Tier.guard_user`
(may this process write ``user``'s checkpoints here?), :meth:`Tier.guard_step` (may root's
child read this checkpoint's files?), and :meth:`Tier.committed_manifest` (the exact bytes
committed, read the safe way). Each kind answers for its own dangers: a POSIX tree
refuses links and foreign owners (:mod:`slurm_ckpt.tiers.posix_guard`), an object store
refuses a process that is not the owner. A tier kept as directories also offers them
(:meth:`Tier.directory`: :class:`KeyDirs`), for the few callers that walk a series'
directory themselves (gc's debris, damage reports); the others never ask which kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import (
    Any,
    ContextManager,
    Iterator,
    List,
    Mapping,
    Optional,
    Protocol,
    Set,
    Tuple,
    runtime_checkable,
)

from slurm_ckpt.core.chunks import BandwidthLimiter
from slurm_ckpt.core.manifest import FileEntry, Manifest
from slurm_ckpt.core.progress import ProgressFn
from slurm_ckpt.core.verify import VerifyReport

__all__ = [
    "KeyDirs",
    "RangeSink",
    "RangeSource",
    "StepInfo",
    "Tier",
    "TierReader",
    "TierWriter",
]


@dataclass(frozen=True)
class StepInfo:
    """A committed checkpoint as listed on a tier."""

    tier: str
    user: str
    key: str
    step: int
    manifest: Manifest

    @property
    def nbytes(self) -> int:
        return self.manifest.total_bytes


class RangeSource(Protocol):
    """One payload file of a committed checkpoint, open for reading."""

    size: int

    def readinto(self, buf: memoryview, offset: int) -> int:
        """Read up to ``len(buf)`` bytes at ``offset``; returns the count (0 at the end)."""
        ...

    def fileno(self) -> Optional[int]:
        """A real file descriptor for POSIX fast paths (direct I/O), or None."""
        ...

    def close(self) -> None: ...


class RangeSink(Protocol):
    """One payload file of a checkpoint being copied in, open for ranged writes."""

    def write(self, data: memoryview, offset: int) -> None:
        """Write all of ``data`` at ``offset`` (see the module docstring for ordering)."""
        ...

    def finish(self) -> None:
        """Every byte of the file has been written: make it durable."""
        ...

    # A sink may also offer ``buffer_for(offset, n) -> memoryview`` (its own memory for
    # those bytes, within one chunk) and ``wrote(view, offset)`` (they are there): the
    # copy engine then reads the source straight into the sink's memory (the object
    # tier's part buffers) instead of copying between two buffers.


class TierReader(Protocol):
    """A committed checkpoint open for reading (a context manager)."""

    where: str
    manifest: Manifest
    manifest_bytes: bytes

    def open(self, relpath: str) -> RangeSource: ...

    def __enter__(self) -> TierReader: ...

    def __exit__(self, *exc: object) -> None: ...


class TierWriter(Protocol):
    """A checkpoint being written (a context manager: commit on a clean exit, abort on an
    exception; see the module docstring)."""

    where: str

    def write_buffers(self, items: Mapping[str, object]) -> List[FileEntry]:
        """Fresh mode: write in-memory buffers as files, hashed on the way."""
        ...

    def open_stream(self, relpath: str) -> ContextManager[Any]:
        """Fresh mode: a binary stream for producers that emit data piecewise."""
        ...

    def resumable(self) -> Set[str]:
        """Copy mode: payload files an interrupted copy completed and that match the
        manifest (kept); every other leftover is removed."""
        ...

    def file(self, relpath: str, size: int) -> RangeSink:
        """Copy mode: a sink for one payload file of ``size`` bytes (space reserved, so a
        full tier fails here rather than halfway)."""
        ...

    def verify_written(self) -> VerifyReport:
        """Copy mode: read back what was written, bypassing caches where the tier can,
        and check it against the manifest (sites that distrust their storage path)."""
        ...

    def commit(self) -> Manifest:
        """Publish the checkpoint: the manifest last, atomically."""
        ...

    def abort(self) -> None:
        """Remove everything this writer made; nothing of it was ever listable."""
        ...

    def __enter__(self) -> TierWriter: ...

    def __exit__(self, et: object, ev: object, tb: object) -> None: ...


class KeyDirs(Protocol):
    """A tier kept as a tree of directories (``<root>/<user>/<key>/step-N``), opened
    without following a link: the optional capability :meth:`Tier.directory` returns."""

    name: str
    root: str

    def where(self, user: str, key: str, step: Optional[int] = None) -> str: ...

    def key_fd(self, user: str, key: str, create: bool = False) -> ContextManager[int]:
        """The series' directory, open (NotFound when there is none)."""
        ...

    def step_fd(self, user: str, key: str, step: int) -> ContextManager[int]:
        """One step's directory, open (NotFound when there is none)."""
        ...


@runtime_checkable
class Tier(Protocol):
    """One storage tier (see the module docstring).

    ``name`` is the tier's role (``local``, ``pfs``, ``object``, ``cold``); ``kind`` its
    implementation (``posix``, ``s3``). ``streams`` is how many ranges move in parallel,
    ``limiter`` an optional bandwidth cap that copies *into* this tier obey.
    """

    name: str
    kind: str
    streams: int
    chunk_size: int
    buffer_size: int
    limiter: Optional[BandwidthLimiter]
    #: How long :meth:`lock` waits for a step another process holds (None: as long as
    #: it takes); root's children bound it below their own deadline.
    lock_wait: Optional[float]

    def where(self, user: str, key: str, step: Optional[int] = None) -> str:
        """A one-line location for messages (``pfs:/pfs/ckpt/alice/run/step-...``)."""
        ...

    def location(self, user: str, key: str, step: Optional[int] = None) -> str:
        """Where a series or checkpoint lives, as a path or URL (``/pfs/ckpt/alice/run/
        step-...``, ``s3://bucket/prefix/alice/run/step-.../``), for listings."""
        ...

    def check(self, write: bool = False) -> None:
        """Raise a one-line TierError unless the tier is reachable (and writable)."""
        ...

    def check_user(self, user: str) -> None:
        """Raise a one-line TierError unless ``user`` can keep checkpoints here."""
        ...

    def free_bytes(self) -> Optional[int]:
        """Free space, or None where the tier cannot say (object stores)."""
        ...

    def users(self) -> List[str]: ...

    def keys(self, user: str) -> List[str]: ...

    def steps(self, user: str, key: str) -> List[StepInfo]:
        """Committed checkpoints of one series, oldest first."""
        ...

    def series(self) -> Iterator[Tuple[str, str]]:
        """Every ``(user, key)`` on the tier."""
        ...

    def manifest(self, user: str, key: str, step: int) -> Manifest:
        """The committed manifest (NotFound, or VerifyError when it does not check)."""
        ...

    def manifest_bytes(self, user: str, key: str, step: int) -> bytes:
        """The committed manifest's exact bytes (NotFound when there is none)."""
        ...

    def reader(self, user: str, key: str, step: int) -> TierReader: ...

    def writer(
        self, user: str, key: str, step: int, *, copy_of: Optional[Manifest] = None, **meta: Any
    ) -> TierWriter: ...

    def verify(
        self, user: str, key: str, step: int, progress: Optional[ProgressFn] = None
    ) -> VerifyReport:
        """Re-read and re-hash every byte against the manifest (``progress(nbytes)`` hears
        of each chunk)."""
        ...

    def uncommit(self, user: str, key: str, step: int, expect: bytes) -> bool:
        """Take a committed checkpoint found damaged out of the listing, its manifest kept
        aside as ``manifest.json.damaged`` - only while the manifest is still ``expect``
        (never a copy committed again since). True when done here and now."""
        ...

    def uncommitted(self, user: str, key: str, step: int) -> bool:
        """Was this step found damaged and uncommitted here (and not written again)?"""
        ...

    def lock(self, user: str, key: str, step: int, wait: bool = True) -> ContextManager[bool]:
        """Exclusive lock on one step, held by copies and deletes; yields False when
        ``wait`` is False and someone else holds it."""
        ...

    def delete(self, user: str, key: str, step: int) -> None:
        """Remove one checkpoint: the manifest first (it stops counting), then the data."""
        ...

    def sweep(
        self, user: str, key: str, max_age_s: float = 3600.0, partials: bool = False
    ) -> List[str]:
        """Remove debris of crashed writers; returns what was removed."""
        ...

    def read_lease(self, user: str, key: str) -> Optional[bytes]:
        """The series' lease record (:mod:`slurm_ckpt.job.lease`), or None."""
        ...

    def write_lease(self, user: str, key: str, data: bytes) -> None:
        """Replace the series' lease record whole (never listed as a step)."""
        ...

    # -- root's questions (see the module docstring) ------------------------------------
    def guard_user(self, user: str, uid: int) -> None:
        """Before writing ``user``'s (uid ``uid``) checkpoints here: raise a one-line
        TierError (:class:`~slurm_ckpt.tiers.unsafe.UnsafeUserDir` and kin) unless it is
        safe for this process to write them."""
        ...

    def guard_step(self, user: str, key: str, step: int, uid: int) -> None:
        """Before root's child reads this checkpoint: raise
        (:class:`~slurm_ckpt.tiers.unsafe.UnsafeCheckpoint`) if any of it is something
        root-run code must not touch."""
        ...

    def committed_manifest(self, user: str, key: str, step: int) -> Optional[bytes]:
        """The committed manifest's exact bytes, or None when there is none (or it cannot
        be read), read the way root may read the user's data."""
        ...

    def directory(self) -> Optional[KeyDirs]:
        """This tier's directories when it is kept as a tree (POSIX), else None."""
        ...
