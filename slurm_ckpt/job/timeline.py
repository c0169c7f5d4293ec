"""Rank 0's part of the job timeline (:mod:`slurm_ckpt.core.timeline`): what it restored
and how far it got, so ``ckpt-slurm goodput JOB`` can count the steps a failure cost.

Only rank 0 writes, only under ckpt-srun (``$SLURM_CKPT_TIMELINE``), and at most one
``progress`` record every :data:`~slurm_ckpt.core.timeline.PROGRESS_S` seconds (from
``should_save``, and from in-job recovery's step loop): a clock read per step otherwise.
A failure to write is logged once; training goes on.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Mapping, Optional

from slurm_ckpt.core.timeline import PROGRESS_S, TIMELINE_ENV, append_record

__all__ = ["RankTimeline"]

log = logging.getLogger(__name__)


class RankTimeline:
    """Appends rank 0's records to ``<dir>/rank0.jsonl`` (a no-op elsewhere)."""

    def __init__(self, directory: Optional[str], rank: int) -> None:
        self.path = os.path.join(directory, "rank0.jsonl") if directory and rank == 0 else None
        self._next = 0.0
        self._broken = False

    @classmethod
    def from_env(cls, rank: int, environ: Optional[Mapping[str, str]] = None) -> RankTimeline:
        env = os.environ if environ is None else environ
        value = env.get(TIMELINE_ENV, "")
        return cls(value if os.path.isabs(value) else None, rank)

    def _write(self, event: str, **fields: object) -> None:
        if self.path is None or self._broken:
            return
        try:
            append_record(self.path, event, **fields)
        except OSError as exc:
            self._broken = True
            log.warning("[ckpt] job timeline %s not written: %s", self.path, exc)

    def event(self, name: str, **fields: object) -> None:
        """Any other record of rank 0 (in-job recovery's ``in_job_failure``,
        ``reform_start``, ``reform_end``: :mod:`slurm_ckpt.job.recovery`). The next
        ``progress`` is written at once: goodput's "training again" is the first one
        after a restore, which the throttle would otherwise put up to PROGRESS_S late."""
        self._write(name, **fields)
        self._next = 0.0

    def restored(self, step: int, tier: str, seconds: float) -> None:
        self._write("restored", step=step, tier=tier, seconds=round(seconds, 3))
        self._next = 0.0

    def progress(self, step: Optional[int]) -> None:
        """Rank 0 reached ``step`` (written at most every PROGRESS_S seconds)."""
        if self.path is None or step is None:
            return
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + PROGRESS_S
        self._write("progress", step=int(step))
