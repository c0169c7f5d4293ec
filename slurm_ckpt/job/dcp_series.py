"""One rank's torch.distributed.checkpoint parts as a checkpoint series of its own.

A DCP save (:mod:`slurm_ckpt.dcp.storage`) writes each rank's bytes as a *part*: one
committed checkpoint of the series ``<key>.dcp.rank<NNNNN>`` on that rank's local tier (rank 0's
part also holds the step's global metadata and is committed last). This module is the
part of a :class:`~slurm_ckpt.job.checkpointer.Checkpointer` that takes such a part from
"committed on the local tier" to where every other checkpoint goes: the ledger, the
event log, local retention and the warm tier through the one flush engine (a second
:class:`~slurm_ckpt.job.pipeline.Pipeline` over the part series; its local writer stays
idle, since DCP wrote the bytes).

Who notices the commit: in DCP's thread mode (and plain ``dcp.save``) the writer runs in
this process and calls :func:`notify_committed`; in process mode it runs in DCP's child,
where nothing of this process exists, so the parent finds the commit on the local tier
when it next asks (the next ``dcp_writer()``, ``wait()``-free ``close()``). What no one
noticed (the job ended first) the epilog and stager flush, like any checkpoint.

No torch here: this is the job layer (the torch side is the package :mod:`slurm_ckpt.dcp`).
It takes what it needs of the Checkpointer as a :class:`SeriesHost` (public fields only),
the event callback and the job's deadline, not the facade itself.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
import weakref
from typing import Any, Callable, Dict, Optional, Protocol

from slurm_ckpt.core.config import Config
from slurm_ckpt.core.retention import RetentionPolicy, selected_for_flush
from slurm_ckpt.errors import CkptError, NotFound, TierError, VerifyError
from slurm_ckpt.job.bookkeeping import Bookkeeper, SaveRecord
from slurm_ckpt.job.pipeline import Pipeline, Shard
from slurm_ckpt.job.signals import Deadline
from slurm_ckpt.tiers.base import Tier

log = logging.getLogger(__name__)

__all__ = ["DcpSeries", "notify_committed", "part_key"]

#: Live series of this process, by token; DCP's process-mode child has none.
_LIVE: Dict[str, weakref.ref[DcpSeries]] = {}
_LIVE_LOCK = threading.Lock()


def part_key(key: str, rank: int) -> str:
    """The series of one rank's DCP parts (world size independent: the metadata says
    how many parts a step has)."""
    return f"{key}.dcp.rank{rank:05d}"


def notify_committed(token: Optional[str], step: int) -> None:
    """Called by the writer after it committed a part: flush it now when the series
    lives in this process (thread mode); a no-op elsewhere (process mode's child)."""
    if not token:
        return
    with _LIVE_LOCK:
        ref = _LIVE.get(token)
    series = ref() if ref is not None else None
    if series is not None:
        series.committed(step)


class SeriesHost(Protocol):
    """What a part series reads of the rank that owns it (the Checkpointer, or any
    object with these public fields): identity, tiers, config and policies."""

    config: Config
    user: str
    key: str
    rank: int
    world_size: int
    job: Optional[str]
    node: str
    local: Tier
    warm: Optional[Tier]
    policy: RetentionPolicy
    flush_policy: str


class DcpSeries:
    """Ledger, flush and retention of one rank's DCP part series (see the module
    docstring). ``ckpt`` is the owning rank (:class:`SeriesHost`), ``on_event`` the
    user's event callback (the series' events are the job's events) and ``deadline``
    the job's end (its flushes are timed against it)."""

    def __init__(
        self,
        ckpt: SeriesHost,
        on_event: Optional[Callable[[str, Dict[str, Any]], None]],
        deadline: Deadline,
    ) -> None:
        self.user = ckpt.user
        self.key = part_key(ckpt.key, ckpt.rank)
        self.local = ckpt.local
        self.token = f"{os.getpid()}-{secrets.token_hex(8)}"
        self.books = Bookkeeper(ckpt.config, ckpt.user, self.key, ckpt.job, ckpt.node, on_event)
        self.policy = ckpt.policy
        self.pipe = Pipeline(
            ckpt.local,
            ckpt.warm,
            Shard(
                ckpt.user,
                self.key,
                ckpt.key,
                "",
                ckpt.rank,
                ckpt.world_size,
                ckpt.job,
                ckpt.node,
            ),
            self.books,
            ckpt.policy,
            deadline,
            flush_policy=ckpt.flush_policy,
            min_free=ckpt.config.tiers.local.min_free,
            max_consecutive_failures=ckpt.config.job.max_consecutive_failures,
        )
        self._lock = threading.Lock()
        self._pending: Dict[int, SaveRecord] = {}
        self._t0: Dict[int, float] = {}
        self._seq = 0
        with _LIVE_LOCK:
            _LIVE[self.token] = weakref.ref(self)

    def register(self, step: int, tokens: Optional[int], preempt: bool) -> SaveRecord:
        """A DCP save of ``step`` is about to run: its record, selected for the flush as
        a ``save()`` would be (every ``retention.flush_every``-th; always a preemption
        save)."""
        self.scan()
        with self._lock:
            seq = self._seq
            self._seq += 1
            rec = SaveRecord(
                step=step,
                tokens=tokens,
                seq=seq,
                reason="signal" if preempt else "interval",
                nbytes=0,
                forced=preempt,
                # No warm tier (laptop mode): nothing to flush to.
                selected=self.pipe.flusher is not None
                and (preempt or selected_for_flush(seq, self.policy)),
            )
            self._pending[step] = rec
            self._t0[step] = time.monotonic()
        self.books.emit("save_start", step=step, reason=rec.reason, backend="dcp")
        return rec

    def committed(self, step: int) -> None:
        """The part of ``step`` is committed on the local tier: record and flush it."""
        with self._lock:
            rec = self._pending.pop(step, None)
            t0 = self._t0.pop(step, None)
        if rec is None:
            return
        try:
            m = self.local.manifest(self.user, self.key, step)
        except (NotFound, VerifyError, TierError) as exc:
            log.warning("[ckpt] dcp step=%d: committed part not readable: %s", step, exc)
            return
        rec.nbytes = m.total_bytes
        rec.local_status = "committed"
        rec.local_s = None if t0 is None else time.monotonic() - t0
        pipe = self.pipe
        pipe.start()
        with pipe.cv:  # reentrant: the counts and the newest record change together
            pipe.count(saves=1, committed=1, bytes_written=rec.nbytes, last_step=step)
            pipe.newest = rec
        self.books.commit_local(rec)
        self.books.emit("local_done", step=step, local_s=rec.local_s, backend="dcp")
        if rec.selected and pipe.flusher is not None:
            pipe.queue_flush(rec)
        else:
            rec.flush_status = "not selected"
            self.books.log_save(rec, pipe.cv)
            pipe.apply_retention()

    def scan(self) -> None:
        """Pick up parts committed where this process could not be told (DCP's process
        mode): every pending step now committed on the local tier."""
        with self._lock:
            steps = sorted(self._pending)
        if not steps:
            return
        try:
            have = {i.step for i in self.local.steps(self.user, self.key)}
        except (CkptError, OSError) as exc:
            log.warning("[ckpt] cannot list %s: %s", self.local.where(self.user, self.key), exc)
            return
        for step in steps:
            if step in have:
                self.committed(step)

    def finish(self, until: Optional[float]) -> None:
        """``close()``'s part: pick up the last commits, flush the newest part if it was
        not, and wait for the flushes (until ``until``; then left to the epilog)."""
        self.scan()
        with self._lock:
            for step, rec in self._pending.items():
                log.info("[ckpt] dcp step=%d: not committed by close() (%s)", step, rec.reason)
            self._pending.clear()
        self.pipe.finish(until)
        with _LIVE_LOCK:
            _LIVE.pop(self.token, None)
