"""Where trainers that write their own checkpoints meet the Checkpointer.

The :class:`~slurm_ckpt.job.checkpointer.Checkpointer` facade builds a :class:`Seams`
and delegates these methods to it: a framework's checkpoint *directory* (SCR's ``Start_output`` /
``Complete_output``: :meth:`output`, :meth:`adopt`, :meth:`restore_path`, with the logic
in :mod:`slurm_ckpt.job.output`), the step-boundary question an integration asks
(:attr:`preemption_pending`), and a ``torch.distributed.checkpoint`` StorageWriter/Reader
(:meth:`dcp_writer`, :meth:`dcp_reader`, :mod:`slurm_ckpt.dcp.storage`). Why apart
from the facade: one concept per module; the state format's save/restore is the
facade's own, these are the doors for checkpoints in other formats. They act on the
facade's typed :class:`~slurm_ckpt.job.context.JobContext` (its tiers, schedule,
pipeline and identity) and on the restore side (:class:`~slurm_ckpt.job.restoring.Restoring`,
for ``restore_path`` and a DCP copy that fails verification); like
:mod:`slurm_ckpt.job.output`, they never see the Checkpointer (a part that imported the
facade that imported it was a circle).
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any, ContextManager, Dict, Optional, Sequence, Union

from slurm_ckpt.errors import CkptError
from slurm_ckpt.job import output as _output
from slurm_ckpt.job.context import JobContext
from slurm_ckpt.job.dcp_series import DcpSeries
from slurm_ckpt.job.restoring import Restoring
from slurm_ckpt.job.saved import Saved
from slurm_ckpt.job.schedule import BOOTSTRAP_COST_S

log = logging.getLogger(__name__)

__all__ = ["Seams"]

PathLike = Union[str, "os.PathLike[str]"]


class Seams:
    """The Checkpointer's doors for checkpoints a framework writes itself."""

    def __init__(self, ctx: JobContext, restoring: Restoring) -> None:
        self._ctx = ctx
        self._restoring = restoring
        #: The DCP part series (:mod:`slurm_ckpt.job.dcp_series`), made by the first
        #: ``dcp_writer()``; None until then.
        self.dcp: Optional[DcpSeries] = None

    def output(
        self,
        *,
        step: int,
        tokens: Optional[int] = None,
        meta: Optional[Dict[str, Any]] = None,
        preemption: Optional[bool] = None,
    ) -> ContextManager[Path]:
        """``with ckpt.output(step=...) as path:`` a directory on the local tier for a
        framework to write its own checkpoint files into; on a clean exit they are hashed,
        committed (manifest last) and flushed like any save, a body that raises commits
        nothing (:mod:`slurm_ckpt.job.output`). ``meta``/``preemption`` as in :meth:`save`."""
        return _output.output(self._ctx, step, tokens, meta, preemption)

    def adopt(
        self,
        step: int,
        path: PathLike,
        *,
        tokens: Optional[int] = None,
        meta: Optional[Dict[str, Any]] = None,
        preemption: Optional[bool] = None,
    ) -> Saved:
        """Snapshot a checkpoint directory a framework already wrote (reflinks, hard
        links or a copy) and commit it like :meth:`output`; when this returns the
        framework may delete its directory. Returns the same frozen
        :class:`~slurm_ckpt.job.saved.Saved` as :meth:`save`."""
        return _output.adopt(self._ctx, step, path, tokens, meta, preemption)

    def restore_path(
        self,
        *,
        step: Optional[int] = None,
        tiers: Optional[Sequence[str]] = None,
        expect_data_version: Optional[str] = None,
        on_data_change: str = "warn",
    ) -> Optional[Path]:
        """This rank's directory of the newest complete directory checkpoint that
        verifies, on the local tier (fetched there, verified, when only a warm or cold
        tier holds it); None when there is none. Read it; never write into it."""
        names = None if tiers is None else list(tiers)
        r = self._restoring.make_restorer(
            names,
            step,
            expect_data_version,
            on_data_change,
            factory=functools.partial(_output.DirRestorer, self._ctx.local),
        )
        got = _output.restore_path(r, self._ctx.shard_key)
        if got is None:
            return None
        self._restoring.restored = got
        self._ctx.schedule.restored(got.step, got.tokens)
        # a rollback branches too
        self._restoring.adopt_lineage(got, r.view if names is None else None)
        return got.state  # type: ignore[no-any-return]

    @property
    def preemption_pending(self) -> bool:
        """True from a preemption signal (or the job's end coming closer than a save and
        its flush) until the save answering it is taken: a framework integration asks
        this at each step boundary and has its trainer save there (the save it then
        hands to :meth:`adopt`/:meth:`output` is the preemption save: always flushed)."""
        schedule = self._ctx.schedule
        if schedule.preempt_saved:
            return False
        return schedule.preempt_pending or self._ctx.near_end()

    def mark_preemption_saved(self, step: int, tokens: Optional[int] = None) -> None:
        """Count ``step``, saved already, as the save answering a pending preemption.

        A framework may be asked for the same step twice (Lightning's ModelCheckpoint
        saving "last" beside ours, or a signal right after an interval save): writing it
        again would only fail the write or flush still in flight, and ``close()`` flushes
        the newest step anyway. This is the public door for "that step was the preemption
        save": :attr:`preempted` turns true and :attr:`preemption_pending` false."""
        self._ctx.schedule.saved(step, tokens, 0.0, preemption=True)

    # ------------------------------------------------------------------ DCP (torch.distributed)
    def _dcp_series(self) -> DcpSeries:
        if self.dcp is None:
            ctx = self._ctx
            self.dcp = DcpSeries(ctx, ctx.books.on_event, ctx.deadline)
        return self.dcp

    def dcp_writer(
        self,
        *,
        step: int,
        tokens: Optional[int] = None,
        meta: Optional[Dict[str, Any]] = None,
        preemption: Optional[bool] = None,
    ) -> Any:
        """A ``torch.distributed.checkpoint`` StorageWriter for ``step``: pass it to
        ``dcp.save`` or ``dcp.async_save`` (thread or process mode). Each rank's bytes are
        committed on its local tier and flushed like any checkpoint; the step counts once
        rank 0 has committed the global metadata. See :mod:`slurm_ckpt.dcp.storage` and
        docs/dcp.md. ``preemption`` as in :meth:`save`."""
        # The DCP backend needs torch; imported here so that the job layer does not.
        from slurm_ckpt.dcp.storage import SlurmDcpWriter

        ctx = self._ctx
        ctx.check_open("dcp_writer")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CkptError(f"dcp_writer(): step must be a whole number >= 0, got {step!r}")
        preempt = ctx.preempting(preemption)
        series = self._dcp_series()
        series.register(step, tokens, preempt)
        # DCP measures the stall, not us: keep the schedule's cost estimate as it is.
        cost = ctx.schedule.cost_s if ctx.schedule.cost_s is not None else BOOTSTRAP_COST_S
        ctx.schedule.saved(step, tokens, cost, preemption=preempt)
        return SlurmDcpWriter(
            ctx.local,
            ctx.user,
            ctx.key,
            step,
            tokens=tokens,
            job=ctx.job,
            node=ctx.node,
            meta=meta,
            token=series.token,
            fence=ctx.lease.fence(),
        )

    def dcp_reader(
        self,
        *,
        step: Optional[int] = None,
        process_group: Any = None,
        no_dist: bool = False,
        ranged: bool = False,
    ) -> Any:
        """A ``torch.distributed.checkpoint`` StorageReader for the newest DCP step that
        every rank finds whole and verified, on any tier (or exactly ``step``); None when
        there is none. Loads at any world size (DCP's planner reshards).

        Collective as ``dcp.load`` is, with the same arguments: every rank of the process
        group calls it (default), every rank of ``process_group`` (a subgroup), or this
        rank alone with ``no_dist=True`` (it then verifies every part itself: a single
        process reading the whole checkpoint, offline or beside a running job). Pass
        ``dcp.load`` the same ``process_group``/``no_dist``. Raises
        :class:`~slurm_ckpt.errors.CkptError` when a verified item of the newest step
        will not load (never a quiet fall-back to an older step).

        ``ranged=True``: the load reads only the byte ranges its plan needs (whole hash
        chunks, each verified as it lands) instead of every part whole up front; damage
        in a range it needs then fails the load with a one-line error instead of
        falling back to a sound copy or an older step (docs/dcp.md, Ranged loads)."""
        from slurm_ckpt.dcp.storage import Group, select_step

        group = Group(process_group, no_dist)
        ctx = self._ctx
        reader = select_step(
            ctx.tiers,
            ctx.user,
            ctx.key,
            step=step,
            mark_bad=self._restoring.mark_bad,
            group=group,
            ranged=ranged,
        )
        if reader is None:
            log.info("[ckpt] dcp_reader: no DCP checkpoint of %s found", ctx.key)
            return None
        ctx.schedule.restored(reader.step, reader.tokens)
        log.info("[ckpt] dcp_reader: step=%d tokens=%s", reader.step, reader.tokens)
        return reader
