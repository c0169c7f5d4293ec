"""How a Checkpointer waits and ends: its background work, ``close()``, the requeue.

The :class:`~slurm_ckpt.job.checkpointer.Checkpointer` facade builds a :class:`Closing`
and delegates these methods to it: ``wait_snapshot``
(the lazy snapshot's copy), ``wait``, ``close`` and the requeue that a save after the
time-limit signal asks for. Why apart: the end of a run is one concept - how long the
flushes are awaited after a preemption signal, what is left to the epilog, what is
published, when the job is requeued - and the facade stays a facade. :class:`Closing`
acts on the typed :class:`~slurm_ckpt.job.context.JobContext` and the few parts of the
run it ends (the signal flag, the staging area, the partner link, the RAM tier, the
restore side and the DCP part series), never on the Checkpointer.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable, Optional, Tuple

from slurm_ckpt.errors import EXIT_INTERRUPTED
from slurm_ckpt.job.close_progress import WAIT_NOTE_S, CloseProgress
from slurm_ckpt.job.context import JobContext
from slurm_ckpt.job.lazy import Drain
from slurm_ckpt.job.owed import no_epilog
from slurm_ckpt.job.partner import PartnerLink
from slurm_ckpt.job.pipeline import DEADLINE_MARGIN_S
from slurm_ckpt.job.ram_methods import with_ram_stats
from slurm_ckpt.job.ram_replica import RamCopies
from slurm_ckpt.job.replicas import tell_suspects
from slurm_ckpt.job.restoring import Restoring
from slurm_ckpt.job.seams import Seams
from slurm_ckpt.job.signals import SignalFlag
from slurm_ckpt.job.staging import StagingArea
from slurm_ckpt.job.stats import CheckpointStats
from slurm_ckpt.slurm.requeue import requeue_reason

log = logging.getLogger(__name__)

__all__ = ["WAIT_NOTE_S", "Closing", "finish_at_exit"]


class Closing:
    """The Checkpointer's waits and its end (see the module docstring)."""

    def __init__(
        self,
        ctx: JobContext,
        *,
        flag: SignalFlag,
        staging: StagingArea,
        restoring: Restoring,
        seams: Seams,
        partner: Optional[PartnerLink],
        ram: Optional[RamCopies],
        on_suspect: Any,
        requeue: bool,
        requeue_fn: Callable[[str], Any],
        job_state_fn: Optional[Callable[[], Optional[str]]],
    ) -> None:
        self._ctx = ctx
        self._flag = flag
        self._staging = staging
        self._restoring = restoring
        self._seams = seams
        self._partner = partner
        self._ram = ram
        self._on_suspect = on_suspect
        self._requeue = requeue
        self._requeue_fn = requeue_fn
        self._job_state_fn = job_state_fn
        self._requeued = False
        #: The newest lazy snapshot's copy still in progress (None: none pending); the
        #: Checkpointer's ``save()`` sets it.
        self.drain: Optional[Drain] = None

    def stats(self) -> CheckpointStats:
        """The run's counters, the RAM tier's included (``Checkpointer.stats``)."""
        return with_ram_stats(self._ctx.pipeline.stats, self._ram)

    def wait_snapshot(self) -> float:
        """Block until the newest lazy snapshot is copied (at once when none is pending);
        returns the seconds waited. Call it before writing parameters or optimizer state
        in place outside ``optimizer.step()`` (e.g. through ``p.data``)."""
        drain = self.drain
        if drain is None:
            return 0.0
        waited = drain.wait()
        if waited > 0:
            self._ctx.pipeline.count(snapshot_waits=1, snapshot_wait_s=waited)
        if drain.done:
            self.drain = None
        return waited

    def wait(self, flush: bool = True, timeout: Optional[float] = None) -> bool:
        """Block until the local write (and, with ``flush``, every queued flush) is done.
        Returns False on timeout."""
        until = None if timeout is None else time.time() + timeout
        done = self._ctx.pipeline.wait_for(lambda: self._ctx.pipeline.idle(flush), until)
        self._ctx.pipeline.log_deferred()
        if self._ctx.pipeline.suspects:
            tell_suspects(self._ctx.pipeline.suspects, self._on_suspect)
        return done

    def close(self) -> CheckpointStats:
        """Wait for the local write and the PFS flushes, flush the newest checkpoint if it
        was not, requeue if asked, and put the signal handlers back.

        After a preemption signal the wait for the flushes ends at the job's deadline
        (minus a margin): flushes still open are left to the epilog (ledger:
        FLUSH_PENDING). The local write is always awaited. Never raises for storage
        problems.

        A Ctrl-C while it waits (there is no step boundary left to save at) ends the
        program at once, cleanly: one line, exit status 130, no traceback. The
        checkpoints committed so far stay; what was being written or copied is debris
        that the next start sweeps (standalone) or the epilog takes over (SLURM)."""
        if self._ctx.closed:
            return self.stats()
        self._flag.interrupt_now = True
        self._ctx.closed = True
        try:
            self._close()
        except KeyboardInterrupt:
            self._interrupted()
        if self._ctx.pipeline.suspects:  # the last saves' verdicts came while closing
            tell_suspects(self._ctx.pipeline.suspects, self._on_suspect)
        return self.stats()

    def _close(self) -> None:
        restorer = self._restoring.restorer
        if restorer is not None:
            restorer.cancel()  # a weights-first restore whose rest was never asked for
        until = None
        if self._flag.received is not None or self._ctx.schedule.preempt_saved:
            d = self._ctx.deadline.deadline()
            until = None if d is None else d - DEADLINE_MARGIN_S
        # A wait longer than a second says so - a bar on a terminal, a log line
        # otherwise - and says when it ended: a silent close() of 10 s reads as a hang.
        with CloseProgress(self._close_owed()):
            dcp = self._seams.dcp  # DCP parts (dcp_writer): picked up and flushed
            if dcp is not None:
                dcp.finish(until)
            self._ctx.pipeline.finish(until)
        if self._ram is not None:
            self._ram.close(30.0 if until is None else max(0.0, until - time.time()))
        if self._partner is not None:
            self._partner.close(60.0 if until is None else max(0.0, until - time.time()))
        self._ctx.lease.release()  # the next writer of the series takes over at once
        self._maybe_requeue()
        self._flag.uninstall()
        self._staging.close()
        if self._ctx.config.tiers.pfs is not None:  # node status lives on the PFS (none: skipped)
            self._ctx.books.publish(self._ctx.config.tiers.pfs.root)

    def _close_owed(self) -> Callable[[], Tuple[int, int]]:
        """``() -> (done, total)`` bytes of close()'s wait, for its progress bar."""
        start, _ = self._ctx.pipeline.progress_counts()

        def owed() -> Tuple[int, int]:
            moved, left = self._ctx.pipeline.progress_counts()
            return moved - start, moved - start + left

        return owed

    def _interrupted(self) -> None:
        """Ctrl-C inside close(): say what is kept, and end without a traceback."""
        newest = self._ctx.pipeline.newest
        kept = "nothing committed" if newest is None else f"step {newest.step} committed"
        # A laptop has no epilog: never name one there (issue 31).
        who = "the next start" if no_epilog() else "the epilog (or the next start)"
        log.warning(
            "[ckpt] interrupted while closing: %s on the local tier; an unfinished write "
            "or copy is left for %s to clean up",
            kept,
            who,
        )
        with contextlib.suppress(BaseException):
            self._flag.uninstall()
        raise SystemExit(EXIT_INTERRUPTED)

    def _maybe_requeue(self) -> None:
        if not self._requeue or not self._ctx.schedule.preempt_saved or self._requeued:
            return
        cause: Optional[str] = None
        if self._job_state_fn is not None:
            try:
                cause = self._job_state_fn()
            except Exception as exc:  # noqa: BLE001 - never fail close() on a provider
                log.warning("[ckpt] job state provider failed: %s", exc)
        why = requeue_reason(
            cause,
            detail=f"checkpoint of step {self._ctx.schedule.ref_step} saved after signal "
            f"{self._flag.received}, job state {cause}",
        )
        if why is None:
            log.info(
                "[ckpt] not requeueing: job state is %s (only a time limit is requeued here; "
                "SLURM requeues preempted jobs itself)",
                cause or "unknown",
            )
            return
        self._requeued = True
        try:
            self._requeue_fn(why)
        except Exception as exc:  # noqa: BLE001
            log.error("[ckpt] requeue failed: %s", exc)
        self._ctx.books.emit("requeue", reason=why)


