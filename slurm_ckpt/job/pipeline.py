"""The background half of a save: the local writer and the flusher.

After ``save()`` has snapshotted the state into staging buffers, two daemon threads take
over:

* **local write**: the staging buffers are written to the local tier and committed
  atomically; the ledger records it; local retention runs;
* **flush**: selected checkpoints (``retention.flush_every``; always the preemption save
  and, at ``close()``, the newest) go to the warm tier through the one flush engine
  (:class:`~slurm_ckpt.node.flush_engine.Flusher`), in this process.

Backpressure: a save never starts while the previous one is still being written locally
(the staging buffers are in use). A flush that would start while the previous one still
runs is, with ``flush_policy="skip"``, queued in a single slot that a newer checkpoint
takes over (the displaced one is not flushed: the ledger says why); with ``"wait"`` the
caller waits for the flush before snapshotting (:meth:`Pipeline.wait_flushes`).

Failures never kill training: a failed local write or flush is logged, recorded
(``FAILED`` with the reason) and counted; only ``max_consecutive_failures`` failed local
writes in a row set :attr:`Pipeline.fatal`, which the caller raises on its own thread.

A script that ends without ``close()`` must not lose the checkpoint being written:
:meth:`Pipeline.finish_at_exit` (registered with threading's exit hooks) finishes the
local write and leaves open flushes to the epilog.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Set, Tuple

from slurm_ckpt.core.commit import AlreadyCommitted
from slurm_ckpt.core.lease import StaleGeneration
from slurm_ckpt.core.replicas import Verdict
from slurm_ckpt.core.retention import RetentionPolicy
from slurm_ckpt.core.units import format_bytes
from slurm_ckpt.errors import CkptError, TierError
from slurm_ckpt.job.background import yielding
from slurm_ckpt.job.bookkeeping import Bookkeeper, SaveRecord, reason_of
from slurm_ckpt.job.close_progress import MovedBytes
from slurm_ckpt.job.flushing import DEADLINE_MARGIN_S, FlushMethods
from slurm_ckpt.job.lease import SeriesLease
from slurm_ckpt.job.local_prune import prune_local
from slurm_ckpt.job.payload import Direct, Lazy, Prepared, Staged
from slurm_ckpt.job.replicas import ReplicaCheck, agree_before_commit
from slurm_ckpt.job.series import SeriesPlace
from slurm_ckpt.job.shard import Shard, save_meta
from slurm_ckpt.job.signals import Deadline
from slurm_ckpt.job.staging import write_direct
from slurm_ckpt.job.state import STATE_FORMAT
from slurm_ckpt.job.stats import CheckpointStats
from slurm_ckpt.ledger.record import WARM_SLOT, State
from slurm_ckpt.node.flush_engine import LEFT_TO_EPILOG, Flusher, copy_in_process
from slurm_ckpt.tiers.base import Tier, TierWriter

log = logging.getLogger(__name__)

__all__ = [
    "DEADLINE_MARGIN_S",
    "CheckpointFailed",
    "Pipeline",
    "Shard",
]


class CheckpointFailed(CkptError):
    """``max_consecutive_failures`` saves in a row failed: stop rather than train on
    with nothing saved."""


class Pipeline(FlushMethods):
    """The local writer and the flusher of one Checkpointer (see the module docstring)."""

    def __init__(
        self,
        local: Tier,
        warm: Optional[Tier],
        shard: Shard,
        books: Bookkeeper,
        policy: RetentionPolicy,
        deadline: Deadline,
        *,
        flush_policy: str = "skip",
        min_free: int = 0,
        max_consecutive_failures: int = 3,
        lease: Optional[SeriesLease] = None,
    ) -> None:
        self.local, self.warm = local, warm
        #: Bytes written and copied so far, and of the flush running now (close()'s bar).
        self.moved = MovedBytes()
        #: This writer's place in its series: the generation of its lease and the lineage
        #: its saves belong to (every manifest records both); the fence before commits.
        self.series = SeriesPlace(local, warm, shard.user, shard.key, lease)
        self.shard = shard
        self.books = books
        self.policy = policy
        self.deadline = deadline
        self.flush_policy = flush_policy
        self.min_free = min_free
        self.max_consecutive_failures = max_consecutive_failures
        # No warm tier (laptop mode): nothing is selected for a flush, so no flusher.
        self.flusher: Optional[Flusher] = None
        if warm is not None:
            self.flusher = Flusher(
                copy_in_process(local, warm, progress=self.moved.copied),
                books.ledger,
                src=local.name,
                # The ledger's warm-tier slot, whatever the warm tier is (an object store
                # on a site without a PFS): local retention and the hooks read it there.
                dst=WARM_SLOT,
                hand_off_note=LEFT_TO_EPILOG,
            )
        #: Who finishes a flush this process cannot: the save's flush status, and the
        #: words of the log lines (a laptop has no epilog: slurm_ckpt.job.owed).
        self.left_status = LEFT_TO_EPILOG
        self.left_to = "the epilog"
        self.cv = threading.Condition()
        self._stats = CheckpointStats()
        self.fatal: Optional[CkptError] = None
        self.local_job: Optional[SaveRecord] = None
        self.flush_queue: Deque[SaveRecord] = collections.deque()
        self.flush_current: Optional[SaveRecord] = None
        self.newest: Optional[SaveRecord] = None
        self._threads: List[threading.Thread] = []
        self._stop = False
        self._retention_lock = threading.Lock()
        # Event-log lines of the caller's thread (save()), written by the background
        # threads: appending to the log and its summary costs milliseconds of file I/O.
        self._deferred_events: List[Tuple[str, Dict[str, Any]]] = []
        self._flush_rate: Optional[float] = None
        #: Steps this pipeline committed on the local tier (a second save of one of them
        #: replaces this run's own copy, not an older run's).
        self._own_steps: Set[int] = set()
        #: Called with each step committed on the local tier (the partner copy's sender,
        #: :mod:`slurm_ckpt.job.partner`); must return at once.
        self.after_commit: Optional[Callable[[int], None]] = None
        #: Replicas compare their digests before each commit (``replicas=``,
        #: :mod:`slurm_ckpt.job.replicas`; None: they do not), and the verdicts of
        #: suspect steps wait here for the caller's thread (``on_suspect``).
        self.replicas: Optional[ReplicaCheck] = None
        self.suspects: Deque[Verdict] = collections.deque()
        #: The ``last_healthy`` pin, ``(step, when)``, recorded in every later manifest.
        self.last_healthy: Optional[Tuple[int, float]] = None

    # -- state -------------------------------------------------------------------------
    @property
    def stats(self) -> CheckpointStats:
        with self.cv:
            return dataclasses.replace(self._stats)

    def count(self, **add: float) -> None:
        """Add to counters / set last values of the stats (from the caller's thread)."""
        with self.cv:
            for name, value in add.items():
                if name.startswith("last_"):
                    setattr(self._stats, name, value)
                else:
                    setattr(self._stats, name, getattr(self._stats, name) + value)

    def flushes_busy(self) -> bool:
        with self.cv:
            return self.flush_current is not None or bool(self.flush_queue)

    def _log(self, rec: SaveRecord) -> None:
        self.books.log_save(rec, self.cv)

    # -- threads -----------------------------------------------------------------------
    def start(self) -> None:
        if self._threads:
            return
        for name, target in (("ckpt-local", self._local_loop), ("ckpt-flush", self._flush_loop)):
            t = threading.Thread(
                target=yielding(target), name=f"{name}-{self.shard.key}", daemon=True
            )
            t.start()
            self._threads.append(t)

    def wait_for(self, pred: Callable[[], bool], until: Optional[float]) -> bool:
        """Wait (epoch ``until``, None: forever) until ``pred()`` holds under the lock."""
        with self.cv:
            while not pred():
                if until is None:
                    self.cv.wait()
                else:
                    left = until - time.time()
                    if left <= 0:
                        return False
                    self.cv.wait(min(left, 1.0))
            return True

    def idle(self, flush: bool = True) -> bool:
        if self.local_job is not None:
            return False
        return not flush or (self.flush_current is None and not self.flush_queue)

    def wait_local_free(self) -> None:
        """Backpressure: the staging buffers are busy until the previous write ends."""
        with self.cv:
            while self.local_job is not None:
                self.cv.wait()

    def _flush_pending(self, step: int) -> bool:
        """A flush of ``step`` is queued or running (call with ``self.cv`` held)."""
        cur = self.flush_current
        return (cur is not None and cur.step == step) or any(
            r.step == step for r in self.flush_queue
        )

    def wait_flushes(self) -> None:
        with self.cv:
            while self.flush_current is not None or self.flush_queue:
                self.cv.wait()

    def defer_event(self, name: str, info: Dict[str, Any]) -> None:
        """Log ``name`` from a background thread, in order, before the next local event."""
        with self.cv:
            self._deferred_events.append((name, info))

    def log_deferred(self) -> None:
        """Write the deferred event-log lines (background threads, wait(), close())."""
        with self.cv:
            pending, self._deferred_events = self._deferred_events, []
        for name, info in pending:
            self.books.log_event(name, info)

    def submit(self, rec: SaveRecord) -> None:
        """Hand a snapshotted save to the local writer thread."""
        with self.cv:
            self.local_job = rec
            self.cv.notify_all()

    def write_now(self, rec: SaveRecord) -> None:
        """Write a save on the caller's thread (its state did not fit the staging memory)."""
        with self.cv:
            self._stats.sync_writes += 1
            self.local_job = rec
        try:
            self._run_local(rec)
        finally:
            with self.cv:
                self.local_job = None
                self.cv.notify_all()
        self.apply_retention()

    def _local_loop(self) -> None:
        while True:
            with self.cv:
                while not self._stop and (
                    self.local_job is None
                    or self.local_job.local_status != "pending"
                    or self.local_job.synchronous
                ):
                    self.cv.wait()
                if self._stop:
                    return
                rec = self.local_job
            try:
                self._run_local(rec)
            finally:
                with self.cv:
                    self.local_job = None
                    self.cv.notify_all()
            self.apply_retention()

    # -- local write ---------------------------------------------------------------------
    def _check_space(self, nbytes: int) -> None:
        free = self.local.free_bytes()
        if free is not None and free < nbytes + self.min_free:
            raise TierError(
                f"{self.local.where(self.shard.user, self.shard.key)}: not enough space: "
                f"{format_bytes(nbytes)} to write, {format_bytes(free)} free, "
                f"{format_bytes(self.min_free)} to keep free"
            )

    def open_local(self, rec: SaveRecord, state_format: str = STATE_FORMAT) -> TierWriter:
        """A fresh writer of ``rec``'s step on the local tier, with this shard's manifest
        fields (generation and lineage included); the same step of a retired lineage, or of
        an older writer of this one, is replaced; a newer writer's is never."""
        sh = self.shard
        lineage = self.series.save_lineage()
        meta = save_meta(
            sh, rec.meta, reason=rec.reason, state_format=state_format,
            generation=self.series.generation, lineage_meta=lineage.meta(),
            last_healthy=self.last_healthy,
        )  # fmt: skip
        kw = dict(tokens=rec.tokens, job=sh.job, node=sh.node, meta=meta)
        try:
            return self.local.writer(sh.user, sh.key, rec.step, **kw)
        except AlreadyCommitted:
            own = rec.step in self._own_steps
            self.series.may_replace(rec.step, lineage, own)  # StaleGeneration: kept
            if own:
                # The same step saved twice in this run: the newer save replaces ours, once
                # the earlier one's flush (queued or running) is done with the local copy;
                # deleting it under that flush made the flush fail.
                with self.cv:
                    while self._flush_pending(rec.step) and not self._stop:
                        self.cv.wait()
            self.local.delete(sh.user, sh.key, rec.step)
            return self.local.writer(sh.user, sh.key, rec.step, **kw)

    def _write_local(self, rec: SaveRecord) -> None:
        payload = rec.payload
        if isinstance(payload, Prepared):
            try:
                self.series.fence("local")
            except BaseException:
                payload.files.abort()
                raise
            payload.files.commit()  # files already in its writer: hash them, commit
            return
        if not isinstance(payload, (Direct, Staged)):
            raise CkptError(f"step={rec.step}: nothing staged to write ({payload!r})")
        sh = self.shard
        with self.open_local(rec) as w:
            if isinstance(payload, Direct):
                write_direct(w, sh.prefix, payload.index, payload.tensors)
            else:
                items = {f"{sh.prefix}/{n}": v for n, v in payload.views.items()}
                items[f"{sh.prefix}/index.json"] = rec.index_data
                w.write_buffers(items)
            if self.replicas is not None and rec.replicated is not None:
                rec.agreed = True
                self._verdict(
                    agree_before_commit(self.replicas, rec.step, rec.replicated, w, sh.prefix)
                )
            self.series.fence("local")  # raising here aborts the writer: nothing is committed
            w.commit()

    def _run_local(self, rec: SaveRecord) -> None:
        """Phase two of a save (background thread, or the caller's for a sync write)."""
        t0 = time.monotonic()
        try:
            lazy = rec.payload
            if isinstance(lazy, Lazy):  # a lazy snapshot: its copy must be complete first
                rec.payload = Staged(lazy.drain.result())
                with self.cv:
                    self._stats.last_drain_s = lazy.drain.copy_s
            if not isinstance(rec.payload, Prepared):  # a directory's bytes are there already
                self._check_space(rec.nbytes)
            self.log_deferred()
            self.books.emit("local_start", step=rec.step)
            self._write_local(rec)
        except Exception as exc:  # noqa: BLE001 - a failed save must never kill training
            if not isinstance(exc, (CkptError, OSError)):
                log.exception("[ckpt] step=%d: unexpected error in the local write", rec.step)
            if self.replicas is not None and rec.replicated is not None and not rec.agreed:
                self.replicas.exchange(rec.step, None)  # the replicas wait for this rank
            self._local_failed(rec, exc, time.monotonic() - t0)
            return
        finally:
            rec.payload = None
        rec.local_s = time.monotonic() - t0
        rec.local_status = "committed"
        self.moved.wrote(rec.nbytes)
        with self.cv:
            self._own_steps.add(rec.step)
            s = self._stats
            s.committed += 1
            s.consecutive_failures = 0
            s.bytes_written += rec.nbytes
            s.last_local_s = rec.local_s
            s.last_step = rec.step
            self.newest = rec
        self.books.commit_local(rec)
        if self.after_commit is not None:
            self.after_commit(rec.step)
        self.log_deferred()
        self.books.emit("local_done", step=rec.step, local_s=rec.local_s)
        if rec.selected and self.flusher is not None:  # no warm tier: nowhere to flush to
            self.queue_flush(rec)
        else:
            rec.flush_status = "not selected"
            self._log(rec)

    def _verdict(self, v: Verdict) -> None:
        """What the replicas' verdict on a save means here: a suspect step is logged,
        counted, an event (and so a metric), and handed to the caller's thread."""
        if v.skipped:
            log.warning("[ckpt] %s", v.describe())
            self.books.emit("replicas_unchecked", step=v.step, why=v.skipped)
            return
        with self.cv:
            self._stats.replica_checks += 1
        if not v.suspect:
            return
        log.error("[ckpt] %s", v.describe())
        with self.cv:
            self._stats.suspect_steps += 1
            self.suspects.append(v)
        self.books.emit(
            "replicas_suspect", step=v.step, ranks=v.ranks[:64], nodes=v.nodes[:64],
            files=v.files[:64],
        )  # fmt: skip

    def _local_failed(self, rec: SaveRecord, exc: BaseException, seconds: float) -> None:
        self.log_deferred()
        reason = reason_of(exc)
        rec.local_status = "failed"
        rec.local_s = seconds
        rec.error = reason
        with self.cv:
            s = self._stats
            s.failures += 1
            s.consecutive_failures += 1
            s.last_error = reason
            if isinstance(exc, StaleGeneration):
                self.fatal = exc  # taken over: no save of this writer may count again
            elif s.consecutive_failures >= self.max_consecutive_failures:
                self.fatal = CheckpointFailed(
                    f"{s.consecutive_failures} checkpoints failed in a row "
                    f"(job.max_consecutive_failures={self.max_consecutive_failures}); "
                    f"last: {reason}"
                )
        self.books.set_state(rec.step, "local", State.FAILED, reason, code="local_write_failed")
        self.books.emit("local_failed", step=rec.step, error=reason)
        self._log(rec)

    # -- retention -----------------------------------------------------------------------
    def apply_retention(self) -> None:
        """Delete local checkpoints the retention policy no longer needs; never one that
        still waits for (or is in) its flush."""
        if self.books.ledger is None:
            return
        with self._retention_lock:
            try:
                prune_local(
                    self.local, self.shard.user, self.shard.key, self.books, self.policy,
                    self._busy_steps,
                )  # fmt: skip
            except (CkptError, OSError) as exc:
                log.warning("[ckpt] local retention failed: %s", exc)

    def _busy_steps(self) -> Set[int]:
        """Steps retention must keep: queued, flushing or being written."""
        with self.cv:
            busy = {r.step for r in self.flush_queue}
            if self.flush_current is not None:
                busy.add(self.flush_current.step)
            if self.local_job is not None:
                busy.add(self.local_job.step)
        return busy

    # -- the end -----------------------------------------------------------------------
    def finish(self, until: Optional[float]) -> bool:
        """``close()``'s part: the local write is always awaited (it is the checkpoint that
        survives a kill); the newest checkpoint is flushed if it was not; flushes are
        awaited until ``until`` (epoch; None: no limit) and what is still open then is
        left to the epilog. Stops the threads; returns whether every flush finished."""
        self.wait_for(lambda: self.local_job is None, None)
        self.log_deferred()
        newest = self.newest
        if (
            self.flusher is not None
            and newest is not None
            and newest.flush_status in ("not selected", "skipped")
        ):
            newest.forced = newest.selected = True
            self.books.set_state(newest.step, WARM_SLOT, State.FLUSH_PENDING, forced=True)
            self.queue_flush(newest)
        done = self.wait_for(lambda: self.flush_current is None and not self.flush_queue, until)
        if not done:
            with self.cv:
                open_jobs = list(self.flush_queue)
                self.flush_queue.clear()
                if self.flush_current is not None:
                    open_jobs.append(self.flush_current)
            for rec in open_jobs:
                if rec.flush_status in ("queued", "flushing"):
                    self.leave_to_epilog(rec, self.deadline.time_left())
        with self.cv:
            self._stop = True
            self.cv.notify_all()
        for t in self._threads:
            t.join(timeout=None if done else 0.1)
        return done

    def finish_at_exit(self) -> None:
        """At interpreter exit without close(): finish the local write (the background
        threads are daemons and die with the interpreter); flushes are left to the
        epilog/stager, which find them in the ledger as FLUSH_PENDING."""
        with self.cv:
            writing = self.local_job is not None
        if writing:
            log.warning("[ckpt] exiting without close(): finishing the local write")
        self.wait_for(lambda: self.idle(flush=False), None)
        self.log_deferred()
        with self.cv:
            owed = list(self.flush_queue)
            self.flush_queue.clear()
            current = self.flush_current
            self._stop = True
            self.cv.notify_all()
        if self.flusher is not None:
            self.flusher.hand_off([(self.shard.user, self.shard.key, r.step) for r in owed])
        steps = [r.step for r in owed]
        if current is not None:
            steps.append(current.step)  # in flight: killed with the interpreter (FLUSHING)
        if steps:
            log.warning(
                "[ckpt] exiting without close(): flush of step(s) %s left to %s",
                steps,
                self.left_to,
            )
