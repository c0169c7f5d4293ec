"""The atomic, verified commit of one checkpoint on one tier.

Protocol (each arrow is durable before the next begins):

1. make ``<key>/.tmp-step-N-<pid>-<rand>/`` and write every payload file into it, hashing
   each chunk as it is written; fsync every file and directory;
2. rename the temporary directory to ``<key>/step-N/``; fsync ``<key>/``;
3. write ``manifest.json`` last: temp file, fsync, rename, fsync ``step-N/``.

A checkpoint exists only once step 3 has completed: readers list a step only when its
manifest parses and checks. A crash at any point leaves either nothing listable or the
complete checkpoint; leftovers (``.tmp-*`` or a ``step-N`` without manifest) are swept by
the next writer of that step or by :meth:`PosixTier.sweep`.
"""

from __future__ import annotations

import errno
import os
import secrets
import threading
import time
from contextlib import contextmanager, suppress
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

from slurm_ckpt.core import fsio
from slurm_ckpt.core.chunks import run_chunks
from slurm_ckpt.core.faults import crashpoint
from slurm_ckpt.core.hashing import DEFAULT_CHUNK_SIZE, ChunkedHasher, chunk_digest, combine
from slurm_ckpt.core.layout import TMP_PREFIX, step_dirname
from slurm_ckpt.core.manifest import MANIFEST_NAME, FileEntry, Manifest
from slurm_ckpt.core.names import validate_key, validate_relpath, validate_user
from slurm_ckpt.errors import CkptError, VerifyError

WRITE_PIECE = 16 * 2**20


class AlreadyCommitted(CkptError):
    """The step is already committed on this tier; a checkpoint is never overwritten."""


def read_manifest(step_fd: int, where: str) -> Manifest:
    """Read and check the manifest in an open step directory (VerifyError if bad)."""
    try:
        data = fsio.read_small(step_fd, MANIFEST_NAME)
    except FileNotFoundError:
        raise VerifyError(f"{where}: no manifest (not committed)") from None
    except OSError as exc:
        raise VerifyError(f"{where}: manifest unreadable ({exc.strerror or exc})") from None
    return Manifest.from_bytes(data, where)


