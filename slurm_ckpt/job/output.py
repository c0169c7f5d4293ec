"""Checkpoints that are directories of files: any framework's own checkpoint, SCR style.

Most trainers already write their checkpoints themselves (HF ``save_pretrained`` and
``checkpoint-N/``, Lightning's ``*.ckpt``, a plain ``torch.save``). This module protects
those bytes the same way as a :meth:`~slurm_ckpt.Checkpointer.save` state, in the spirit
of SCR's ``Start_output`` / ``Route_file`` / ``Complete_output``::

    with ckpt.output(step=step, tokens=tokens) as path:   # a directory on the local tier
        model.save_pretrained(path); torch.save(opt.state_dict(), path / "optim.pt")
    path = ckpt.restore_path()          # newest verified, on the local tier; or None
    ckpt.adopt(step, "out/checkpoint-500")    # a directory the framework wrote already

How it works, and why:

* ``output()`` opens a fresh writer of the step on the local tier (its work directory,
  ``.tmp-step-N-<pid>-<rand>/rank-<NNNNN>/``, swept if the process dies) and hands out
  that directory: the framework writes straight onto the local tier, no copy. When the
  body ends cleanly the step goes to the local writer thread like any save: every file
  is hashed and fsynced there, the manifest is written last, and then the one flush
  engine, retention, the ledger, ``list``/``verify``/``status`` and the epilog treat it as
  any other checkpoint (``meta.state_format`` is :data:`DIR_FORMAT`). A body that raises
  commits nothing: the work directory is removed.
* ``adopt()`` snapshots a directory the framework wrote into such a writer, file by file:
  a reflink clone where the filesystem has them (its own inode, no data copied), else a
  hard link, else (another filesystem) a copy. Once it returns, the framework may delete
  its directory (its own rotation, ``save_total_limit``): the snapshot holds the data. A
  hard link shares the framework's inode, and root's verify refuses files with more than
  one link (a user could link in someone else's file), so the background writer turns
  every link that is still shared into a file of its own (copied, hashed on the way)
  before the commit; a file the framework rewrote in place in that window (size or
  mtime changed) fails the save rather than committing a torn file.
* With several ranks each rank writes its own part (its own series, as with ``save()``),
  and :meth:`restore_path` counts a step only when every rank's part is committed; the
  ranks agree on the step the way ``restore()`` does.
* ``restore_path()`` verifies the rank's part before handing it out: on the local tier
  by re-reading every byte; from the PFS, object store or cold tier by copying it to the
  local tier through the copy engine (every chunk checked against the manifest). A copy
  that fails is marked bad and the next tier, or the next older step, is taken. The
  directory handed out is the committed checkpoint itself: read it, never write into it.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple, Union

from slurm_ckpt.core import fsio
from slurm_ckpt.core.faults import crashpoint
from slurm_ckpt.core.hashing import ChunkedHasher
from slurm_ckpt.core.manifest import FileEntry, Manifest
from slurm_ckpt.core.retention import selected_for_flush
from slurm_ckpt.errors import CkptError, NotFound, TierError, VerifyError
from slurm_ckpt.job.bookkeeping import SaveRecord
from slurm_ckpt.job.context import JobContext
from slurm_ckpt.job.payload import Prepared
from slurm_ckpt.job.restore import (
    NotThisFormat,
    Restored,
    Restorer,
    payload_format,
)
from slurm_ckpt.job.saved import Saved
from slurm_ckpt.tiers.base import Tier
from slurm_ckpt.tiers.copy import copy_checkpoint

log = logging.getLogger(__name__)

__all__ = ["DIR_FORMAT", "DirRestorer", "PreparedDir", "adopt", "output", "restore_path"]

#: ``meta.state_format`` of a checkpoint that is a directory of the user's own files.
DIR_FORMAT = "slurm_ckpt.dir/1"

#: Bytes read (and written, for a copy) per system call while hashing a file.
PIECE = 8 * 2**20
#: Files hashed in parallel by the background writer.
HASH_STREAMS = 4

PathLike = Union[str, "os.PathLike[str]"]


class PreparedDir:
    """One rank's directory in an open local-tier writer: filled by the framework (or
    by :func:`adopt`), then hashed and committed by :meth:`commit` on the local writer
    thread (see the module docstring)."""

    def __init__(self, writer: Any, prefix: str) -> None:
        self.writer = writer
        self.prefix = prefix
        fd = fsio.open_beneath(writer.work_fd, [prefix], True)
        os.close(fd)
        self.path = Path(writer.work_path) / prefix
        #: relpath -> (size, mtime_ns) of files adopted as hard links: they must not
        #: change before they are copied apart.
        self.linked: Dict[str, Tuple[int, int]] = {}

    def _files(self) -> List[Tuple[str, os.stat_result]]:
        fd = fsio.open_beneath(self.writer.work_fd, [self.prefix])
        try:
            files, problems = fsio.walk_files(fd, f"{self.prefix}/")
        finally:
            os.close(fd)
        if problems:
            raise CkptError(f"{self.writer.where}: {problems[0]} (only regular files are kept)")
        return files

    def nbytes(self) -> int:
        return sum(st.st_size for _, st in self._files())

    def commit(self) -> Manifest:
        """Hash every file (making hard links files of their own), record it, commit the
        manifest last. Any failure aborts the writer: nothing is listable."""
        w = self.writer
        try:
            files = self._files()
            if not files:
                raise CkptError(f"{w.where}: the checkpoint directory is empty")
            streams = max(1, min(HASH_STREAMS, len(files)))
            with ThreadPoolExecutor(streams, thread_name_prefix="ckpt-hash") as pool:
                entries = list(pool.map(lambda f: self._own_and_hash(f[0]), files))
            parts = [rel.split("/")[:-1] for rel, _ in files]
            self._sync_dirs({"/".join(p[:i]) for p in parts for i in range(1, len(p) + 1)})
            crashpoint("output:dirs-synced")
            for e in entries:
                w.add_entry(e)
            return w.commit()
        except BaseException:
            w.abort()
            raise

    def abort(self) -> None:
        self.writer.abort()

    def _sync_dirs(self, dirs: Set[str]) -> None:
        """fsync every directory that holds a file (the writer syncs only the ones it
        made itself): the names must be durable before the manifest is."""
        for d in sorted(dirs, key=len, reverse=True):
            fd = fsio.open_beneath(self.writer.work_fd, d.split("/"))
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _own_and_hash(self, rel: str) -> FileEntry:
        parts = rel.split("/")
        pfd = fsio.open_beneath(self.writer.work_fd, parts[:-1])
        try:
            fd = os.open(parts[-1], fsio.O_READ | os.O_NONBLOCK, dir_fd=pfd)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise CkptError(f"{self.writer.where}/{rel}: not a regular file")
                if st.st_nlink == 1:
                    hasher = _hash_fd(fd, self.writer.chunk_size)
                    os.fsync(fd)
                    after = os.fstat(fd)
                    seen = {(st.st_size, st.st_mtime_ns), (after.st_size, after.st_mtime_ns)}
                    if rel in self.linked and seen != {self.linked[rel]}:
                        raise CkptError(f"{self.writer.where}/{rel}: changed while being adopted")
                else:
                    hasher = self._copy_apart(pfd, parts[-1], fd, rel, st)
            finally:
                os.close(fd)
        except OSError as exc:
            raise fsio.tier_error(exc, f"{self.writer.where}/{rel}") from None
        finally:
            os.close(pfd)
        crashpoint("output:file-hashed")
        digest, chunks = hasher.finish()
        return FileEntry(rel, hasher.size, digest, chunks)

    def _copy_apart(
        self, pfd: int, name: str, fd: int, rel: str, st: os.stat_result
    ) -> ChunkedHasher:
        """A file still shared with the framework (a hard link): copy it into a file of
        its own, hashed on the way, and put that in its place."""
        tmp = f".tmp-own-{secrets.token_hex(4)}"
        out = os.open(tmp, fsio.O_NEWFILE, fsio.FILE_MODE, dir_fd=pfd)
        try:
            hasher = ChunkedHasher(self.writer.chunk_size)
            off = 0
            while True:
                b = os.pread(fd, PIECE, off)
                if not b:
                    break
                hasher.update(b)
                fsio.write_all(out, memoryview(b))
                off += len(b)
            os.fsync(out)
        except BaseException:
            os.close(out)
            fsio.unlink_quiet(pfd, tmp)
            raise
        os.close(out)
        after = os.fstat(fd)
        was = self.linked.get(rel, (st.st_size, st.st_mtime_ns))
        if (after.st_size, after.st_mtime_ns) != was or hasher.size != after.st_size:
            fsio.unlink_quiet(pfd, tmp)
            raise CkptError(f"{self.writer.where}/{rel}: changed while being adopted")
        crashpoint("output:copied-apart")
        os.rename(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd)
        return hasher


def _hash_fd(fd: int, chunk_size: int) -> ChunkedHasher:
    hasher = ChunkedHasher(chunk_size)
    off = 0
    while True:
        b = os.pread(fd, PIECE, off)
        if not b:
            return hasher
        hasher.update(b)
        off += len(b)


# ---------------------------------------------------------------------- saving
def _start(
    ctx: JobContext,
    step: int,
    tokens: Optional[int],
    meta: Optional[Dict[str, Any]],
    preemption: Optional[bool],
    what: str,
) -> Tuple[SaveRecord, PreparedDir, bool]:
    ctx.check_open(what)
    ctx.lease.ensure()  # held since construction, except by a replica rank
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CkptError(f"{what}(): step must be a whole number >= 0, got {step!r}")
    preempt = ctx.preempting(preemption)
    rec = SaveRecord(
        step=step,
        tokens=tokens,
        seq=-1,
        reason="signal" if preempt else "interval",
        nbytes=0,
        forced=preempt,
        meta=dict(meta or {}),
    )
    writer = ctx.pipeline.open_local(rec, DIR_FORMAT)
    try:
        prepared = PreparedDir(writer, ctx.prefix)
    except BaseException:
        writer.abort()
        raise
    return rec, prepared, preempt


def _submit(
    ctx: JobContext, rec: SaveRecord, prepared: PreparedDir, preempt: bool, t0: float
) -> Saved:
    """What ``save()`` does after its snapshot: hand the step to the local writer (which
    hashes and commits it, then queues its flush), and tell the schedule."""
    books, pipe = ctx.books, ctx.pipeline
    try:
        rec.nbytes = prepared.nbytes()
    except BaseException:
        prepared.abort()
        raise
    books.emit("save_start", step=rec.step, reason=rec.reason)
    pipe.start()
    if pipe.local_job is not None:
        books.emit("backpressure_wait", step=rec.step)
    t1 = time.monotonic()
    pipe.wait_local_free()
    if ctx.flush_policy == "wait" and not preempt and pipe.flushes_busy():
        books.emit("flush_wait", step=rec.step)
        pipe.wait_flushes()
    waited = time.monotonic() - t1
    rec.seq = ctx.take_seq()
    # Laptop mode (no warm tier): nothing to flush to, so nothing is selected.
    rec.selected = ctx.warm is not None and (preempt or selected_for_flush(rec.seq, ctx.policy))
    rec.payload = Prepared(prepared)
    stall = time.monotonic() - t0
    rec.stall_s = rec.snapshot_s = stall
    pipe.submit(rec)
    ctx.schedule.saved(rec.step, rec.tokens, stall, preemption=preempt)
    pipe.count(saves=1, stall_s=stall, wait_s=waited, last_stall_s=stall, last_snapshot_s=stall)
    books.emit("save_returned", step=rec.step, stall_s=stall)
    return Saved(
        step=rec.step,
        tokens=rec.tokens,
        nbytes=rec.nbytes,
        stall_s=stall,
        preemption=preempt,
        synchronous=False,
    )


@contextmanager
def output(
    ctx: JobContext,
    step: int,
    tokens: Optional[int] = None,
    meta: Optional[Dict[str, Any]] = None,
    preemption: Optional[bool] = None,
) -> Iterator[Path]:
    """:meth:`Checkpointer.output`: see the module docstring."""
    t0 = time.monotonic()
    rec, prepared, preempt = _start(ctx, step, tokens, meta, preemption, "output")
    try:
        yield prepared.path
    except BaseException:
        prepared.abort()
        log.warning("[ckpt] step=%d: the output body raised: nothing committed", step)
        raise
    if not _any_file(str(prepared.path)):
        prepared.abort()
        raise CkptError(
            f"output(step={step}): the block wrote no file into {prepared.path}: nothing "
            "committed (write the checkpoint's files into the path it yields)"
        )
    _submit(ctx, rec, prepared, preempt, t0)


def _any_file(top: str) -> bool:
    """Whether the directory holds a file anywhere below it (links not followed)."""
    return any(files for _root, _dirs, files in os.walk(top))


def adopt(
    ctx: JobContext,
    step: int,
    src: PathLike,
    tokens: Optional[int] = None,
    meta: Optional[Dict[str, Any]] = None,
    preemption: Optional[bool] = None,
) -> Saved:
    """:meth:`Checkpointer.adopt`: see the module docstring."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CkptError(
            f"adopt(): step must be a whole number >= 0, not {step!r} "
            "(the order is adopt(step, directory))"
        )
    if isinstance(src, bytes) or not isinstance(src, (str, os.PathLike)):
        raise CkptError(f"adopt(): the directory must be a path, not {type(src).__name__}")
    t0 = time.monotonic()
    src = os.fspath(src)
    try:
        sfd = os.open(src, fsio.O_DIR)
    except OSError as exc:
        raise CkptError(f"adopt(): {src}: {exc.strerror or exc}") from None
    try:
        files, problems = fsio.walk_files(sfd)
        if problems:
            raise CkptError(f"adopt(): {src}: {problems[0]} (only regular files are kept)")
        if not files:
            raise CkptError(f"adopt(): {src}: no files to adopt")
        rec, prepared, preempt = _start(ctx, step, tokens, meta, preemption, "adopt")
        local: Any = ctx.local  # always a POSIX tier: it places whole files (tiers/)
        try:
            dfd = fsio.open_beneath(prepared.writer.work_fd, [prepared.prefix])
            try:
                for rel, _ in files:
                    linked = local.adopt_file(sfd, dfd, rel)
                    if linked is not None:
                        prepared.linked[f"{prepared.prefix}/{rel}"] = linked
            finally:
                os.close(dfd)
        except OSError as exc:
            prepared.abort()
            raise CkptError(f"adopt(): {src}: {exc.strerror or exc}") from None
        except BaseException:
            prepared.abort()
            raise
    finally:
        os.close(sfd)
    return _submit(ctx, rec, prepared, preempt, t0)