def finish_at_exit(ctx: JobContext) -> None:
    """Register the end of a Checkpointer (its context ``ctx``) at interpreter exit: a
    script that ends without close() must not lose the checkpoint being written. Only a
    weak reference is kept: the context lives as long as its Checkpointer.

    threading's own exit hooks run (in reverse order) *before* concurrent.futures
    refuses new work at shutdown, which the tier writer needs; plain atexit is too late.
    The private hook exists since Python 3.9; fall back to atexit otherwise."""
    hook = functools.partial(_finish_at_exit, weakref.ref(ctx), os.getpid())
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise RuntimeError("no threading._register_atexit")
        register(hook)
    except RuntimeError:  # pragma: no cover - other interpreters
        atexit.register(hook)


def _finish_at_exit(ref: Callable[[], Optional[JobContext]], pid: int) -> None:
    """At interpreter exit without close(): the pipeline finishes the local write. A
    no-op after close(), and in a forked child (a DataLoader worker inherits the hook but
    not the pipeline's threads: it would wait for a write that no thread of its own does,
    until its parent kills it, and hand the parent's flushes off a second time)."""
    ctx = ref()
    if ctx is not None and not ctx.closed and os.getpid() == pid:
        ctx.pipeline.finish_at_exit()
        ctx.lease.release()
