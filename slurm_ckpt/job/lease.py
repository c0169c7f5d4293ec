"""One writer per checkpoint series: the lease a Checkpointer holds on its key.

Why: two processes with the same tiers and key both "succeed" at every save, and the
series silently becomes a mix of two runs. A Checkpointer therefore takes a lease at
construction and keeps it until ``close()`` (or its process dies):

* **local tier** (``<local>/<user>/<key>/``): ``.lock-lease`` is flocked for the
  writer's whole life; ``.lock-lease.json`` records the holder (node, pid and its start
  time, job, generation, since). Updates happen under a short flock of
  ``.lock-lease-update``, so two writers starting at once decide one after the other;
* **this process**: a registry of the leases held, so a second Checkpointer on the same
  key in the same process is flagged too (the pid is alive: it is ours);
* **warm tier**: the same record, with a heartbeat refreshed every
  :data:`HEARTBEAT_S` seconds, so that a writer on another node sharing the warm tier
  sees the holder.

A second writer gets one line naming the holder and the ways out (another key, or
``takeover=True`` once the holder is known dead) - unless the holder is gone: released
by ``close()``; its pid dead on this node; on another node with the same SLURM job id (a
requeued or relaunched job); or on another node with a heartbeat older than
:data:`STALE_AFTER_S`. Each acquisition takes the next **generation**: one more than any
recorded on the local or warm tier. Before each commit the pipeline asks :meth:`check`
with the tier it commits to; a newer generation there means this writer was taken over
(:class:`~slurm_ckpt.core.lease.StaleGeneration`), and it stops committing. A local
commit checks the warm tier's record too: a node that was partitioned and replaced by a
spare still holds its own, older record on its own disk.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import gc
import logging
import os
import threading
import time
import weakref
from typing import Callable, Dict, Optional, Tuple

from slurm_ckpt.core import fsio
from slurm_ckpt.core.lease import (
    LeaseRecord,
    StaleGeneration,
    check_generation,
    holder_text,
)
from slurm_ckpt.errors import CkptError
from slurm_ckpt.tiers.base import Tier

log = logging.getLogger(__name__)

__all__ = ["HEARTBEAT_S", "STALE_AFTER_S", "SeriesBusy", "SeriesLease", "pid_alive"]

#: How often a holder refreshes its warm-tier record.
HEARTBEAT_S = 60.0
#: A warm-tier record of another node whose heartbeat is older than this is a dead
#: holder's (its node died or lost the warm tier): another writer may take over.
STALE_AFTER_S = 600.0
_HOLD = ".lock-lease"
_UPDATE = ".lock-lease-update"

_registry_lock = threading.RLock()  # a finalizer may release inside acquire's section
#: Leases held in this process: (local root, user, key) -> the lease.
_held: Dict[Tuple[str, str, str], SeriesLease] = {}


#: SLURM job states after which a job's processes are gone.
_ENDED = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
    }
)


def _job_ended(job: str) -> bool:
    """True only when SLURM says the holder's job has ended (a job SLURM no longer
    knows, or no SLURM at all, is no verdict: the heartbeat rule decides then)."""
    try:
        from slurm_ckpt.slurm.client import SlurmClient

        state, _reason = SlurmClient(timeout=5.0).job_state(job)
    except (CkptError, OSError, ValueError):
        return False
    return state.split()[0].rstrip("+") in _ENDED


class SeriesBusy(CkptError):
    """Another live writer holds the series."""


#: Longest wait for another writer's update of the record (it takes milliseconds; a
#: process stopped in the middle of one must not hang this one forever).
UPDATE_WAIT_S = 30.0


def _lock_update(fd: int, key: str) -> None:
    """Take the short update lock, waiting at most :data:`UPDATE_WAIT_S`."""
    until = time.monotonic() + UPDATE_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > until:
                raise SeriesBusy(
                    f"key {key}: another process has been updating its lease record for "
                    f"{UPDATE_WAIT_S:.0f}s (stopped?): try again, or use another key"
                ) from None
            time.sleep(0.05)


def _start_time(pid: int) -> Optional[int]:
    """A process's start time (clock ticks since boot), None when unknown; ``-1`` for a
    zombie (dead, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[:1] == [b"Z"] or fields[:1] == [b"X"]:
        return -1
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def pid_alive(pid: int, start: Optional[int] = None) -> bool:
    """Whether process ``pid`` (started at ``start``, when known) runs on this node."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    now = _start_time(pid)
    if now == -1:
        return False
    return start is None or now is None or now == start


def _open_lock(kfd: int, name: str) -> int:
    fd = os.open(
        name,
        os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
        0o600,
        dir_fd=kfd,
    )
    try:
        fsio.check_file(fd, name)
    except BaseException:
        os.close(fd)
        raise
    return fd


class SeriesLease:
    """The lease of one writer on one series (see the module docstring)."""

    def __init__(
        self,
        local: Tier,
        warm: Optional[Tier],
        user: str,
        key: str,
        node: str,
        *,
        job: Optional[str] = None,
        takeover: bool = False,
    ) -> None:
        self.local, self.warm = local, warm
        self.user, self.key, self.node = user, key, node
        self.job, self.takeover = job, takeover
        self.ident = (os.path.realpath(getattr(local, "root", local.name)), user, key)
        self.generation = 0
        self.record: Optional[LeaseRecord] = None
        #: Set once another writer is seen to hold a newer generation.
        self.lost: Optional[StaleGeneration] = None
        self.released = False
        self._hold_fd: Optional[int] = None
        self._stop = threading.Event()
        self._beat: Optional[threading.Thread] = None
        self._owner: Optional[Callable[[], object]] = None
        self._pid = os.getpid()
        #: Asked before every commit too; raises StaleGeneration when this writer was
        #: replaced otherwise (in-job recovery's membership, job/recovery.py).
        self.guard: Optional[Callable[[], None]] = None

    # -- taking it -----------------------------------------------------------------------
    def ensure(self) -> None:
        """Take the lease now unless held (a replica rank's first save)."""
        if self.record is None:
            if self.released:
                raise CkptError(f"key {self.key}: this Checkpointer is closed")
            self.acquire()

    def owned_by(self, owner: object) -> SeriesLease:
        """Tie the lease to its Checkpointer: when that is garbage collected without
        ``close()`` (``Checkpointer(...).restore()`` and dropped), the lease goes with it."""
        self._owner = weakref.ref(owner)
        weakref.finalize(owner, self.release)
        return self

    @property
    def orphaned(self) -> bool:
        """True when the Checkpointer this lease was tied to (:meth:`owned_by`) is gone
        but its finalizer has not released the lease yet: another Checkpointer of this
        process may then take the series over instead of waiting for a dead holder."""
        owner = self._owner
        return owner is not None and owner() is None

    def _holder_here(self) -> Optional[SeriesLease]:
        """The live lease of another Checkpointer of this process on this series."""
        with _registry_lock:
            other = _held.get(self.ident)
        if other is None or other.released or other.record is None or other is self:
            return None
        return None if other.orphaned else other

    def acquire(self) -> SeriesLease:
        """Take the lease, or raise :class:`SeriesBusy` (one line) when a live writer
        holds it and ``takeover`` is not given."""
        if self._holder_here() is not None:
            gc.collect()  # a dropped, unclosed Checkpointer in a reference cycle lets go now
        with _registry_lock:
            other = self._holder_here()
            if other is not None and other.record is not None:
                if not self.takeover:
                    raise SeriesBusy(
                        self._busy(other.record, " (another Checkpointer of this process)")
                    )
                log.warning(
                    "[ckpt] key %s: taking over from another Checkpointer of this process (%s)",
                    self.key,
                    holder_text(other.record),
                )
            with self.local.key_fd(self.user, self.key, create=True) as kfd:  # type: ignore[attr-defined]
                self._acquire_in(kfd)
            _held[self.ident] = self
        if self.warm is not None:
            self._beat = threading.Thread(
                target=self._heartbeat, name=f"ckpt-lease-{self.key}", daemon=True
            )
            self._beat.start()
        return self

    def _acquire_in(self, kfd: int) -> None:
        hold = _open_lock(kfd, _HOLD)
        update = _open_lock(kfd, _UPDATE)
        try:
            _lock_update(update, self.key)
            try:
                fcntl.flock(hold, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
            local_rec = self._read_local()
            warm_rec = self._read_warm(quiet=True)
            for rec in (local_rec, warm_rec):
                if rec is not None and self._alive(rec):
                    if not self.takeover:
                        raise SeriesBusy(self._busy(rec, ""))
                    log.warning(
                        "[ckpt] key %s: taking over (takeover=True) from %s",
                        self.key,
                        holder_text(rec),
                    )
            gens = [r.generation for r in (local_rec, warm_rec) if r is not None]
            self.generation = max(gens, default=0) + 1
            now = time.time()
            self.record = LeaseRecord(
                key=self.key,
                node=self.node,
                pid=os.getpid(),
                generation=self.generation,
                since=now,
                heartbeat=now,
                job=self.job,
                pid_start=_start_time(os.getpid()),
            )
            self._write_local(self.record)
            self._write_warm(self.record)
        except BaseException:
            os.close(hold)
            raise
        finally:
            os.close(update)  # unlocks
        self._hold_fd = hold
        log.info("[ckpt] key %s: lease taken, generation %d", self.key, self.generation)

    def _alive(self, rec: LeaseRecord) -> bool:
        """Whether ``rec`` names a writer that still holds the series."""
        if rec.released:
            return False
        if rec.node == self.node:
            if rec.pid == os.getpid():
                return False  # this process: its live Checkpointers are in the registry
            return pid_alive(rec.pid, rec.pid_start)
        if self.job is not None and rec.job == self.job:
            return False  # the same job, requeued or relaunched on another node
        if self.job is not None and rec.job and _job_ended(rec.job):
            return False  # its job is over (a resubmit after a crash or a cancel)
        return time.time() - rec.heartbeat < STALE_AFTER_S

    def _busy(self, rec: LeaseRecord, extra: str) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(rec.since))
        return (
            f"key {self.key} is being written by pid {rec.pid} on node {rec.node} since "
            f"{since}{extra}: use another key, or pass takeover=True once that writer is "
            "known dead"
        )

    # -- records -------------------------------------------------------------------------
    def _read_local(self) -> Optional[LeaseRecord]:
        data = self.local.read_lease(self.user, self.key)  # type: ignore[attr-defined]
        return None if data is None else LeaseRecord.from_bytes(data)

    def _write_local(self, rec: LeaseRecord) -> None:
        self.local.write_lease(self.user, self.key, rec.to_bytes())  # type: ignore[attr-defined]

    def _read_warm(self, quiet: bool = False) -> Optional[LeaseRecord]:
        read = getattr(self.warm, "read_lease", None)
        if read is None:
            return None
        try:
            data = read(self.user, self.key)
        except (CkptError, OSError) as exc:
            if not quiet:
                raise
            log.warning("[ckpt] key %s: warm-tier lease not readable: %s", self.key, exc)
            return None
        return None if data is None else LeaseRecord.from_bytes(data)

    def _write_warm(self, rec: LeaseRecord) -> None:
        write = getattr(self.warm, "write_lease", None)
        if write is None:
            return
        try:
            write(self.user, self.key, rec.to_bytes())
        except (CkptError, OSError) as exc:
            log.warning("[ckpt] key %s: warm-tier lease not written: %s", self.key, exc)

    # -- the fence -----------------------------------------------------------------------
    def fence(self) -> Optional[Tuple[str, int]]:
        """``(series key, generation)`` for a writer that commits outside this process's
        pipeline (DCP's save, maybe in another process): None without a lease taken."""
        return None if self.record is None else (self.key, self.generation)

    def check(self, tier: str) -> None:
        """Before a commit to ``tier`` (``"local"`` or ``"warm"``): raise
        :class:`StaleGeneration` when a newer writer holds the series there."""
        if self.lost is not None:
            raise self.lost
        if self.record is None:
            raise CkptError(f"key {self.key}: no lease taken: this writer may not commit")
        if self.guard is not None:
            try:
                self.guard()
            except StaleGeneration as exc:
                self.lost = exc
                raise
        if tier == "warm":
            rec, where = self._read_warm(), self.warm.where(self.user, self.key)  # type: ignore[union-attr]
        else:
            rec, where = self._read_local(), self.local.where(self.user, self.key)
        try:
            check_generation(rec, self.generation, where)
            if tier != "warm" and self.warm is not None:
                # A node that was partitioned and replaced (a spare's rank took the series
                # over) still finds its own record on its own disk: the newer generation is
                # on the warm tier, which every node shares. Unreadable: the local check
                # stands (the flush is fenced on the warm tier itself).
                warm = self._read_warm(quiet=True)
                check_generation(warm, self.generation, self.warm.where(self.user, self.key))
        except StaleGeneration as exc:
            self.lost = exc
            raise

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.check("warm")
            except StaleGeneration as exc:
                log.error("[ckpt] %s", exc)
                return
            except (CkptError, OSError) as exc:
                log.warning("[ckpt] key %s: warm-tier lease not readable: %s", self.key, exc)
                continue
            if self.record is not None:
                self._write_warm(self.record.beat())

    # -- giving it back ------------------------------------------------------------------
    def release(self) -> None:
        """Mark the records released (when still ours) and drop the flock: the next
        writer of the series takes over at once, on any node."""
        if self.released or os.getpid() != self._pid:
            return  # a forked child (a DataLoader worker) never gives its parent's lease back
        self.released = True
        self._stop.set()
        beat = self._beat
        if beat is not None and beat is not threading.current_thread():
            beat.join(5.0)  # it wakes at once; bounded: a PFS write may hang
        with _registry_lock:
            if _held.get(self.ident) is self:
                del _held[self.ident]
        if self.record is None:
            return
        done = self.record.beat()
        try:
            with self.local.key_fd(self.user, self.key, create=True) as kfd:  # type: ignore[attr-defined]
                update = _open_lock(kfd, _UPDATE)
                try:
                    _lock_update(update, self.key)
                    rec = self._read_local()
                    if rec is not None and rec.generation == self.generation:
                        self._write_local(_released(done))
                    if self.lost is None:
                        warm = self._read_warm(quiet=True)
                        if warm is not None and warm.generation == self.generation:
                            self._write_warm(_released(done))
                finally:
                    os.close(update)
        except (CkptError, OSError) as exc:
            log.warning("[ckpt] key %s: lease not released cleanly: %s", self.key, exc)
        finally:
            if self._hold_fd is not None:
                os.close(self._hold_fd)
                self._hold_fd = None


def _released(rec: LeaseRecord) -> LeaseRecord:
    return dataclasses.replace(rec, released=True)
