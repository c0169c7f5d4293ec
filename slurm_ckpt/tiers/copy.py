"""The copy engine: move a committed checkpoint from any tier to any tier, verified.

This is the one module that copies checkpoints between tiers; every flusher (the flush
engine in :mod:`slurm_ckpt.node.flush_engine`), the prolog's staging and the cold-tier aging call
:func:`copy_checkpoint`. It commits only through the destination tier's writer
(:meth:`Tier.writer(copy_of=...) <slurm_ckpt.tiers.base.Tier.writer>`), so each tier's
commit protocol - manifest last, atomically - is written once, in the tier.

One pass through memory per byte: each stream reads a range of the source into its own
reusable buffer, hashes it, and writes it to the same offset of the destination. Every
range's digest is compared with the source manifest, so the bytes written are proven
equal to the bytes that were committed; only then is the destination committed, with the
source's manifest byte for byte.

A copy killed midway leaves the destination writer's work area, which the next copy of
the same step on that node resumes (:meth:`TierWriter.resumable`: complete, matching
files are kept). Copies of one step from one source are serialised by the *source*
tier's lock (node-local, so flock is reliable even when the destination is a parallel
filesystem); copies from two sources (a checkpoint's owner node and the node holding its
partner copy) may run at once, and need not be kept apart: each writer works in its own
area on the destination and only its commit is atomic there. The writer that commits
second finds the step committed: with the same manifest bytes that is this copy done
(``already_present``), with other bytes a :class:`~slurm_ckpt.errors.StepConflict` -
nothing committed is ever removed by a copy that lost. Files are opened in
bounded batches, so a checkpoint of 100,000 files needs no more descriptors than one of
64.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, List, Optional

from slurm_ckpt.core import fsio
from slurm_ckpt.core.chunks import BandwidthLimiter, ShortRead, hash_pieces, run_chunks
from slurm_ckpt.core.commit import AlreadyCommitted
from slurm_ckpt.core.faults import crashpoint
from slurm_ckpt.core.lease import generation_of
from slurm_ckpt.core.manifest import FileEntry
from slurm_ckpt.core.progress import ProgressFn, report
from slurm_ckpt.errors import NotFound, StepConflict, VerifyError
from slurm_ckpt.tiers.base import RangeSink, RangeSource, Tier, TierReader, TierWriter

__all__ = ["FILES_PER_BATCH", "CopyResult", "SourceCorrupt", "copy_checkpoint"]

#: Payload files open at once (source and destination each) during a copy.
FILES_PER_BATCH = 64


@dataclass(frozen=True)
class CopyResult:
    """What one copy did: bytes moved, time, and whether it resumed or found it done.

    The one type from a copy to its caller: :func:`copy_checkpoint` returns it, the flush
    engine's copy functions return it (:data:`slurm_ckpt.node.flush_engine.CopyFn`), and
    root's child that copies as the owner sends it back as JSON (:meth:`to_json`), which
    root reads back with :meth:`from_json` - checked field by field, as data from a
    process the user may have influenced."""

    step: int
    nbytes: int
    copied_bytes: int
    seconds: float
    already_present: bool = False
    resumed_files: int = 0

    @property
    def rate(self) -> float:
        return self.copied_bytes / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> Dict[str, Any]:
        """The fields as plain JSON values (what a child sends its parent)."""
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Any) -> CopyResult:
        """The result a child sent, validated: exactly these fields, non-negative
        integers, a finite non-negative time, booleans. ``ValueError`` on anything
        else (the caller turns it into its own one-line error)."""
        if not isinstance(obj, dict) or set(obj) != _FIELDS:
            raise ValueError("not a copy result")
        ints = {k: obj[k] for k in ("step", "nbytes", "copied_bytes", "resumed_files")}
        for k, v in ints.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"copy result: bad {k}")
        secs = obj["seconds"]
        if isinstance(secs, bool) or not isinstance(secs, (int, float)):
            raise ValueError("copy result: bad seconds")
        if not math.isfinite(secs) or secs < 0:
            raise ValueError("copy result: bad seconds")
        if not isinstance(obj["already_present"], bool):
            raise ValueError("copy result: bad already_present")
        return cls(seconds=float(secs), already_present=obj["already_present"], **ints)


_FIELDS = frozenset(f.name for f in fields(CopyResult))


class SourceCorrupt(VerifyError):
    """The source's bytes do not match its own manifest; it must not be propagated."""

    bad_source = True
    hold_code = "source_bad"


