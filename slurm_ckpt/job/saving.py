"""The save side of the Checkpointer: when to save (``should_save``) and the save itself.

The :class:`~slurm_ckpt.job.checkpointer.Checkpointer` facade builds a :class:`Saving`
and delegates ``should_save`` and ``save`` to it. A save runs in three phases (the
facade's docstring names them); this is the first - the snapshot on the caller's thread
- and the bookkeeping around it, over the typed
:class:`~slurm_ckpt.job.context.JobContext` plus the staging area, the rank's timeline
and the lazy snapshot's holder (:class:`~slurm_ckpt.job.closing.Closing`, which waits
for it). Why apart: one concept per module, and the facade stays a facade.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable, Dict, Optional, Union

from slurm_ckpt.core.retention import selected_for_flush
from slurm_ckpt.job.bookkeeping import SaveRecord
from slurm_ckpt.job.closing import Closing
from slurm_ckpt.job.context import JobContext
from slurm_ckpt.job.replicas import replicated_files, tell_suspects
from slurm_ckpt.job.saved import Saved, check_save_args
from slurm_ckpt.job.schedule import unreachable_message
from slurm_ckpt.job.snapshot import hand_over
from slurm_ckpt.job.staging import StagingArea
from slurm_ckpt.job.state import flatten, index_bytes, layout
from slurm_ckpt.job.timeline import RankTimeline

__all__ = ["Saving"]


class Saving:
    """The Checkpointer's ``should_save`` and ``save`` (see the module docstring)."""

    def __init__(
        self,
        ctx: JobContext,
        *,
        staging: StagingArea,
        timeline: RankTimeline,
        closing: Closing,
        on_suspect: Any,
    ) -> None:
        self._ctx = ctx
        self._staging = staging
        self._timeline = timeline
        self._closing = closing
        self._on_suspect = on_suspect

    def should_save(self, step: Optional[int] = None, tokens: Optional[int] = None) -> bool:
        """True when an interval is reached or a preemption signal arrived (until the
        preemption save is taken). Raises :class:`CheckpointFailed` after too many
        failures in a row."""
        if self._ctx.pipeline.fatal is not None:
            raise self._ctx.pipeline.fatal
        self._timeline.progress(step)
        if self._ctx.schedule.unreachable(step, tokens):
            # stacklevel 3: the caller of Checkpointer.should_save, which delegates here
            warnings.warn(unreachable_message(self._ctx.key), UserWarning, stacklevel=3)
        if not self._ctx.schedule.preempt_saved and self._ctx.near_end():
            return True
        return self._ctx.schedule.due(step, tokens)

    def save(
        self,
        state: Any,
        *,
        step: int,
        tokens: Optional[int] = None,
        meta: Optional[Dict[str, Any]] = None,
        preemption: Optional[bool] = None,
        data_version: Optional[str] = None,
        lazy: Union[bool, Callable[[Any], bool]] = False,
    ) -> Saved:
        """Snapshot ``state`` and return; the write and the flush go on in the background.

        Returns a frozen :class:`~slurm_ckpt.job.saved.Saved` (step, tokens, nbytes,
        stall_s, preemption, synchronous). Arguments are checked here: a step outside
        0..9999999999, negative tokens or a meta that is not JSON raise at once.

        ``state`` may be changed as soon as this returns. A state that cannot be
        serialised raises ``TypeError`` at once; storage failures never raise here
        (see :mod:`slurm_ckpt.job.pipeline`), except :class:`CheckpointFailed` after
        ``max_consecutive_failures`` in a row. ``meta`` (JSON-able) goes into the
        manifest. ``preemption`` marks this as the preemption save (always flushed, sets
        :attr:`preempted`); by default it is one when this process received a signal -
        pass True when another rank did (e.g. after an all-reduce of the flags).
        ``data_version`` names the data this state was trained on (any string, e.g.
        :func:`slurm_ckpt.torch.data_version`); it goes into the manifest, ``list`` and
        ``status`` show it, and ``restore(expect_data_version=...)`` checks it.

        ``lazy`` (True, or a predicate over tensors) defers the copy of the tensors it
        accepts to a background thread: ``save()`` then returns before they are copied,
        and the caller must not write them in place until :meth:`wait_snapshot` returns
        (:class:`slurm_ckpt.torch.TorchCheckpointer` makes the optimizer step wait by
        itself; see :mod:`slurm_ckpt.job.lazy`).
        """
        meta = check_save_args(step, tokens, meta, preemption, data_version)
        self._ctx.check_open("save")
        self._ctx.lease.ensure()  # held since construction, except by a replica rank
        t0 = time.monotonic()
        preempt = self._ctx.preempting(preemption)
        reason = "signal" if preempt else "interval"
        index, tensors = flatten(state)
        blobs = layout(index)
        data = index_bytes(index)
        nbytes = sum(b["nbytes"] for b in blobs) + len(data)
        replicated = None
        if self._ctx.pipeline.replicas is not None:
            replicated = replicated_files(blobs, self._ctx.pipeline.replicas.scope)
        books, pipe = self._ctx.books, self._ctx.pipeline
        books.emit("save_start", step=step, reason=reason)
        pipe.start()
        # Backpressure: the staging buffers are busy until the previous local write ends.
        if pipe.local_job is not None:
            books.emit("backpressure_wait", step=step)
        pipe.wait_local_free()
        if pipe.suspects:
            # The previous save's verdict is in now (its exchange ends before its local
            # write does), on every rank alike: every rank hears it in this same call.
            tell_suspects(pipe.suspects, self._on_suspect)
        if self._ctx.flush_policy == "wait" and not preempt and pipe.flushes_busy():
            books.emit("flush_wait", step=step)
            pipe.wait_flushes()
        waited = time.monotonic() - t0

        seq = self._ctx.take_seq()
        flushed = preempt or selected_for_flush(seq, self._ctx.policy)
        flushed = flushed and self._ctx.warm is not None
        rec = SaveRecord(
            step=step,
            tokens=tokens,
            seq=seq,
            reason=reason,
            nbytes=nbytes,
            forced=preempt,
            selected=flushed,
            index_data=data,
            meta=meta,
            replicated=replicated,
        )
        if data_version is not None:
            rec.meta["data_version"] = data_version
        books.emit("snapshot_start", step=step)
        drain = hand_over(self._staging, pipe, books, rec, index, tensors, blobs, lazy, t0)
        if drain is not None:
            self._closing.drain = drain
        stall = time.monotonic() - t0
        rec.stall_s = stall
        self._ctx.schedule.saved(step, tokens, stall, preemption=preempt)
        pipe.count(
            saves=1,
            stall_s=stall,
            wait_s=waited,
            last_stall_s=stall,
            last_snapshot_s=rec.snapshot_s,
        )
        info = {"step": step, "stall_s": stall}
        books.notify("save_returned", info)
        if rec.synchronous:
            books.log_event("save_returned", info)
        else:
            pipe.defer_event("save_returned", info)
            if rec.local_status != "pending":  # the writer was quicker than this line
                pipe.log_deferred()
        return Saved(
            step=step,
            tokens=tokens,
            nbytes=nbytes,
            stall_s=stall,
            preemption=preempt,
            synchronous=rec.synchronous,
            deferred_bytes=0 if drain is None else drain.deferred_bytes,
        )
