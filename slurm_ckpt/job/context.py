"""The one typed context the Checkpointer's parts share.

The :class:`~slurm_ckpt.job.checkpointer.Checkpointer` builds its parts (the tiers, the
schedule, the bookkeeping, the pipeline, the series' lease) once; the modules that act
for it - a directory checkpoint (:mod:`slurm_ckpt.job.output`), the framework doors
(:mod:`slurm_ckpt.job.seams`) - receive this context instead of the Checkpointer itself.

Why: a part that received the facade reached back into its private members, and the
facade imported the part that imported the facade (an import circle). A context with
public, typed fields is the whole of what a part may use, so the facade's insides can
change without its parts following them, and a part is testable without a Checkpointer.
The two facts that change while the run goes on (closed, the save counter) live here,
so that every part sees the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from slurm_ckpt.core.config import Config
from slurm_ckpt.core.retention import RetentionPolicy
from slurm_ckpt.errors import CkptError
from slurm_ckpt.job.bookkeeping import Bookkeeper
from slurm_ckpt.job.lease import SeriesLease
from slurm_ckpt.job.pipeline import Pipeline
from slurm_ckpt.job.schedule import Schedule
from slurm_ckpt.job.signals import Deadline
from slurm_ckpt.job.timing import near_end
from slurm_ckpt.tiers.base import Tier

__all__ = ["JobContext"]


@dataclass(eq=False)
class JobContext:
    """One rank's series and the parts that write it (see the module docstring)."""

    config: Config
    local: Tier
    #: The tier every flush goes to (None: laptop mode, nothing is flushed).
    warm: Optional[Tier]
    #: Every tier, hot to cold (restore looks at all of them).
    tiers: List[Tier]
    user: str
    #: The series as the user named it, and this rank's own part of it.
    key: str
    shard_key: str
    #: This rank's directory inside a checkpoint (``rank-NNNNN``).
    prefix: str
    rank: int
    world_size: int
    job: Optional[str]
    node: str
    policy: RetentionPolicy
    flush_policy: str
    lease: SeriesLease
    schedule: Schedule
    books: Bookkeeper
    pipeline: Pipeline
    deadline: Deadline
    #: True once ``close()`` began: no save of any kind starts after it.
    closed: bool = False
    #: The sequence number the next save gets (retention's ``flush_every`` counts it).
    seq: int = 0

    def check_open(self, what: str) -> None:
        """Raise the pipeline's fatal error (too many failures in a row), or a one-line
        error when the Checkpointer is closed: the first lines of every save door."""
        if self.pipeline.fatal is not None:
            raise self.pipeline.fatal
        if self.closed:
            raise CkptError(f"Checkpointer.{what}(): already closed")

    def take_seq(self) -> int:
        """The next save's sequence number (each save door takes one, in call order)."""
        seq = self.seq
        self.seq += 1
        return seq

    def near_end(self) -> bool:
        """True once the job's end time is closer than one save plus its flush
        (:func:`slurm_ckpt.job.timing.near_end`); the save taken now answers it."""
        if self.schedule.deadline_due:
            return True
        if not near_end(self.deadline.end_time(), self.pipeline):
            return False
        self.schedule.deadline_due = True
        return True

    def preempting(self, preemption: Optional[bool]) -> bool:
        """Whether a save is the preemption save: ``preemption`` when given, else whether
        a preemption signal is pending."""
        return self.schedule.preempt_pending if preemption is None else bool(preemption)