def copy_checkpoint(
    src: Tier,
    dst: Tier,
    user: str,
    key: str,
    step: int,
    *,
    streams: Optional[int] = None,
    reread: bool = False,
    replace_older: bool = False,
    progress: Optional[ProgressFn] = None,
) -> CopyResult:
    """Copy ``user/key/step`` from ``src`` to ``dst``; verified, resumable, idempotent.

    When ``dst`` already holds this very checkpoint (identical manifest bytes) nothing is
    copied. When it holds a *different* checkpoint of the same step: with
    ``replace_older`` and an older one (``wall_time``), that copy is of an abandoned
    timeline (training went back to an older step and came here again) and is replaced;
    otherwise :class:`~slurm_ckpt.errors.StepConflict`. Another copy of this step
    committing first while this one runs counts as this one done when its manifest is
    the same (``already_present``), else as a StepConflict. ``reread`` reads the copy
    back from the device before the commit (twice the I/O; for sites that distrust their
    storage path). The bandwidth cap of
    ``dst`` applies. ``progress(nbytes)`` hears of every copied (or already present)
    byte, for progress bars.
    """
    streams = streams or dst.streams
    t0 = time.monotonic()
    with src.lock(user, key, step), src.reader(user, key, step) as reader:
        manifest = reader.manifest
        if _present(dst, reader, replace_older):
            report(progress, manifest.total_bytes)
            return CopyResult(
                step, manifest.total_bytes, 0, time.monotonic() - t0, already_present=True
            )
        where = dst.where(user, key, step)
        try:
            with dst.writer(user, key, step, copy_of=manifest) as writer:
                keep = writer.resumable()
                todo = [e for e in manifest.files if e.path not in keep]
                report(progress, sum(e.size for e in manifest.files if e.path in keep))
                for i in range(0, len(todo), FILES_PER_BATCH):
                    _copy_files(
                        reader,
                        writer,
                        todo[i : i + FILES_PER_BATCH],
                        manifest.chunk_size,
                        streams,
                        dst.limiter,
                        dst.buffer_size,
                        progress,
                    )
                if reread:
                    rep = writer.verify_written()
                    if not rep.ok:
                        raise VerifyError(f"{where}: re-read after copy failed: {rep.problems[0]}")
                writer.commit()
        except AlreadyCommitted:
            # Another writer of this step (another node) committed first: its manifest
            # decides - never replaced here, whatever its age.
            if not _present(dst, reader, False):
                raise
            report(progress, manifest.total_bytes)
            return CopyResult(
                step, manifest.total_bytes, 0, time.monotonic() - t0, already_present=True
            )
        except OSError as exc:
            # ENOSPC and friends: the writer gave the space back; nothing half-made is kept.
            raise fsio.tier_error(exc, f"copy to {where}") from None
    return CopyResult(
        step,
        manifest.total_bytes,
        sum(e.size for e in todo),
        time.monotonic() - t0,
        resumed_files=len(keep),
    )


def _present(dst: Tier, reader: TierReader, replace_older: bool) -> bool:
    """True when ``dst`` already holds this exact checkpoint, committed; False when it
    holds none (or an older one it replaced); :class:`StepConflict` when it holds
    another."""
    m = reader.manifest
    try:
        existing = dst.manifest_bytes(m.user, m.key, m.step)
    except NotFound:
        return False
    if existing == reader.manifest_bytes:
        return True
    where = dst.where(m.user, m.key, m.step)
    if replace_older:
        try:
            theirs = dst.manifest(m.user, m.key, m.step)
            theirs_time: Optional[float] = theirs.wall_time
            theirs_gen = generation_of(theirs.meta)
        except VerifyError:
            theirs_time = None  # a corrupt manifest: debris of nothing we can trust
            theirs_gen = 0
        if theirs_gen > generation_of(m.meta):
            # A newer writer of the series committed this step: a stale writer's copy
            # (taken over, core/lease.py) never replaces it, whatever the clocks say.
            raise StepConflict(
                f"{where}: committed by a newer writer (generation {theirs_gen} > "
                f"{generation_of(m.meta)}): not replaced"
            )
        if theirs_time is None or theirs_time < m.wall_time or theirs_gen < generation_of(m.meta):
            dst.delete(m.user, m.key, m.step)
            return False
    raise StepConflict(
        f"{where}: a different checkpoint with this step is already committed (conflict; "
        "neither is removed)"
    )


def _copy_files(
    reader: TierReader,
    writer: TierWriter,
    entries: List[FileEntry],
    chunk_size: int,
    streams: int,
    limiter: Optional[BandwidthLimiter],
    piece: int,
    progress: Optional[ProgressFn] = None,
) -> None:
    sources: List[Optional[RangeSource]] = [None] * len(entries)
    sinks: List[Optional[RangeSink]] = [None] * len(entries)
    try:
        for i, e in enumerate(entries):
            try:
                sources[i] = reader.open(e.path)
            except VerifyError as exc:
                raise SourceCorrupt(str(exc)) from None
            sinks[i] = writer.file(e.path, e.size)
        crashpoint("copy:files-created")

        def op(fi: int, ci: int, off: int, n: int) -> str:
            src, sink = sources[fi], sinks[fi]
            # A sink with memory of its own (an object-store part) is read into directly:
            # no copy between two buffers on the way to the socket.
            into = getattr(sink, "buffer_for", None)
            write = sink.write if into is None else sink.wrote  # type: ignore[union-attr]
            try:
                got = hash_pieces(src.readinto, off, n, write, limiter, piece, into=into)  # type: ignore[union-attr]
            except ShortRead as exc:  # truncated: say it as verify does ("size A != B")
                raise SourceCorrupt(
                    f"source {entries[fi].path}: size {_size_now(src, exc.at)} != "
                    f"{entries[fi].size}"
                ) from None
            if got != entries[fi].chunks[ci]:
                raise SourceCorrupt(
                    f"source {entries[fi].path}: bytes {off}-{off + n} do not match the manifest"
                )
            crashpoint("copy:chunk")
            report(progress, n)
            return got

        def done(fi: int) -> None:
            sinks[fi].finish()  # type: ignore[union-attr]
            crashpoint("copy:file-synced")

        run_chunks([e.size for e in entries], chunk_size, op, done, streams)
    finally:
        for s in sources:
            if s is not None:
                s.close()


def _size_now(src: Optional[RangeSource], at: int) -> int:
    """The source file's size now (a POSIX file: its fstat), else where the read ended."""
    fd = src.fileno() if src is not None else None
    if fd is not None:
        try:
            return os.fstat(fd).st_size
        except OSError:
            pass
    return at
