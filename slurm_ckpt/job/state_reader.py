"""Read one rank's training state back from a checkpoint on any tier.

The reader works on a :class:`~slurm_ckpt.tiers.base.TierReader` (the Tier protocol),
so the same code restores from node-local NVMe, a parallel filesystem, an object store
or the cold archive. What each tier gives it is a :class:`~slurm_ckpt.tiers.base.RangeSource`
per blob, and the fastest read that source allows is taken
(:func:`slurm_ckpt.core.fastread.read_files`):

* a POSIX source has a file descriptor (``fileno()``): direct I/O into fresh huge-page
  memory, several requests in flight, cached chunks copied from the page cache;
* an object has none: each hash chunk is one ranged GET straight into the same kind of
  memory, ``streams`` of them in parallel.

Either way each chunk is hashed by the thread that read it as soon as it lands, so the
verification is the read, and the state's leaves are views of that memory.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from slurm_ckpt.core.fastread import READ_STREAMS, ReadJob, read_files
from slurm_ckpt.core.manifest import FileEntry, Manifest
from slurm_ckpt.errors import CkptError, TierError, VerifyError
from slurm_ckpt.job.state import (
    BLOB_RE,
    GROUPS,
    INDEX_NAME,
    MAX_INDEX_BYTES,
    parse_index,
    unflatten,
    view_leaf,
)
from slurm_ckpt.tiers.base import RangeSource, TierReader

__all__ = ["StateReader", "read_state"]


def _job(name: str, entry: FileEntry, src: RangeSource) -> ReadJob:
    fd = src.fileno()
    return ReadJob(name, entry, fd, None if fd is not None else src)


def _open(reader: TierReader, path: str, where: str) -> RangeSource:
    try:
        return reader.open(path)
    except VerifyError:
        raise
    except (CkptError, OSError) as exc:
        raise VerifyError(f"{where}: cannot open {path} ({exc})") from None


def _read_index(reader: TierReader, manifest: Manifest, prefix: str, where: str) -> bytes:
    name = f"{prefix}/{INDEX_NAME}" if prefix else INDEX_NAME
    try:
        entry = manifest.file(name)
    except KeyError:
        raise VerifyError(f"{where}: no {name} in the manifest") from None
    if entry.size > MAX_INDEX_BYTES:
        raise VerifyError(f"{where}: {name} too large ({entry.size} bytes)")
    src = _open(reader, name, where)
    try:
        (buf,) = read_files([_job(name, entry, src)], manifest.chunk_size, where=where)
        return bytes(memoryview(buf)[: entry.size])
    finally:
        src.close()


def _payload_blobs(manifest: Manifest, prefix: str) -> Dict[str, FileEntry]:
    pre = f"{prefix}/" if prefix else ""
    out = {}
    for f in manifest.files:
        if f.path.startswith(pre) and "/" not in f.path[len(pre) :]:
            name = f.path[len(pre) :]
            if BLOB_RE.match(name):
                out[name] = f
    return out


class StateReader:
    """One rank's state in a checkpoint open on some tier, read group by group.

    Opening checks everything that is cheap before any payload is read: the index is
    read, verified and parsed, and every blob it names is opened and its size compared
    with the manifest. So a truncated or missing blob is found before the weights are
    handed out, and the tier reader may be closed: this reader holds its own sources
    until :meth:`close`.

    :meth:`read` then loads the blobs of some groups (weights first, the rest later, or
    all at once), hashing each chunk as it arrives; :meth:`build` turns them into the
    state, every leaf a view of its blob's memory.
    """

    def __init__(
        self,
        reader: TierReader,
        manifest: Optional[Manifest] = None,
        prefix: str = "",
        *,
        streams: int = READ_STREAMS,
        where: Optional[str] = None,
    ) -> None:
        self.manifest = manifest or reader.manifest
        self.prefix = prefix
        self.where = where or reader.where
        self.streams = streams
        self.data = _read_index(reader, self.manifest, prefix, self.where)
        self.files = _payload_blobs(self.manifest, prefix)
        self.index = parse_index(self.data, {n: f.size for n, f in self.files.items()}, self.where)
        self.sources: Dict[str, RangeSource] = {}
        try:
            for name in sorted(self.files):
                path = f"{prefix}/{name}" if prefix else name
                src = self.sources[name] = _open(reader, path, self.where)
                size = _size(src)
                if size != self.files[name].size:
                    raise VerifyError(
                        f"{self.where}: {name}: size {size} != {self.files[name].size}"
                    )
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        sources, self.sources = self.sources, {}
        for src in sources.values():
            src.close()

    def __enter__(self) -> StateReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def blobs(self, groups: Optional[Sequence[str]] = None) -> List[str]:
        """The blob files holding ``groups`` (all blobs when None)."""
        wanted = set(GROUPS if groups is None else groups)
        named = {b["name"] for b in self.index["blobs"] if b["group"] in wanted}
        if groups is None:
            named |= set(self.files)  # stray blobs are verified too
        return sorted(named)

    def jobs(self, names: Sequence[str]) -> List[ReadJob]:
        """The read jobs of the blobs ``names`` (for a read shared by a replica group)."""
        if not self.sources and names:
            raise CkptError(f"{self.where}: reader already closed")
        return [_job(n, self.files[n], self.sources[n]) for n in names]

    def read(
        self,
        names: Sequence[str],
        cancelled: Callable[[], bool] = lambda: False,
    ) -> Dict[str, Any]:
        """Load and verify the blobs ``names``; returns name -> memory."""
        jobs = self.jobs(names)
        try:
            bufs = read_files(
                jobs,
                self.manifest.chunk_size,
                streams=self.streams,
                where=self.where,
                cancelled=cancelled,
            )
        except TierError as exc:  # an object store that failed mid-read
            raise VerifyError(f"{self.where}: read failed: {exc}") from None
        return dict(zip(names, bufs))

    def build(self, bufs: Mapping[str, Any], groups: Optional[Sequence[str]] = None) -> Any:
        """The state (or the top-level keys of ``groups``) from loaded blobs."""
        objs: List[Any] = [None] * len(self.index["tensors"])
        for i, e in enumerate(self.index["tensors"]):
            mm = bufs.get(e["blob"])
            if mm is not None:
                objs[i] = view_leaf(e, mm)
        return unflatten(self.index, objs, None if groups is None else list(groups))


def _size(src: RangeSource) -> int:
    """The real size of an open source (fstat for a file: the manifest's size is what
    PosixSource reports, and a truncated file must be caught here)."""
    fd = src.fileno()
    if fd is not None:
        return os.fstat(fd).st_size
    return int(src.size)


def read_state(
    reader: TierReader,
    manifest: Optional[Manifest] = None,
    prefix: str = "",
    *,
    groups: Optional[Sequence[str]] = None,
    streams: int = READ_STREAMS,
    verify_others: bool = True,
    where: Optional[str] = None,
) -> Tuple[Any, Dict[str, Any]]:
    """Read, verify and rebuild the state stored under ``prefix`` of a checkpoint.

    Every byte read is hashed on the way in and compared with the manifest (one pass:
    the verification is the read). With ``groups`` only those blobs are loaded; with
    ``verify_others`` the remaining blobs are still hashed (not kept), so a partial load
    never hands out data of a checkpoint that is not entirely sound. Any mismatch,
    malformed index or read error raises :class:`VerifyError`.
    """
    with StateReader(reader, manifest, prefix, streams=streams, where=where) as sr:
        names = sr.blobs(groups)
        bufs = sr.read(names)
        if verify_others and groups is not None:
            others = [n for n in sr.blobs(None) if n not in bufs]
            sr.read(others)  # verified, then dropped
        return sr.build(bufs, groups), sr.index
