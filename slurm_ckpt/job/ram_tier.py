"""The RAM tier: the newest snapshots of a rank's state kept in host memory, with the
same manifest and per-chunk hashes as a checkpoint on any durable tier, read back by
the restore like any tier.

Why memory: a process that survives a node loss (or the partner that holds a copy for
a lost rank) can hand back the state of the last step in seconds, without a disk in
the way; GEMINI and the multi-tier checkpointing of Orbax do the same. Why hashed: a
RAM copy is only worth restoring if it is the bytes that were snapshotted; so it carries
the manifest format of :mod:`slurm_ckpt.core.manifest` (xxh3-128 per chunk), built when
the snapshot is taken, and every read of it is checked against that manifest exactly
as a read from the PFS is (:mod:`slurm_ckpt.job.state_reader`).

A :class:`RamStore` holds snapshots per series in **slots**: at most ``keep + 1`` per
series, each a set of buffers allocated once and reused while the state keeps its
layout (one slot is being filled or sent while ``keep`` complete ones stay listed). The
same class keeps a rank's own snapshots and the copies it holds for its partner, so
both sides have the same memory bound. A snapshot *exists* once its manifest is
committed into its slot; a slot being refilled is unlisted first, so a listing never
shows a slot whose bytes are changing. Readers pin a slot; a pinned slot is never
reused.

:class:`RamTier` is a read-only Tier over a store (``steps``, ``manifest``, ``reader``,
``verify``, ``delete``), named ``ram``: the restore puts it first.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from slurm_ckpt.core.hashing import chunk_digest, combine, hash_buffer
from slurm_ckpt.core.manifest import FileEntry, Manifest
from slurm_ckpt.core.verify import VerifyReport
from slurm_ckpt.errors import NotFound, TierError, VerifyError
from slurm_ckpt.job.staging import StagingArea
from slurm_ckpt.tiers.base import StepInfo

__all__ = ["RAM", "RamReader", "RamSource", "RamStore", "RamTier", "Slot", "manifest_of"]

#: The own RAM tier's name (``Restored.tier``).
RAM = "ram"


@dataclass(eq=False)
class Slot:
    """One reusable set of buffers of a series: a snapshot being filled, or committed."""

    key: str
    #: Payload file (manifest path) -> its bytes (views of this slot's memory).
    files: Dict[str, memoryview] = field(default_factory=dict)
    manifest: Optional[Manifest] = None
    manifest_bytes: Optional[bytes] = None
    #: Commit order within the store (newest highest); 0 while not committed.
    seq: int = 0
    pins: int = 0
    #: The step being filled (a received copy: known from its manifest at once).
    step: Optional[int] = None
    #: Own snapshots: the staging area that owns the blob buffers.
    area: Optional[StagingArea] = None
    #: Own snapshots: the blob sizes the staging area holds (a new layout reallocates).
    blob_sizes: List[int] = field(default_factory=list)
    _mem: List[Any] = field(default_factory=list)
    _sizes: Dict[str, int] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(len(v) for v in self.files.values())

    def alloc(self, sizes: Dict[str, int]) -> bool:
        """Buffers of exactly ``sizes`` (path -> bytes), reused when the layout is the
        same; returns whether memory was allocated (counted by the store)."""
        if sizes == self._sizes and self.files:
            return False
        self.free()
        for path, n in sizes.items():
            buf = mmap.mmap(-1, max(n, 1))
            self._mem.append(buf)
            self.files[path] = memoryview(buf)[:n]
        self._sizes = dict(sizes)
        return True

    def free(self) -> None:
        for v in self.files.values():
            with contextlib.suppress(BufferError):  # still exported: freed by the GC
                v.release()
        self.files = {}
        for buf in self._mem:
            with contextlib.suppress(BufferError):
                buf.close()
        self._mem, self._sizes = [], {}
        if self.area is not None:
            self.area.close()
            self.area = None


def manifest_of(
    files: Dict[str, memoryview],
    *,
    user: str,
    key: str,
    step: int,
    tokens: Optional[int],
    job: Optional[str],
    node: Optional[str],
    meta: Dict[str, Any],
    chunk_size: int,
) -> Manifest:
    """The manifest of a snapshot held in memory: every file hashed per chunk, as the
    tier writers do (so the partner verifies it, and the restore reads it, the same way)."""
    entries = []
    for path in sorted(files):
        digest, chunks = hash_buffer(files[path], chunk_size)
        entries.append(FileEntry(path, len(files[path]), digest, chunks))
    return Manifest(
        user=user,
        key=key,
        step=step,
        files=entries,
        tokens=tokens,
        job=job,
        node=node,
        meta=meta,
        chunk_size=chunk_size,
    )


class RamStore:
    """Snapshots of some series in memory, ``keep`` listed per series (module docstring).

    ``max_series``: how many series it holds at most (a holder takes copies of its ring
    predecessor only; more are refused rather than grow without bound)."""

    def __init__(self, keep: int = 1, max_series: int = 4) -> None:
        self.keep = max(1, int(keep))
        self.max_series = max_series
        self.cv = threading.Condition()
        self._slots: Dict[str, List[Slot]] = {}
        self._seq = 0
        self.closed = False
        #: Buffer sets allocated so far (reuse keeps this flat while the layout holds).
        self.allocations = 0

    # -- filling -----------------------------------------------------------------------
    def begin(self, key: str, step: Optional[int] = None) -> Optional[Slot]:
        """A slot of ``key`` to fill, pinned, unlisted: a fresh one while fewer than
        ``keep + 1`` exist, else the one not pinned that is not committed, else the
        oldest committed one not pinned. None: all pinned (or too many series)."""
        with self.cv:
            if self.closed:
                return None
            slots = self._slots.get(key)
            if slots is None:
                if len(self._slots) >= self.max_series:
                    return None
                slots = self._slots[key] = []
            if len(slots) < self.keep + 1:
                slot = Slot(key)
                slots.append(slot)
            else:
                free = [s for s in slots if s.pins == 0]
                if not free:
                    return None
                slot = min(free, key=lambda s: s.seq)  # uncommitted (0) first, then oldest
            slot.seq, slot.manifest, slot.manifest_bytes = 0, None, None
            slot.pins, slot.step = 1, step
            return slot

    def allocate(self, slot: Slot, sizes: Dict[str, int]) -> None:
        """Received copies: buffers of ``sizes`` in ``slot`` (reused when equal)."""
        if slot.alloc(sizes):
            with self.cv:
                self.allocations += 1

    def counted(self) -> None:
        """An own snapshot's staging area allocated afresh (counted like :meth:`allocate`)."""
        with self.cv:
            self.allocations += 1

    def commit(self, slot: Slot, m: Manifest, mbytes: bytes) -> None:
        """The snapshot in ``slot`` exists from now on (and stays pinned by the caller)."""
        with self.cv:
            self._seq += 1
            slot.manifest, slot.manifest_bytes, slot.seq, slot.step = m, mbytes, self._seq, m.step
            self.cv.notify_all()

    def abandon(self, slot: Slot) -> None:
        """``slot``'s filling failed or was superseded: it holds nothing (unpinned)."""
        with self.cv:
            slot.seq, slot.manifest, slot.manifest_bytes = 0, None, None
            slot.pins = max(0, slot.pins - 1)
            self.cv.notify_all()

    # -- reading -----------------------------------------------------------------------
    def listed(self, key: str) -> List[Slot]:
        """The newest ``keep`` committed slots of ``key``, oldest first."""
        with self.cv:
            done = sorted((s for s in self._slots.get(key, []) if s.seq), key=lambda s: s.seq)
            return done[-self.keep :]

    def keys(self) -> List[str]:
        with self.cv:
            return sorted(k for k in self._slots if any(s.seq for s in self._slots[k]))

    def pin(self, key: str, step: int) -> Slot:
        """The listed snapshot of ``key`` at ``step``, pinned (release with :meth:`unpin`)."""
        with self.cv:
            for s in self.listed(key):
                if s.step == step:
                    s.pins += 1
                    return s
        raise NotFound(f"ram:{key}/step-{step}: not held")

    def unpin(self, slot: Slot) -> None:
        with self.cv:
            slot.pins = max(0, slot.pins - 1)
            self.cv.notify_all()

    def drop(self, key: str, step: int) -> None:
        """Unlist ``key``/``step`` (a copy found bad): its slot is reused first."""
        with self.cv:
            for s in self._slots.get(key, []):
                if s.seq and s.step == step:
                    s.seq, s.manifest, s.manifest_bytes = 0, None, None

    def held(self) -> Tuple[int, int]:
        """(snapshots listed, bytes of memory allocated) over every series."""
        with self.cv:
            n = sum(len(self.listed(k)) for k in self._slots)
            nbytes = sum(s.nbytes for slots in self._slots.values() for s in slots)
            return n, nbytes

    def slots(self, key: str) -> int:
        """Slots (buffer sets) of ``key``: never more than ``keep + 1``."""
        with self.cv:
            return len(self._slots.get(key, []))

    def damage_for_test(self, key: str, step: int, offset: int = 0) -> None:
        """Fault tests: flip one byte of the held snapshot's largest payload file (the
        manifest is kept: a reader must find the mismatch)."""
        slot = self.pin(key, step)
        try:
            view = max(slot.files.values(), key=len)
            view[offset] ^= 0xFF
        finally:
            self.unpin(slot)

    def close(self) -> None:
        """Free every buffer; nothing is taken in from now on."""
        with self.cv:
            self.closed = True
            slots = [s for ss in self._slots.values() for s in ss]
            self._slots = {}
        for s in slots:
            s.free()


