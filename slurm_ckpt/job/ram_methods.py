"""The Checkpointer's side of the RAM tier: ``ram_save()`` at every step boundary, the
``ram_*`` counters in ``stats``, and the tiers a restore reads it through.

:class:`RamDoor` is a small object over the typed
:class:`~slurm_ckpt.job.context.JobContext` that the Checkpointer builds and delegates to
(it never sees the Checkpointer); the machinery is :mod:`.ram_replica` (snapshots,
their copies to the partner, the holder's side) over :mod:`.ram_tier`
(the memory and its manifests).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Dict, Optional, Union

from slurm_ckpt.errors import CkptError
from slurm_ckpt.job.context import JobContext
from slurm_ckpt.job.options import RamOptions, ram_options
from slurm_ckpt.job.partner import PartnerLink
from slurm_ckpt.job.ram_replica import RamCopies
from slurm_ckpt.job.saved import check_save_args
from slurm_ckpt.job.stats import CheckpointStats

log = logging.getLogger(__name__)

__all__ = ["RamDoor", "RamSetting", "open_ram", "with_ram_stats"]

#: What ``Checkpointer(ram=...)`` takes: ``True`` (the defaults), a :class:`RamOptions`,
#: or ``None``/``False`` (off).
RamSetting = Optional[Union[bool, RamOptions]]


def open_ram(value: Any, ctx: JobContext, partner: Optional[PartnerLink]) -> Optional[RamCopies]:
    """The RAM tier of the Checkpointer of ``ctx`` for its ``ram=`` option (None: off).
    Replication needs the ``partner`` link (``partner=True``); without one the snapshots
    stay on this node only."""
    opts = ram_options(value)
    if opts is None:
        return None
    if opts.replicate and partner is None:
        log.warning(
            "[ckpt] RAM tier: no partner link (partner copies off, one rank or one node): "
            "the RAM snapshots are not replicated"
        )
    return RamCopies(
        opts,
        user=ctx.user,
        key=ctx.shard_key,
        base_key=ctx.key,
        prefix=ctx.prefix,
        rank=ctx.rank,
        world_size=ctx.world_size,
        job=ctx.job,
        node=ctx.node,
        chunk_size=int(getattr(ctx.local, "chunk_size", 0) or 64 * 2**20),
        staging_limit=ctx.config.job.staging_memory_limit,
        link=partner,
        on_event=ctx.books.emit,
    )


def with_ram_stats(stats: CheckpointStats, ram: Optional[RamCopies]) -> CheckpointStats:
    """``stats`` with the RAM tier's counters filled in."""
    if ram is None:
        return stats
    r = ram.stats
    return dataclasses.replace(
        stats,
        ram_snapshots=r.snapshots,
        ram_replicated=r.replicated,
        ram_behind=r.behind,
        ram_not_taken=r.not_taken,
        ram_replica_failures=r.replica_failures,
        ram_every=r.every,
    )


class RamDoor:
    """``Checkpointer.ram_save`` and ``guard_commits`` (see the module docstring): the
    RAM tier ``ram`` (None: off) and the series' lease, nothing else of the facade."""

    def __init__(self, ctx: JobContext, ram: Optional[RamCopies]) -> None:
        self._ctx = ctx
        self.ram = ram

    def guard_commits(self, guard: Callable[[], None]) -> None:
        """``guard()`` is asked before every commit of this series and raises
        :class:`~slurm_ckpt.core.lease.StaleGeneration` when this process was replaced
        (in-job recovery's membership fence, :mod:`slurm_ckpt.job.recovery`)."""
        self._ctx.lease.guard = guard

    def ram_save(
        self,
        state: Any,
        *,
        step: int,
        tokens: Optional[int] = None,
        meta: Optional[Dict[str, Any]] = None,
        force: bool = False,
    ) -> bool:
        """Call at every step boundary (after the optimizer step): a snapshot of ``state``
        into host memory when the RAM tier's interval is due (``ram=RamOptions(every=...)``;
        ``force``: now), hashed and replicated to the partner rank's memory in the
        background. Returns whether a snapshot was taken; ``state`` may be changed as
        soon as this returns. ``state`` may also be a function returning it, called only
        when a snapshot is due (building a state tree each step costs time too). The
        RAM tier's interval is its own, independent of ``save()``'s.

        Raises a one-line :class:`CkptError` when the RAM tier is off or an argument is
        wrong; never for a snapshot that could not be taken or copied (counted in
        ``stats.ram_not_taken`` / ``stats.ram_behind``, an event and a log line)."""
        if self.ram is None:
            raise CkptError("ram_save(): the RAM tier is off (Checkpointer(..., ram=True))")
        if self._ctx.closed:
            raise CkptError("Checkpointer.ram_save(): already closed")
        meta = check_save_args(step, tokens, meta, None, None)
        return self.ram.save(state, step, tokens, meta, bool(force))
