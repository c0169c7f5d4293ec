"""One payload file on its way into the object store: its parts, their buffers and
CRC32s, the multipart upload (:class:`ObjectUpload`), and the stream a fresh-mode
producer writes it through (:class:`UploadStream`).

Why a module of its own: :class:`~slurm_ckpt.tiers.s3_write.S3Writer` is the checkpoint
(which files, the manifest last, resuming a killed copy); this is one object's upload,
which the writer starts, feeds buffers to and is told about when it ends.
"""

from __future__ import annotations

import base64
import io
import threading
from typing import Any, Dict, Optional, Protocol

from slurm_ckpt.core.faults import crashpoint
from slurm_ckpt.core.hashing import ChunkedHasher
from slurm_ckpt.core.manifest import FileEntry
from slurm_ckpt.errors import CkptError, TierError

__all__ = [
    "META_HASH",
    "META_SIZE",
    "ObjectUpload",
    "UploadHost",
    "UploadStream",
    "crc32_b64",
    "crc32_of",
]


class UploadHost(Protocol):
    """What an upload needs of the checkpoint it belongs to
    (:class:`~slurm_ckpt.tiers.s3_write.S3Writer`): where it goes, its part buffers, its
    requests, and the books of what it started and finished."""

    tier: Any
    user: str
    key: str
    step: int
    where: str
    chunk_size: int
    part_len: int

    def call(self, op: str, obj_key: str, **kw: Any) -> Any: ...
    def take_buffer(self) -> bytearray: ...
    def release_buffer(self, buf: bytearray) -> None: ...
    def track_object(self, obj_key: str) -> None: ...
    def track_upload(self, up: ObjectUpload) -> None: ...
    def untrack_upload(self, up: ObjectUpload) -> None: ...
    def file_done(self, up: ObjectUpload) -> None: ...


#: Object metadata naming the manifest entry an object was uploaded for (resumable copies).
META_HASH = "ckpt-hash"
META_SIZE = "ckpt-size"


try:  # zlib-ng's CRC32 uses the CPU's carry-less multiply: 3-4x the stdlib's speed
    from zlib_ng.zlib_ng import crc32 as _crc32
except ImportError:  # pragma: no cover - zlib-ng is a dependency; the stdlib is correct
    from zlib import crc32 as _crc32


def crc32_of(data: Any, value: int = 0) -> int:
    """CRC32 (zlib's) of a buffer, continuing from ``value``."""
    return _crc32(data, value)


def crc32_b64(data: Any = None, crc: Optional[int] = None) -> str:
    """The CRC32 of a buffer (or an already computed ``crc``) as S3's
    ``x-amz-checksum-crc32`` header wants it."""
    value = crc if crc is not None else crc32_of(data)
    return base64.b64encode(value.to_bytes(4, "big")).decode()


