"""The atomic, verified commit of one checkpoint on one tier.

Protocol (each arrow is durable before the next begins):

1. make ``<key>/.tmp-step-N-<pid>-<rand>/`` and write every payload file into it, hashing
   each chunk as it is written; fsync every file and directory;
2. write ``manifest.json`` last, into that work directory (temp file, fsync, rename,
   fsync the directory);
3. rename the work directory to ``<key>/step-N/`` - the one atomic act that publishes the
   checkpoint - and fsync ``<key>/``.

A checkpoint exists only once step 3 has completed: readers list a step only when its
manifest parses and checks, and a ``step-N`` never exists without its manifest while a
writer is at work (so no writer can mistake another's commit in progress for debris). A
crash at any point leaves either nothing listable or the complete checkpoint; leftovers
(``.tmp-*``, or a ``step-N`` without manifest from a crash of an older version or a copy
found damaged and uncommitted) are swept by the next writer of that step or by
:meth:`PosixTier.sweep`.

A **copy** of a committed checkpoint from another tier (``copy_of=manifest``) goes
through the same protocol, with two differences: its work directory is the writer's own,
``.partial-step-N.<host>.<pid>.<rand>`` (two nodes, or two processes, copying one step to a
shared tier at once never share one), and a copy killed midway is found and resumed by
the next copy of that step on the same node: it claims the dead writer's work directory
by renaming it to its own name (atomic: two claimants cannot both win) and keeps the
complete files (:meth:`CheckpointWriter.resumable`); the manifest is the source's, byte
for byte. A writer that loses the race to commit (``step-N`` is there when it renames)
raises :class:`AlreadyCommitted` and removes only its own work directory - never the
``step-N`` the winner committed. This is the one place a checkpoint is committed on a
POSIX tier.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import threading
import time
from contextlib import contextmanager, suppress
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Set, Tuple

from slurm_ckpt.core import fsio, trust
from slurm_ckpt.core.chunks import hash_range, run_chunks
from slurm_ckpt.core.copy_owner import dead_here, hold_partial, release_partial, writer_id
from slurm_ckpt.core.faults import crashpoint
from slurm_ckpt.core.hashing import DEFAULT_CHUNK_SIZE, ChunkedHasher, chunk_digest, combine
from slurm_ckpt.core.layout import (
    TMP_PREFIX,
    parse_partial_dirname,
    partial_dirname,
    step_dirname,
)
from slurm_ckpt.core.manifest import MANIFEST_NAME, FileEntry, Manifest
from slurm_ckpt.core.manifest_limits import check_bytes
from slurm_ckpt.core.names import validate_key, validate_relpath, validate_user
from slurm_ckpt.core.verify import VerifyReport, open_payload, verify_files
from slurm_ckpt.errors import CkptError, VerifyError


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


def manifest_to_commit(w: Any, entries: Mapping[str, FileEntry]) -> Manifest:
    """The manifest a writer (of any tier) commits: a copy's own, complete (every file of
    it written or kept), or a fresh one over what was written. ``w`` has the writer
    fields ``copy_of``, ``where``, ``user``, ``key``, ``step``, ``tokens``, ``job``,
    ``node``, ``meta``, ``chunk_size``; ``entries`` are the files it wrote (the writer's
    own record, handed in so that this function reads no writer's private state)."""
    if w.copy_of is not None:
        missing = sorted({e.path for e in w.copy_of.files} - set(entries))
        if missing:
            raise CkptError(
                f"{w.where}: copy incomplete ({len(missing)} files missing, first {missing[0]})"
            )
        return w.copy_of
    return Manifest(
        user=w.user,
        key=w.key,
        step=w.step,
        files=sorted(entries.values(), key=lambda e: e.path),
        tokens=w.tokens,
        wall_time=time.time(),
        job=w.job,
        node=w.node,
        meta=w.meta,
        chunk_size=w.chunk_size,
    )


class CheckpointWriter:
    """Writes one checkpoint into a tier root and commits it atomically.

    A context manager: a clean exit commits (unless :meth:`commit` already did), an
    exception aborts and removes the work directory. ``copy_of`` switches to copy mode
    (see the module docstring): payload files come in through :meth:`file` sinks and the
    given manifest is committed unchanged.
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
        copy_of: Optional[Manifest] = None,
    ) -> None:
        self.user = validate_user(user)
        self.key = validate_key(key)
        self.step = step
        self.step_name = step_dirname(step)
        self.tokens, self.job, self.node = tokens, job, node
        self.meta = dict(meta or {})
        self.copy_of = copy_of
        self.chunk_size = copy_of.chunk_size if copy_of is not None else chunk_size
        self.streams = streams
        self.where = f"{where}:{root}/{user}/{key}/{self.step_name}"
        self._entries: Dict[str, FileEntry] = {}
        self._lock = threading.Lock()
        self._dirs: Dict[str, int] = {}
        self._sinks: Dict[str, _FileSink] = {}
        self._done = False
        if copy_of is None:
            self.tmp_name = f"{TMP_PREFIX}{self.step_name}-{os.getpid()}-{secrets.token_hex(4)}"
        else:
            if (copy_of.user, copy_of.key, copy_of.step) != (user, key, step):
                raise CkptError(f"{self.where}: manifest names another checkpoint")
            self.tmp_name = partial_dirname(step, writer_id())
        #: The work directory by path (for producers that write files themselves, e.g.
        #: :mod:`slurm_ckpt.job.output`); it is renamed to ``step-N`` at the commit.
        self.work_path = os.path.join(root, user, key, self.tmp_name)
        try:
            root_fd = fsio.open_dir(root)
        except OSError as exc:
            raise fsio.tier_error(exc, f"{where} root {root}") from None
        try:
            self._key_fd = trust.open_user_subdir(root_fd, user, [key], True, f"{where}:{root}")
        except OSError as exc:
            raise fsio.tier_error(exc, f"{where}: cannot create {root}/{user}/{key}") from None
        finally:
            os.close(root_fd)
        self._root = root
        try:
            self._clear_leftover_step()
            if copy_of is None or not self._claim_partial():
                os.mkdir(self.tmp_name, fsio.DIR_MODE, dir_fd=self._key_fd)
                os.fsync(self._key_fd)
            self._tmp_fd = os.open(self.tmp_name, fsio.O_DIR, dir_fd=self._key_fd)
        except OSError as exc:
            self._unregister()
            os.close(self._key_fd)
            raise fsio.tier_error(exc, f"{self.where}: cannot start checkpoint") from None
        except BaseException:
            self._unregister()
            os.close(self._key_fd)
            raise
        self._dirs[""] = self._tmp_fd
        crashpoint("writer:tmpdir")

    # -- setup -----------------------------------------------------------------
    def _clear_leftover_step(self) -> None:
        """A ``step-N`` without a valid manifest is debris (a crash of an older version's
        commit, a copy found damaged and uncommitted): remove it - that very directory,
        never one another writer renamed into place meanwhile."""
        try:
            fd = os.open(self.step_name, fsio.O_DIR, dir_fd=self._key_fd)
        except FileNotFoundError:
            return
        try:
            try:
                read_manifest(fd, self.where)
            except VerifyError:
                _remove_if_same(self._key_fd, self.step_name, fd)
                return
        finally:
            os.close(fd)
        raise AlreadyCommitted(f"{self.where}: step already committed")

    def _claim_partial(self) -> bool:
        """Copy mode: take over the work directory of a copy of this step that a writer
        of this node left behind when it died (renamed to this writer's name: atomic, so
        of two claimants one wins and the other looks further). True when one was
        claimed. Another node's work directories are never touched (their writers may be
        alive); :meth:`PosixTier.sweep` with ``partials`` removes them."""
        mine = os.path.join(self._root, self.user, self.key, self.tmp_name)
        live = hold_partial(mine)
        for name in sorted(os.listdir(self._key_fd)):
            parsed = parse_partial_dirname(name)
            if parsed is None or parsed[0] != self.step or parsed[1] is None:
                continue
            if name == self.tmp_name or not dead_here(parsed[1]):
                continue
            if os.path.join(self._root, self.user, self.key, name) in live:
                continue
            try:
                st = os.stat(name, dir_fd=self._key_fd, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    continue
                os.rename(name, self.tmp_name, src_dir_fd=self._key_fd, dst_dir_fd=self._key_fd)
            except FileNotFoundError:
                continue  # another writer claimed it first
            os.fsync(self._key_fd)
            return True
        return False

    def _unregister(self) -> None:
        if self.copy_of is not None:
            release_partial(os.path.join(self._root, self.user, self.key, self.tmp_name))

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

    # -- files placed by others ----------------------------------------------------------
    @property
    def work_fd(self) -> int:
        """The open work directory (files placed into it by a producer are then hashed
        and recorded with :meth:`add_entry`)."""
        return self._tmp_fd

    def written(self) -> List[FileEntry]:
        """The files written and hashed so far (what the manifest will list), e.g. for
        replicas to compare their digests before the commit."""
        with self._lock:
            return list(self._entries.values())

    def add_entry(self, entry: FileEntry) -> None:
        """Fresh mode: record a file that is already in the work directory (hashed and
        made durable by the caller)."""
        validate_relpath(entry.path)
        with self._lock:
            if entry.path in self._entries:
                raise CkptError(f"{self.where}: file {entry.path!r} recorded twice")
            self._entries[entry.path] = entry

    # -- fresh mode ------------------------------------------------------------
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

    # -- copy mode -------------------------------------------------------------
    def _manifest_for_copy(self) -> Manifest:
        if self.copy_of is None:
            raise CkptError(f"{self.where}: not a copy (give copy_of= to the writer)")
        return self.copy_of

    def resumable(self) -> Set[str]:
        """Files an interrupted copy completed that match the manifest (kept, and counted
        as written); everything else in the work directory is removed."""
        m = self._manifest_for_copy()
        files, problems = fsio.walk_files(self._tmp_fd)
        if problems:
            # Symlinks or special files in our own work area: start the copy over.
            self._clear_work_dir()
            return set()
        wanted = {e.path: e for e in m.files}
        keep: Set[str] = set()
        for rel, st in files:
            e = wanted.get(rel)
            ok = False
            if e is not None and st.st_size == e.size:
                fd = open_payload(self._tmp_fd, rel)
                try:
                    ok = all(
                        hash_range(
                            fd, i * m.chunk_size, min(m.chunk_size, e.size - i * m.chunk_size)
                        )
                        == c
                        for i, c in enumerate(e.chunks)
                    )
                finally:
                    os.close(fd)
            if ok:
                keep.add(rel)
                self._add(e)  # type: ignore[arg-type]
            else:
                pfd, name = self._parent_fd(rel)
                os.unlink(name, dir_fd=pfd)
        return keep

    def _clear_work_dir(self) -> None:
        for fd in set(self._dirs.values()) - {self._tmp_fd}:
            os.close(fd)
        self._dirs = {"": self._tmp_fd}
        for name in os.listdir(self._tmp_fd):
            st = os.stat(name, dir_fd=self._tmp_fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                fsio.remove_tree(self._tmp_fd, name)
            else:
                os.unlink(name, dir_fd=self._tmp_fd)

    def file(self, relpath: str, size: int) -> _FileSink:
        """A sink for one payload file of the copied checkpoint, space reserved up front
        (a full filesystem fails here, not halfway). Closed by :meth:`_FileSink.finish`."""
        entry = self._manifest_for_copy().file(relpath)
        if entry.size != size:
            raise CkptError(f"{self.where}: {relpath}: size {size} != manifest {entry.size}")
        try:
            fd = self._create(relpath)
        except OSError as exc:
            raise fsio.tier_error(exc, f"{self.where}: cannot create {relpath}") from None
        sink = _FileSink(entry, fd, self._sink_done)
        with self._lock:
            self._sinks[relpath] = sink
        if size:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    sink.close()
                    raise fsio.tier_error(exc, f"{self.where}: {relpath}") from None
        return sink

    def _sink_done(self, sink: _FileSink) -> None:
        with self._lock:
            self._sinks.pop(sink.entry.path, None)
            self._entries[sink.entry.path] = sink.entry

    def verify_written(self) -> VerifyReport:
        """Drop what was written from the page cache and hash it again from the device."""
        m = self._manifest_for_copy()
        for e in m.files:
            with suppress(OSError):
                fd = open_payload(self._tmp_fd, e.path)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        return verify_files(self._tmp_fd, m, self.where, self.streams)

    # -- commit ----------------------------------------------------------------
    def commit(self) -> Manifest:
        """Publish the checkpoint: the manifest last into the work directory, then the
        work directory renamed to ``step-N`` (see the module docstring).

        When ``step-N`` is already there (another writer committed it first), raises
        :class:`AlreadyCommitted` after removing this writer's own work directory: the
        caller compares the manifests (:func:`slurm_ckpt.tiers.copy.copy_checkpoint`)."""
        if self._done:
            raise CkptError(f"{self.where}: writer already finished")
        manifest = manifest_to_commit(self, self._entries)
        data = manifest.to_bytes()
        try:
            # Root reads manifests within the site's limits and would count this one as
            # damage: the writer hears it now, not at restore.
            check_bytes(data, self.where)
        except VerifyError:
            self.abort()
            raise
        try:
            for sub in sorted(self._dirs, key=len, reverse=True):
                os.fsync(self._dirs[sub])
            crashpoint("commit:dirs-synced")
            fsio.atomic_replace(self._tmp_fd, MANIFEST_NAME, data)
            crashpoint("commit:manifest")
            try:
                os.rename(
                    self.tmp_name, self.step_name, src_dir_fd=self._key_fd, dst_dir_fd=self._key_fd
                )
            except OSError as exc:
                if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    self.abort()  # our work directory only: step-N is the other writer's
                    raise AlreadyCommitted(f"{self.where}: step appeared concurrently") from None
                raise
        except OSError as exc:
            self.abort()
            raise fsio.tier_error(exc, f"{self.where}: commit failed") from None
        # Published: from here on step-N may be counted by others (a concurrent copy that
        # finds it), so nothing below removes it, whatever fails.
        self._done = True
        self._unregister()
        try:
            crashpoint("commit:renamed")
            os.fsync(self._key_fd)
            crashpoint("commit:key-synced")
        except OSError as exc:
            raise fsio.tier_error(exc, f"{self.where}: commit not durable") from None
        finally:
            self._close()
        return manifest

    def abort(self) -> None:
        """Remove this writer's own work directory (that very directory: found by its
        name and checked to be the one it made); nothing of it was ever listable, and a
        ``step-N`` is never touched - after a lost race it is another writer's commit."""
        if self._done:
            return
        self._done = True
        self._unregister()
        try:
            fd = os.open(self.tmp_name, fsio.O_DIR, dir_fd=self._key_fd)
        except OSError:
            fd = None
        if fd is not None:
            try:
                same = _same_dir(fd, self._tmp_fd)
            finally:
                os.close(fd)
            if same:
                with suppress(OSError):
                    fsio.remove_tree(self._key_fd, self.tmp_name)
        self._close()

    def _close(self) -> None:
        for sink in list(self._sinks.values()):
            sink.close()
        self._sinks.clear()
        for fd in set(self._dirs.values()):
            os.close(fd)
        self._dirs.clear()
        os.close(self._key_fd)

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, et: object, ev: object, tb: object) -> None:
        if et is None and not self._done:
            self.commit()  # commit on a clean exit
        else:
            self.abort()  # no-op after commit; removes the work directory otherwise


