"""Writing one checkpoint into the object store: multipart uploads, manifest last.

Commit protocol on S3 (the same promise as :mod:`slurm_ckpt.core.commit`):

1. every payload file becomes the object ``<step prefix>/<relpath>``: a single PUT when
   it fits one part, else a multipart upload whose parts go up in parallel; each part
   carries its CRC32, which the store checks (a mismatch is refused with BadDigest), so
   the store holds exactly the bytes that were hashed against the manifest;
2. each completed object's size is checked (HEAD);
3. ``manifest.json`` is PUT last, with ``If-None-Match: *`` so that a committed step is
   never overwritten. A listing shows a step only once that object exists.

A part is a whole number of hash chunks (the chunk size of the manifest), or, in a copy
of large chunks, a whole fraction of one (:meth:`S3Tier.part_len`); within a chunk the
bytes arrive in order from one thread (the Tier protocol's promise), so one buffer per
part in flight is all the memory a copy needs, and a part inside one chunk is filled
front to back (its CRC32 is computed on the way in).

A copy killed midway leaves completed objects (each tagged with its manifest hash and
size) and interrupted multipart uploads. The next copy of the same step keeps the
objects whose tags match (:meth:`S3Writer.resumable`) and aborts the uploads;
:meth:`S3Tier.sweep` removes what nobody resumes.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from typing import Any, Dict, Iterator, List, Mapping, Optional, Set

import botocore.exceptions as bexc

from slurm_ckpt.core.commit import AlreadyCommitted, manifest_to_commit
from slurm_ckpt.core.faults import crashpoint
from slurm_ckpt.core.hashing import chunk_count, chunk_digest, combine
from slurm_ckpt.core.manifest import DAMAGED_MANIFEST_NAME, MANIFEST_NAME, FileEntry, Manifest
from slurm_ckpt.core.manifest_limits import check_bytes
from slurm_ckpt.core.names import validate_key, validate_relpath, validate_user
from slurm_ckpt.core.verify import VerifyReport, verify_sources
from slurm_ckpt.errors import CkptError, NotFound
from slurm_ckpt.tiers.s3_client import ObjectStore, s3_error
from slurm_ckpt.tiers.s3_upload import (
    META_HASH,
    META_SIZE,
    ObjectUpload,
    UploadStream,
    crc32_b64,
)

__all__ = ["META_HASH", "META_SIZE", "S3Writer", "crc32_b64"]


class S3Writer:
    """A checkpoint being written into the object store (see the module docstring): a
    context manager that commits on a clean exit and removes its objects on an error."""

    def __init__(
        self,
        tier: ObjectStore,
        user: str,
        key: str,
        step: int,
        *,
        copy_of: Optional[Manifest] = None,
        tokens: Optional[int] = None,
        job: Optional[str] = None,
        node: Optional[str] = None,
        meta: Optional[Dict[str, Any]] = None,
        chunk_size: Optional[int] = None,
        streams: Optional[int] = None,
    ) -> None:
        self.tier = tier
        self.user, self.key, self.step = validate_user(user), validate_key(key), step
        self.where = tier.where(user, key, step)
        self.copy_of = copy_of
        self.tokens, self.job, self.node = tokens, job, node
        self.meta = dict(meta or {})
        self.chunk_size = (
            copy_of.chunk_size if copy_of is not None else (chunk_size or tier.chunk_size)
        )
        self.streams = streams or tier.streams
        self.part_len = tier.part_len(self.chunk_size, split=copy_of is not None)
        if copy_of is not None and (copy_of.user, copy_of.key, copy_of.step) != (user, key, step):
            raise CkptError(f"{self.where}: manifest names another checkpoint")
        self._lock = threading.Lock()
        self._entries: Dict[str, FileEntry] = {}
        self._objects: Set[str] = set()
        self._uploads: Dict[str, ObjectUpload] = {}
        self._free: List[bytearray] = []
        self._done = False
        try:
            tier.manifest_bytes(user, key, step)
        except NotFound:
            pass
        else:
            raise AlreadyCommitted(f"{self.where}: step already committed")

    # -- plumbing ----------------------------------------------------------------------
    def call(self, op: str, obj_key: str, **kw: Any) -> Any:
        """One S3 request on this writer's bucket; failures as one-line errors."""
        try:
            return getattr(self.tier.client(), op)(Bucket=self.tier.bucket, **kw)
        except bexc.ClientError as exc:
            where = f"{self.tier.name}:s3://{self.tier.bucket}/{obj_key}"
            raise s3_error(exc, where, self.tier.endpoint, writing=True) from None
        except (bexc.BotoCoreError, OSError) as exc:
            where = f"{self.tier.name}:s3://{self.tier.bucket}/{obj_key}"
            raise s3_error(exc, where, self.tier.endpoint, writing=True) from None

    def take_buffer(self) -> bytearray:
        """A part buffer from the pool the uploads share (memory bounded by streams)."""
        with self._lock:
            if self._free:
                return self._free.pop()
        return bytearray(self.part_len)

    def release_buffer(self, buf: bytearray) -> None:
        """Return a part buffer to the pool once its part is sent (or abandoned)."""
        with self._lock:
            if len(self._free) < self.streams + 1:
                self._free.append(buf)

    def track_object(self, obj_key: str) -> None:
        """An upload stored ``obj_key``: an abort deletes it, so nothing is left behind."""
        with self._lock:
            self._objects.add(obj_key)

    def track_upload(self, up: ObjectUpload) -> None:
        """A multipart upload began: an abort aborts it (the store would keep its parts)."""
        with self._lock:
            self._uploads[up.key] = up

    def untrack_upload(self, up: ObjectUpload) -> None:
        """A multipart upload completed: nothing of it is left to abort."""
        with self._lock:
            self._uploads.pop(up.key, None)

    def file_done(self, up: ObjectUpload) -> None:
        """A file is stored whole and checked: the manifest lists it from now on."""
        if up.entry is not None:
            with self._lock:
                self._entries[up.relpath] = up.entry

    def _new(self, relpath: str) -> None:
        validate_relpath(relpath)
        if relpath == MANIFEST_NAME:
            raise CkptError(f"{self.where}: {MANIFEST_NAME} is the manifest's name")
        with self._lock:
            if relpath in self._entries:
                raise CkptError(f"{self.where}: file {relpath!r} written twice")

    # -- fresh mode --------------------------------------------------------------------
    def write_buffers(self, items: Mapping[str, object]) -> List[FileEntry]:
        """Upload in-memory buffers, each part straight from the caller's memory, with
        the chunk digests computed on the way."""
        names = list(items)
        views = [memoryview(items[n]).cast("B") for n in names]  # type: ignore[arg-type]
        for n in names:
            self._new(n)
        ups = [ObjectUpload(self, None, n, len(v)) for n, v in zip(names, views)]
        digests: List[List[str]] = [[""] * chunk_count(len(v), self.chunk_size) for v in views]
        work = [(fi, pn) for fi, up in enumerate(ups) for pn in range(up.nparts)]

        def part(fi: int, pn: int) -> None:
            up, cs = ups[fi], self.chunk_size
            lo = pn * up.part_len
            view = views[fi][lo : lo + up.part_size(pn)] if up.size else views[fi][:0]
            for i in range(0, len(view), cs):
                digests[fi][(lo + i) // cs] = chunk_digest(view[i : i + cs])
            up.put_part(pn, view)

        self._run(part, work)
        entries = []
        for fi, up in enumerate(ups):
            if up.nparts > 1:
                up.complete()
            e = FileEntry(up.relpath, up.size, combine(digests[fi]), digests[fi])
            with self._lock:
                self._entries[up.relpath] = e
            entries.append(e)
        return entries

    def _run(self, fn: Any, work: List[Any]) -> None:
        if self.streams <= 1 or len(work) <= 1:
            for item in work:
                fn(*item)
            return
        with ThreadPoolExecutor(min(self.streams, len(work)), "ckpt-s3") as pool:
            futures = [pool.submit(fn, *item) for item in work]
            try:
                for f in futures:
                    f.result()
            except BaseException:
                for f in futures:
                    f.cancel()
                raise

    @contextmanager
    def open_stream(self, relpath: str) -> Iterator[Any]:
        """A writable binary stream; the file is hashed and uploaded as it comes."""
        self._new(relpath)
        up = ObjectUpload(self, None, relpath, 0)
        stream = UploadStream(up, self.chunk_size)
        yield stream
        stream.close()
        h, chunks = stream.hasher.finish()
        with self._lock:
            self._entries[relpath] = FileEntry(relpath, stream.hasher.size, h, chunks)

    # -- copy mode ---------------------------------------------------------------------
    def _manifest_for_copy(self) -> Manifest:
        if self.copy_of is None:
            raise CkptError(f"{self.where}: not a copy (give copy_of= to the writer)")
        return self.copy_of

    def resumable(self) -> Set[str]:
        """Objects of an interrupted copy that are complete and tagged with this
        manifest's hash and size (kept); other objects are deleted and interrupted
        multipart uploads aborted (their files are sent again). Nothing is kept of a
        copy that was found damaged and uncommitted (:meth:`S3Tier.uncommit`)."""
        m = self._manifest_for_copy()
        wanted = {e.path: e for e in m.files}
        prefix = self.tier.step_prefix(self.user, self.key, self.step)
        keep: Set[str] = set()
        stale: List[str] = []
        objs = list(self.tier.list_objects(prefix))
        if any(o["Key"][len(prefix) :] == DAMAGED_MANIFEST_NAME for o in objs):
            # A copy found damaged and uncommitted here: none of its objects is kept (their
            # tags say what they were meant to hold, not what they hold now).
            wanted = {}
        for obj in objs:
            rel = obj["Key"][len(prefix) :]
            e = wanted.get(rel)
            if e is not None and int(obj["Size"]) == e.size:
                head = self.call("head_object", obj["Key"], Key=obj["Key"])
                tags = head.get("Metadata", {})
                if tags.get(META_HASH) == e.hash and tags.get(META_SIZE) == str(e.size):
                    keep.add(rel)
                    self._entries[rel] = e
                    self._objects.add(obj["Key"])
                    continue
            stale.append(obj["Key"])
        self.tier.delete_keys(stale)
        self.tier.abort_uploads(prefix)
        return keep

    def file(self, relpath: str, size: int) -> ObjectUpload:
        """A sink for one payload file of the copied checkpoint."""
        entry = self._manifest_for_copy().file(relpath)
        if entry.size != size:
            raise CkptError(f"{self.where}: {relpath}: size {size} != manifest {entry.size}")
        self._new(relpath)
        return ObjectUpload(self, entry, relpath, size)

    def verify_written(self) -> VerifyReport:
        """Read every object back (ranged GETs) and hash it against the manifest."""
        m = self._manifest_for_copy()
        return verify_sources(
            lambda e: self.tier.source(self.user, self.key, self.step, e.path),
            m,
            self.where,
            self.streams,
        )

    # -- commit ------------------------------------------------------------------------
    def commit(self) -> Manifest:
        """PUT the manifest, last and only if no manifest is there (If-None-Match)."""
        if self._done:
            raise CkptError(f"{self.where}: writer already finished")
        manifest = manifest_to_commit(self, self._entries)
        data = manifest.to_bytes()
        try:
            check_bytes(data, self.where)  # root would count it as damage: say so now
        except CkptError:
            self.abort()
            raise
        mkey = self.tier.object_key(self.user, self.key, self.step, MANIFEST_NAME)
        crashpoint("s3:before-manifest")
        try:
            self.tier.client().put_object(
                Bucket=self.tier.bucket,
                Key=mkey,
                Body=data,
                ChecksumCRC32=crc32_b64(data),
                IfNoneMatch="*",
            )
        except bexc.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") == "PreconditionFailed":
                self._done = True  # the other writer's objects are not ours to remove
                raise AlreadyCommitted(f"{self.where}: step appeared concurrently") from None
            self.abort()
            raise s3_error(exc, self.where, self.tier.endpoint, writing=True) from None
        except (bexc.BotoCoreError, OSError) as exc:
            self.abort()
            raise s3_error(exc, self.where, self.tier.endpoint, writing=True) from None
        self._done = True
        self._free.clear()
        return manifest

    def abort(self) -> None:
        """Abort this writer's own uploads in flight; a fresh writer also deletes the
        objects it made. A copy deletes no object: another writer of this step (another
        node's copy of the same checkpoint) may share them by name and commit - or have
        committed - a manifest that names them; a complete object of this copy is what a
        resumed copy keeps anyway, and :meth:`S3Tier.sweep` removes what nobody commits."""
        if self._done:
            return
        self._done = True
        self._free.clear()
        for up in list(self._uploads.values()):
            up.abort()
            if up.upload_id is not None:
                with suppress(bexc.ClientError, bexc.BotoCoreError, OSError):  # swept later
                    self.tier.client().abort_multipart_upload(
                        Bucket=self.tier.bucket, Key=up.key, UploadId=up.upload_id
                    )
        if self.copy_of is not None:
            return
        # No manifest was written by us. Delete our objects unless the step is committed
        # (by another writer, whose manifest may name objects of the same names).
        try:
            self.tier.manifest_bytes(self.user, self.key, self.step)
            return
        except NotFound:
            pass
        except (CkptError, OSError):
            return  # cannot tell: leave them for the sweep
        with suppress(CkptError, OSError):
            self.tier.delete_keys(sorted(self._objects))

    def __enter__(self) -> S3Writer:
        return self

    def __exit__(self, et: object, ev: object, tb: object) -> None:
        if et is None and not self._done:
            self.commit()
        else:
            self.abort()