# ---------------------------------------------------------------------- restoring
class DirRestorer(Restorer):
    """The Restorer's choice of step (complete on every rank, agreed, newest that
    verifies, tier by tier) for directory checkpoints: a "load" verifies the rank's part
    and makes sure it is on the local tier; the restored ``state`` is its path."""

    def __init__(self, local: Tier, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.local = local

    def _load(self, tier: Tier, m: Manifest, weights_only: bool) -> Restored:
        t0 = time.monotonic()
        where = tier.where(self.user, self.own_key, m.step)
        fmt = payload_format(m, self.prefix)
        if fmt != DIR_FORMAT:
            raise NotThisFormat(f"{where}: holds {fmt or 'files'}, not a directory checkpoint")
        self.check_data(m, where)
        if tier.name == self.local.name:
            rep = tier.verify(self.user, self.own_key, m.step)
            if not rep.ok:
                raise VerifyError(f"{where}: {rep.problems[0]}")
        else:
            self._fetch(tier, m)
        path = Path(self.local.location(self.user, self.own_key, m.step)) / self.prefix
        if not path.is_dir():
            raise VerifyError(f"{where}: no {self.prefix}/ in the checkpoint")
        return self.restored(tier, m, path, t0, False)

    def _fetch(self, tier: Tier, m: Manifest) -> None:
        """Copy the step from ``tier`` to the local tier (every chunk checked against the
        manifest on the way). A local copy that failed verification is not a checkpoint:
        it is replaced; one of an older, abandoned timeline too (the copy engine's
        ``replace_older``); a sound identical one is kept and nothing is copied."""
        user, key, step = self.user, self.own_key, m.step
        try:
            self.local.manifest_bytes(user, key, step)
            here = True
        except NotFound:
            here = False
        if here and (
            self.is_bad(self.local.name, step) or not self.local.verify(user, key, step).ok
        ):
            self.local.delete(user, key, step)
        try:
            copy_checkpoint(tier, self.local, user, key, step, replace_older=True)
        except (VerifyError, TierError, NotFound):
            raise
        except CkptError as exc:
            raise TierError(f"fetching {tier.where(user, key, step)}: {exc}") from None
        log.info("[ckpt] restore_path: step %d fetched from %s to the local tier", step, tier.name)


def restore_path(restorer: Restorer, shard_key: str) -> Optional[Restored]:
    """:meth:`Checkpointer.restore_path`'s choice and fetch, by ``restorer`` (a
    :class:`DirRestorer` the facade built): the step restored (its ``state`` is the path
    on the local tier), or None when there is none. The facade then takes it as the
    step it restored (schedule, lineage), as after ``restore()``."""
    got = restorer.restore()
    if got is None:
        log.info("[ckpt] restore_path: no directory checkpoint of %s found", shard_key)
        return None
    log.info(
        "[ckpt] restore_path: step=%d tokens=%s from %s: %s",
        got.step,
        got.tokens,
        got.tier,
        got.state,
    )
    return got