class CheckpointWriter:
    """Writes one checkpoint into a tier root and commits it atomically.

    Use as a context manager: leaving the block by an exception removes the temporary
    directory; :meth:`commit` publishes the checkpoint.
    """

    def __init__(
        self,
        root: str,
        user: str,
        key: str,
        step: int,
        *,
        tokens: Optional[int] = None,
        job: Optional[str] = None,
        node: Optional[str] = None,
        meta: Optional[Dict[str, Any]] = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        streams: int = 4,
        where: str = "tier",
    ) -> None:
        self.user = validate_user(user)
        self.key = validate_key(key)
        self.step = step
        self.step_name = step_dirname(step)
        self.tokens, self.job, self.node = tokens, job, node
        self.meta = dict(meta or {})
        self.chunk_size = chunk_size
        self.streams = streams
        self.where = f"{where}:{root}/{user}/{key}/{self.step_name}"
        self._entries: Dict[str, FileEntry] = {}
        self._lock = threading.Lock()
        self._dirs: Dict[str, int] = {}
        self._done = False
        self.tmp_name = f"{TMP_PREFIX}{self.step_name}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            root_fd = fsio.open_dir(root)
        except OSError as exc:
            raise fsio.tier_error(exc, f"{where} root {root}") from None
        try:
            self._key_fd = fsio.open_beneath(root_fd, [user, key], create=True)
        except OSError as exc:
            raise fsio.tier_error(exc, f"{where}: cannot create {root}/{user}/{key}") from None
        finally:
            os.close(root_fd)
        try:
            self._clear_leftover_step()
            os.mkdir(self.tmp_name, fsio.DIR_MODE, dir_fd=self._key_fd)
            self._tmp_fd = os.open(self.tmp_name, fsio.O_DIR, dir_fd=self._key_fd)
        except OSError as exc:
            os.close(self._key_fd)
            raise fsio.tier_error(exc, f"{self.where}: cannot start checkpoint") from None
        except BaseException:
            os.close(self._key_fd)
            raise
        self._dirs[""] = self._tmp_fd
        crashpoint("writer:tmpdir")

    # -- setup -----------------------------------------------------------------
    def _clear_leftover_step(self) -> None:
        """A ``step-N`` without a valid manifest is debris of a crashed commit: remove it."""
        try:
            fd = os.open(self.step_name, fsio.O_DIR, dir_fd=self._key_fd)
        except FileNotFoundError:
            return
        try:
            read_manifest(fd, self.where)
        except VerifyError:
            os.close(fd)
            fsio.remove_tree(self._key_fd, self.step_name)
            return
        os.close(fd)
        raise AlreadyCommitted(f"{self.where}: step already committed")

    def _parent_fd(self, relpath: str) -> Tuple[int, str]:
        """fd of the directory that will hold ``relpath`` (created, symlink-safe)."""
        parts = relpath.split("/")
        d = "/".join(parts[:-1])
        with self._lock:
            if d not in self._dirs:
                parent = ""
                for part in parts[:-1]:
                    sub = f"{parent}/{part}" if parent else part
                    if sub not in self._dirs:
                        self._dirs[sub] = fsio.open_beneath(self._dirs[parent], [part], True)
                    parent = sub
            return self._dirs[d], parts[-1]

    def _create(self, relpath: str) -> int:
        validate_relpath(relpath)
        with self._lock:
            if relpath in self._entries:
                raise CkptError(f"{self.where}: file {relpath!r} written twice")
        pfd, name = self._parent_fd(relpath)
        return os.open(name, fsio.O_NEWFILE, fsio.FILE_MODE, dir_fd=pfd)

    def _add(self, entry: FileEntry) -> None:
        with self._lock:
            self._entries[entry.path] = entry

    # -- writing ---------------------------------------------------------------
    def write_buffers(self, items: Mapping[str, object]) -> List[FileEntry]:
        """Write several in-memory buffers as files, in parallel chunks, hashed on the way."""
        names = list(items)
        views = [memoryview(items[n]).cast("B") for n in names]
        fds: List[Optional[int]] = [None] * len(names)
        try:
            for i, n in enumerate(names):
                fds[i] = self._create(n)

            def op(fi: int, ci: int, off: int, length: int) -> str:
                piece = views[fi][off : off + length]
                digest = chunk_digest(piece)
                fsio.write_all(fds[fi], piece, off)  # type: ignore[arg-type]
                crashpoint("writer:chunk")
                return digest

            def done(fi: int) -> None:
                os.fsync(fds[fi])  # type: ignore[arg-type]
                crashpoint("writer:fsync")

            digests = run_chunks([len(v) for v in views], self.chunk_size, op, done, self.streams)
        except OSError as exc:
            raise fsio.tier_error(exc, f"{self.where}: write failed") from None
        finally:
            for fd in fds:
                if fd is not None:
                    os.close(fd)
        entries = [FileEntry(n, len(v), combine(d), d) for n, v, d in zip(names, views, digests)]
        for e in entries:
            self._add(e)
        return entries

    @contextmanager
    def open_stream(self, relpath: str) -> Iterator[Any]:
        """A writable binary stream for producers that emit data piecewise."""
        try:
            fd = self._create(relpath)
        except OSError as exc:
            raise fsio.tier_error(exc, f"{self.where}: cannot create {relpath}") from None
        stream = _HashingStream(fd, self.chunk_size)
        try:
            yield stream
            os.fsync(fd)
        except OSError as exc:
            raise fsio.tier_error(exc, f"{self.where}: write failed") from None
        finally:
            os.close(fd)
        h, chunks = stream.hasher.finish()
        self._add(FileEntry(relpath, stream.hasher.size, h, chunks))

    # -- commit ----------------------------------------------------------------
    def commit(self) -> Manifest:
        """Publish the checkpoint: rename into place, then write the manifest last."""
        if self._done:
            raise CkptError(f"{self.where}: writer already finished")
        manifest = Manifest(
            user=self.user,
            key=self.key,
            step=self.step,
            files=sorted(self._entries.values(), key=lambda e: e.path),
            tokens=self.tokens,
            wall_time=time.time(),
            job=self.job,
            node=self.node,
            meta=self.meta,
            chunk_size=self.chunk_size,
        )
        try:
            for sub in sorted(self._dirs, key=len, reverse=True):
                os.fsync(self._dirs[sub])
            crashpoint("commit:dirs-synced")
            try:
                os.rename(
                    self.tmp_name, self.step_name, src_dir_fd=self._key_fd, dst_dir_fd=self._key_fd
                )
            except OSError as exc:
                if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    raise AlreadyCommitted(f"{self.where}: step appeared concurrently") from None
                raise
            crashpoint("commit:renamed")
            os.fsync(self._key_fd)
            crashpoint("commit:key-synced")
            fsio.atomic_replace(self._tmp_fd, MANIFEST_NAME, manifest.to_bytes())
            crashpoint("commit:manifest")
        except OSError as exc:
            self.abort()
            raise fsio.tier_error(exc, f"{self.where}: commit failed") from None
        self._done = True
        self._close()
        return manifest

    def abort(self) -> None:
        """Remove everything this writer made; nothing of it was ever listable."""
        if self._done:
            return
        self._done = True
        for name in (self.tmp_name, self.step_name):
            try:
                fd = os.open(name, fsio.O_DIR, dir_fd=self._key_fd)
            except OSError:
                continue
            same = os.fstat(fd).st_ino == os.fstat(self._tmp_fd).st_ino
            os.close(fd)
            if same:
                with suppress(OSError):
                    fsio.remove_tree(self._key_fd, name)
        self._close()

    def _close(self) -> None:
        for fd in set(self._dirs.values()):
            os.close(fd)
        self._dirs.clear()
        os.close(self._key_fd)

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, et: object, ev: object, tb: object) -> None:
        self.abort()  # no-op after commit; removes the temporary directory otherwise


class _HashingStream:
    """File-like sink that hashes what it writes (binary ``write`` only)."""

    def __init__(self, fd: int, chunk_size: int) -> None:
        self.fd = fd
        self.hasher = ChunkedHasher(chunk_size)

    def write(self, data: object) -> int:
        mv = memoryview(data).cast("B")
        self.hasher.update(mv)
        fsio.write_all(self.fd, mv)
        return len(mv)

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        pass
