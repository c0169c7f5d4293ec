"""The flush half of the pipeline: selected checkpoints to the warm tier, one at a time.

:class:`~slurm_ckpt.job.pipeline.Pipeline` takes these methods from
:class:`FlushMethods` (a mixin): the flush queue and its
policy (``"skip"``: a newer checkpoint takes the queued one's place), the flusher thread,
the estimate of a flush's length, and what is left to the epilog when the job ends
first. Why apart: the local writer and the flusher are two threads with two concerns -
a save that survives a kill, and a copy that survives the node - sharing only the lock,
the stats and the records (``self`` is the Pipeline).
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Callable, Deque, List, Optional, Tuple

from slurm_ckpt.core.lease import StaleGeneration
from slurm_ckpt.errors import CkptError
from slurm_ckpt.job.bookkeeping import SaveRecord

log = logging.getLogger(__name__)

__all__ = ["DEADLINE_MARGIN_S", "FlushMethods"]

#: Work planned to end this long before the deadline (clock skew, process teardown).
DEADLINE_MARGIN_S = 5.0


class FlushMethods:
    """The Pipeline's flusher (see the module docstring)."""

    # Provided by the Pipeline (declared for readers and type checkers).
    _flush_rate: Optional[float]
    _stats: Any
    books: Any
    cv: Any
    deadline: Any
    fatal: Optional[CkptError]
    flush_current: Optional[SaveRecord]
    flush_policy: str
    flush_queue: Deque[SaveRecord]
    flusher: Any
    left_status: str
    left_to: str
    local_job: Optional[SaveRecord]
    moved: Any
    series: Any
    shard: Any
    warm: Any
    _stop: bool

    _log: Callable[[SaveRecord], None]
    apply_retention: Callable[[], None]

    # -- flush ---------------------------------------------------------------------------
    def queue_flush(self, rec: SaveRecord) -> None:
        skipped: List[SaveRecord] = []
        with self.cv:
            if self.flush_policy == "skip" and (self.flush_current or self.flush_queue):
                keep: Deque[SaveRecord] = collections.deque()
                for old in self.flush_queue:
                    (keep if old.forced else skipped).append(old)
                self.flush_queue = keep
            rec.flush_status = "queued"
            self.flush_queue.append(rec)
            for old in skipped:
                old.flush_status = "skipped"
                self._stats.flush_skipped += 1
            self.cv.notify_all()
        for old in skipped:
            self.books.deselect(old.step, f"flush skipped: step {rec.step} is newer")
            self.books.emit("flush_skipped", step=old.step, newer=rec.step)
            self._log(old)
        self.books.emit("flush_queued", step=rec.step)

    def _flush_loop(self) -> None:
        while True:
            with self.cv:
                while not self.flush_queue and not self._stop:
                    self.cv.wait()
                if not self.flush_queue:
                    return
                rec = self.flush_queue.popleft()
                self.flush_current = rec
                rec.flush_status = "flushing"
            try:
                self._run_flush(rec)
            except Exception:  # noqa: BLE001 - keep the flusher alive whatever happens
                log.exception("[ckpt] step=%d: unexpected error in the flush", rec.step)
            finally:
                with self.cv:
                    self.flush_current = None
                    self.cv.notify_all()
            self.apply_retention()

    def estimate_flush_s(self, nbytes: int) -> float:
        if self._flush_rate:
            return nbytes / self._flush_rate
        if self.warm is not None and self.warm.limiter is not None:
            return nbytes / self.warm.limiter.rate
        return 0.0

    def progress_counts(self) -> Tuple[int, int]:
        """``(moved, owed)``: bytes written and copied since the start (a counter), and
        bytes still to write or copy now: the pending local write, the rest of the flush
        running, the queued ones (what close()'s progress shows)."""
        with self.cv:
            owed = sum(r.nbytes for r in self.flush_queue)
            if self.local_job is not None and self.local_job.local_status == "pending":
                owed += self.local_job.nbytes
            current = self.flush_current
        return self.moved.counts(owed, None if current is None else current.nbytes)

    def _run_flush(self, rec: SaveRecord) -> None:
        self.moved.flush_starts()
        left = self.deadline.time_left()
        if left is not None and left - DEADLINE_MARGIN_S < self.estimate_flush_s(rec.nbytes):
            self.leave_to_epilog(rec, left)
            return
        assert self.flusher is not None  # only selected saves get here (a warm tier exists)
        try:
            self.series.fence("warm")
        except StaleGeneration as exc:
            with self.cv:
                self.fatal = exc
            self._flush_failed(rec, str(exc))
            return
        except (CkptError, OSError) as exc:
            log.warning("[ckpt] step=%d: warm-tier lease not readable: %s", rec.step, exc)
        self.books.emit("flush_start", step=rec.step)
        res = self.flusher.flush_one((self.shard.user, self.shard.key, rec.step), nbytes=rec.nbytes)
        rec.flush_s = res.seconds
        if not res.ok:
            self._flush_failed(rec, res.error or res.status)
            return
        if res.copied and res.seconds > 0:
            self._flush_rate = res.copied / res.seconds
        with self.cv:
            rec.flush_status = "done"
            s = self._stats
            s.flushes += 1
            s.bytes_flushed += res.copied
            s.last_flush_s = rec.flush_s
            s.last_flushed_step = rec.step
        # Bytes and tier: the operator's throughput panel sums them (flushed_bytes_total).
        self.books.emit(
            "flush_done",
            step=rec.step,
            flush_s=rec.flush_s,
            nbytes=res.copied,
            tier=self.warm.name if self.warm is not None else "",
        )
        self._log(rec)

    def _flush_failed(self, rec: SaveRecord, reason: str) -> None:
        rec.error = reason
        with self.cv:
            rec.flush_status = "failed"
            self._stats.flush_failures += 1
            self._stats.last_error = reason
        self.books.emit("flush_failed", step=rec.step, error=reason)
        self._log(rec)

    def leave_to_epilog(self, rec: SaveRecord, left: Optional[float]) -> None:
        with self.cv:
            rec.flush_status = self.left_status
            self._stats.left_to_epilog += 1
        if self.flusher is not None:
            self.flusher.hand_off([(self.shard.user, self.shard.key, rec.step)])
        log.warning(
            "[ckpt] step=%d: %s left before the job ends, flush needs ~%.1fs: left to %s",
            rec.step,
            "unknown time" if left is None else f"{left:.1f}s",
            self.estimate_flush_s(rec.nbytes),
            self.left_to,
        )
        self.books.emit("flush_left_to_epilog", step=rec.step)
        self._log(rec)