class ObjectUpload:
    """One payload file on its way into the store (a RangeSink in copy mode)."""

    def __init__(self, w: UploadHost, entry: Optional[FileEntry], relpath: str, size: int):
        self.w = w
        self.entry = entry
        self.relpath = relpath
        self.size = size
        self.key = w.tier.object_key(w.user, w.key, w.step, relpath)
        self.part_len = w.part_len
        self.nparts = max(1, -(-size // self.part_len))
        self.upload_id: Optional[str] = None
        self.etags: Dict[int, str] = {}
        self.crcs: Dict[int, str] = {}
        self._bufs: Dict[int, bytearray] = {}
        self._filled: Dict[int, int] = {}
        #: Running CRC32 of each part being filled, when its bytes arrive in order (a
        #: part of one hash chunk: one thread fills it front to back): computed on the
        #: way in, while the bytes are fresh, instead of a pass over the part at the end.
        self._crc: Dict[int, int] = {}
        self._in_order = w.chunk_size % self.part_len == 0
        self._lock = threading.Lock()
        self.meta: Dict[str, str] = {}
        if entry is not None:
            self.meta = {META_HASH: entry.hash, META_SIZE: str(entry.size)}

    # -- parts -----------------------------------------------------------------------
    def part_size(self, pn: int) -> int:
        """Bytes of part ``pn`` (the last one may be shorter); the writer slices by it."""
        return min(self.part_len, self.size - pn * self.part_len)

    def _start(self) -> str:
        with self._lock:
            if self.upload_id is None:
                r = self.w.call(
                    "create_multipart_upload",
                    self.key,
                    Key=self.key,
                    Metadata=self.meta,
                    ChecksumAlgorithm="CRC32",
                )
                self.upload_id = r["UploadId"]
                self.w.track_upload(self)
            return self.upload_id

    def put_part(self, pn: int, data: Any, crc_value: Optional[int] = None) -> None:
        """Upload part ``pn`` (0-based) from ``data``, its CRC32 (``crc_value``, else
        computed here) checked by the store."""
        crc = crc32_b64(data, crc_value)
        view = data if isinstance(data, (bytes, bytearray)) else _ViewBody(data)
        if self.nparts == 1:
            self.w.call(
                "put_object",
                self.key,
                Key=self.key,
                Body=view,
                ChecksumCRC32=crc,
                Metadata=self.meta,
            )
            self.w.track_object(self.key)
        else:
            uid = self._start()
            r = self.w.call(
                "upload_part",
                self.key,
                Key=self.key,
                UploadId=uid,
                PartNumber=pn + 1,
                Body=view,
                ChecksumCRC32=crc,
            )
            with self._lock:
                self.etags[pn] = r["ETag"]
                self.crcs[pn] = crc
        crashpoint("s3:part")

    def complete(self) -> None:
        """Complete the multipart upload: every part with its ETag and CRC32."""
        parts = [
            {"PartNumber": pn + 1, "ETag": self.etags[pn], "ChecksumCRC32": self.crcs[pn]}
            for pn in range(self.nparts)
        ]
        self.w.call(
            "complete_multipart_upload",
            self.key,
            Key=self.key,
            UploadId=self.upload_id,
            MultipartUpload={"Parts": parts},
        )
        self.w.track_object(self.key)
        self.w.untrack_upload(self)

    # -- RangeSink (copy mode) ---------------------------------------------------------
    def buffer_for(self, offset: int, n: int) -> memoryview:
        """The part buffer's memory for bytes ``offset .. offset + n``, or fewer: up to
        the end of that part. The copy engine reads the source straight into it, so the
        bytes are never copied in memory on their way to the socket. Hand the bytes over
        with :meth:`wrote`."""
        pn = offset // self.part_len
        start = offset - pn * self.part_len
        n = min(n, self.part_size(pn) - start)  # up to the end of this part
        with self._lock:
            buf = self._bufs.get(pn)
            if buf is None:
                buf = self._bufs[pn] = self.w.take_buffer()
                self._filled[pn] = 0
                self._crc[pn] = 0
        return memoryview(buf)[start : start + n]

    def wrote(self, view: memoryview, offset: int) -> None:
        """Bytes ``offset .. offset + len(view)`` are in the buffer :meth:`buffer_for`
        gave; a part that is complete goes up now."""
        pn = offset // self.part_len
        psize = self.part_size(pn)
        crc = crc32_of(view, self._crc.get(pn, 0)) if self._in_order else None
        with self._lock:
            self._filled[pn] += len(view)
            if crc is not None:
                self._crc[pn] = crc
            full = self._filled[pn] >= psize
            buf = self._bufs[pn]
        if full:
            try:
                body = buf if psize == len(buf) else memoryview(buf)[:psize]
                self.put_part(pn, body, self._crc.get(pn) if self._in_order else None)
            finally:
                with self._lock:
                    self._bufs.pop(pn, None)
                    self._crc.pop(pn, None)
                self.w.release_buffer(buf)

    def write(self, data: memoryview, offset: int) -> None:
        done = 0
        while done < len(data):  # part by part
            into = self.buffer_for(offset + done, len(data) - done)
            into[:] = data[done : done + len(into)]
            self.wrote(into, offset + done)
            done += len(into)

    def finish(self) -> None:
        """Every byte is in: complete the upload and check the object's size."""
        if self.size == 0:
            self.put_part(0, memoryview(b""))
        if self.nparts > 1:
            missing = [pn for pn in range(self.nparts) if pn not in self.etags]
            if missing:
                raise CkptError(f"{self.w.where}/{self.relpath}: part {missing[0] + 1} never sent")
            self.complete()
        head = self.w.call("head_object", self.key, Key=self.key)
        if int(head["ContentLength"]) != self.size:
            raise TierError(
                f"{self.w.where}/{self.relpath}: stored {head['ContentLength']} bytes, "
                f"sent {self.size}"
            )
        self.w.file_done(self)

    def abort(self) -> None:
        for buf in list(self._bufs.values()):
            self.w.release_buffer(buf)
        self._bufs.clear()


class _ViewBody(io.RawIOBase):
    """A request body over a memoryview without copying it whole first (boto3 takes
    bytes, bytearray or a file; a part of the caller's buffer is none of them)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self.view = memoryview(view).cast("B")
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = min(len(b), len(self.view) - self.pos)
        b[:n] = self.view[self.pos : self.pos + n]
        self.pos += n
        return n

    def read(self, n: int = -1) -> bytes:
        end = len(self.view) if n is None or n < 0 else min(len(self.view), self.pos + n)
        out = bytes(self.view[self.pos : end])
        self.pos = end
        return out

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self.pos, len(self.view))[whence]
        self.pos = max(0, min(len(self.view), base + offset))
        return self.pos

    def tell(self) -> int:
        return self.pos

    def __len__(self) -> int:
        return len(self.view)


class UploadStream:
    """A binary stream for fresh-mode producers: parts go up as they fill."""

    def __init__(self, up: ObjectUpload, chunk_size: int) -> None:
        self.up = up
        self.hasher = ChunkedHasher(chunk_size)
        self.buf = bytearray()
        self.pn = 0

    def write(self, data: object) -> int:
        mv = memoryview(data).cast("B")  # type: ignore[arg-type]
        self.hasher.update(mv)
        self.buf += mv
        while len(self.buf) >= self.up.part_len * 2:  # keep one part back: the last may grow
            self._send(self.up.part_len)
        return len(mv)

    def _send(self, n: int) -> None:
        self.up.nparts = max(self.up.nparts, self.pn + 2)
        self.up.put_part(self.pn, memoryview(self.buf)[:n])
        del self.buf[:n]
        self.pn += 1

    def close(self) -> None:
        up = self.up
        up.size = self.hasher.size
        if self.pn == 0:
            up.nparts = 1
            up.put_part(0, memoryview(self.buf))
        else:
            while len(self.buf) > up.part_len:
                self._send(up.part_len)
            up.nparts = self.pn + 1
            up.put_part(self.pn, memoryview(self.buf))
        self.buf = bytearray()
        if up.nparts > 1:
            up.complete()

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        pass