def _same_dir(a: int, b: int) -> bool:
    sa, sb = os.fstat(a), os.fstat(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _remove_if_same(key_fd: int, name: str, fd: int) -> None:
    """Remove ``name`` below ``key_fd`` if it is still the directory open as ``fd``: it is
    renamed aside first (atomic), checked, and put back when another writer had renamed
    a directory of its own into place meanwhile."""
    aside = f".trash-{name}-{secrets.token_hex(4)}"
    try:
        os.rename(name, aside, src_dir_fd=key_fd, dst_dir_fd=key_fd)
    except FileNotFoundError:
        return
    afd = os.open(aside, fsio.O_DIR, dir_fd=key_fd)
    try:
        same = _same_dir(afd, fd)
    finally:
        os.close(afd)
    if not same:
        with suppress(OSError):
            os.rename(aside, name, src_dir_fd=key_fd, dst_dir_fd=key_fd)
        return
    os.fsync(key_fd)
    fsio.remove_tree(key_fd, aside)


class _FileSink:
    """One payload file of a copy: positional writes, fsync and close at :meth:`finish`."""

    def __init__(self, entry: FileEntry, fd: int, done: Callable[[_FileSink], None]) -> None:
        #: The writer's record of a finished file (it lists the file from then on).
        self.done = done
        self.entry = entry
        self.size = entry.size
        self.fd: Optional[int] = fd

    def fileno(self) -> Optional[int]:
        return self.fd

    def write(self, data: memoryview, offset: int) -> None:
        fsio.write_all(self.fd, data, offset)  # type: ignore[arg-type]

    def finish(self) -> None:
        os.fsync(self.fd)  # type: ignore[arg-type]
        self.close()
        self.done(self)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


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