class RamSource:
    """One payload file of a RAM snapshot (a RangeSource without a descriptor)."""

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.size = len(view)

    def readinto(self, buf: memoryview, offset: int) -> int:
        n = max(0, min(len(buf), self.size - offset))
        buf[:n] = self.view[offset : offset + n]
        return n

    def fileno(self) -> Optional[int]:
        return None

    def close(self) -> None:
        pass


class RamReader:
    """One RAM snapshot open for reading (a TierReader); its slot stays pinned until
    :meth:`close`, so its bytes cannot be refilled under the read."""

    def __init__(self, store: RamStore, slot: Slot, where: str) -> None:
        assert slot.manifest is not None and slot.manifest_bytes is not None
        self.store, self.slot, self.where = store, slot, where
        self.manifest: Manifest = slot.manifest
        self.manifest_bytes: bytes = slot.manifest_bytes
        self._open = True

    def open(self, relpath: str) -> RamSource:
        view = self.slot.files.get(relpath)
        if view is None:
            raise VerifyError(f"{self.where}/{relpath}: not in the snapshot")
        return RamSource(view)

    def close(self) -> None:
        if self._open:
            self._open = False
            self.store.unpin(self.slot)

    def __enter__(self) -> RamReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RamTier:
    """A :class:`RamStore` read as a tier (read only; see the module docstring)."""

    def __init__(self, store: RamStore, user: str, name: str = RAM) -> None:
        self.store, self.user, self.name = store, user, name
        self.limiter = None

    def where(self, user: str, key: str, step: Optional[int] = None) -> str:
        return f"{self.name}:{key}" + ("" if step is None else f"/step-{step}")

    location = where

    def steps(self, user: str, key: str) -> List[StepInfo]:
        if user != self.user:
            return []
        return [
            StepInfo(self.name, user, key, s.step, s.manifest)
            for s in self.store.listed(key)
            if s.manifest is not None and s.step is not None
        ]

    def keys(self, user: str) -> List[str]:
        return self.store.keys() if user == self.user else []

    def manifest(self, user: str, key: str, step: int) -> Manifest:
        with self.reader(user, key, step) as r:
            return r.manifest

    def manifest_bytes(self, user: str, key: str, step: int) -> bytes:
        with self.reader(user, key, step) as r:
            return r.manifest_bytes

    def reader(self, user: str, key: str, step: int) -> RamReader:
        if user != self.user:
            raise NotFound(f"{self.where(user, key, step)}: not held")
        return RamReader(self.store, self.store.pin(key, step), self.where(user, key, step))

    def verify(self, user: str, key: str, step: int) -> VerifyReport:
        """Every chunk of every file hashed against the manifest."""
        t0 = time.monotonic()
        problems: List[str] = []
        nbytes = 0
        with self.reader(user, key, step) as r:
            m = r.manifest
            for e in m.files:
                view = r.slot.files.get(e.path)
                if view is None or len(view) != e.size:
                    problems.append(f"{e.path}: missing or wrong size")
                    continue
                chunks = [
                    chunk_digest(view[i : i + m.chunk_size]) for i in range(0, e.size, m.chunk_size)
                ]
                if chunks != e.chunks or combine(chunks) != e.hash:
                    problems.append(f"{e.path}: bytes do not match the manifest")
                nbytes += e.size
        where = self.where(user, key, step)
        return VerifyReport(where, step, not problems, nbytes, time.monotonic() - t0, problems)

    def delete(self, user: str, key: str, step: int) -> None:
        if user != self.user:
            raise TierError(f"{self.where(user, key, step)}: not this user's")
        self.store.drop(key, step)
