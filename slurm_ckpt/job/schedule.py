"""When to save: the interval (tokens, steps, seconds, or Young/Daly's optimum) and the
preemption trigger.

A save is due when the first of the configured intervals is reached since the last save
(or restore), or when a preemption signal arrived and its save has not been taken yet.
Token and step intervals are aligned to multiples (saves at 50M, 100M, ... also after a
restart), so a requeued job keeps the same checkpoint steps. ``interval="auto"`` uses
Young/Daly's optimum ``sqrt(2 * cost * MTBI)`` with the measured save stall as the cost
(:data:`BOOTSTRAP_COST_S` until the first save has been measured).
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Optional

from slurm_ckpt.core.config import JobConfig
from slurm_ckpt.core.planner import auto_interval
from slurm_ckpt.job.signals import SignalFlag

log = logging.getLogger(__name__)

__all__ = ["BOOTSTRAP_COST_S", "DEFAULT_INTERVAL_TOKENS", "Schedule", "unreachable_message"]

#: The interval when none is configured anywhere.
DEFAULT_INTERVAL_TOKENS = 50_000_000
#: Assumed save cost for ``interval="auto"`` until the first save has been measured.
BOOTSTRAP_COST_S = 1.0


def unreachable_message(key: str) -> str:
    """The warning for a job that counts steps under the default token interval."""
    return (
        f"Checkpointer {key!r}: no interval given, so a save is due every "
        f"{DEFAULT_INTERVAL_TOKENS:,} tokens, but should_save() gets no tokens=: it will "
        "only ever save on a signal. Pass tokens=, or give interval_steps= / "
        "interval_seconds= / interval_tokens="
    )


def _crossed(every: Optional[int], now: Optional[int], ref: Optional[int]) -> bool:
    """A multiple of ``every`` was reached since ``ref`` (aligned intervals)."""
    return bool(every) and now is not None and ref is not None and now // every > ref // every


class Schedule:
    """The save schedule of one Checkpointer (see the module docstring)."""

    def __init__(self, jc: JobConfig, flag: SignalFlag) -> None:
        self.interval_tokens = jc.interval_tokens
        self.interval_steps = jc.interval_steps
        self.interval_seconds = jc.interval_seconds
        self.auto = jc.interval == "auto"
        if not (self.interval_tokens or self.interval_steps or self.interval_seconds) and (
            not self.auto
        ):
            self.interval_tokens = DEFAULT_INTERVAL_TOKENS
        #: No interval was given anywhere: the default (tokens) is in force.
        self.defaulted = self.interval_tokens == DEFAULT_INTERVAL_TOKENS and not (
            jc.interval_tokens or self.auto
        )
        self._checked_reachable = False
        self._told_ctrl_c = False
        self.mtbi_s = jc.mtbi
        self.flag = flag
        #: The save answering a preemption signal has been taken.
        self.preempt_saved = False
        #: The job's end is near (see the Checkpointer): the next save is its last.
        self.deadline_due = False
        self.cost_s: Optional[float] = None
        self.ref_step: Optional[int] = None
        self.ref_tokens: Optional[int] = None
        self.ref_time = time.monotonic()

    def period(self) -> Optional[float]:
        """The time interval now in force (the auto one moves with the measured cost)."""
        if self.auto:
            cost = BOOTSTRAP_COST_S if self.cost_s is None else max(self.cost_s, 1e-3)
            return auto_interval(cost, self.mtbi_s)
        return self.interval_seconds

    @property
    def preempt_pending(self) -> bool:
        """A preemption signal arrived (or the job's end is near) and its save has not
        been taken yet."""
        warned = self.flag.received is not None or self.deadline_due
        if warned and self.flag.received == signal.SIGINT and not self._told_ctrl_c:
            self._told_ctrl_c = True  # said here, at a step boundary: never in the handler
            log.warning(
                "[ckpt] Ctrl-C: saving at this step boundary, then stopping (Ctrl-C again "
                "interrupts at once)"
            )
        return warned and not self.preempt_saved

    def unreachable(self, step: Optional[int], tokens: Optional[int]) -> bool:
        """True once, at the first question, when the default interval (tokens) can never
        be reached because the caller counts steps and passes no ``tokens``: without this
        a job would run for ever without a save and nobody would notice."""
        if self._checked_reachable:
            return False
        self._checked_reachable = True
        return self.defaulted and tokens is None

    def due(self, step: Optional[int] = None, tokens: Optional[int] = None) -> bool:
        """True when an interval is reached or a preemption save is pending."""
        if self.preempt_pending:
            return True
        if step is not None and self.ref_step is None:
            self.ref_step = step
        if tokens is not None and self.ref_tokens is None:
            self.ref_tokens = tokens
        if _crossed(self.interval_tokens, tokens, self.ref_tokens):
            return True
        if _crossed(self.interval_steps, step, self.ref_step):
            return True
        period = self.period()
        return bool(period) and time.monotonic() - self.ref_time >= period  # type: ignore[operator]

    def saved(
        self, step: int, tokens: Optional[int], stall_s: float, preemption: bool = False
    ) -> None:
        """A save was taken (and cost ``stall_s``): the intervals start again here."""
        self.ref_step, self.ref_tokens, self.ref_time = step, tokens, time.monotonic()
        self.cost_s = stall_s if self.cost_s is None else 0.5 * (self.cost_s + stall_s)
        if preemption:
            self.preempt_saved = True

    def restored(self, step: int, tokens: Optional[int]) -> None:
        """Training resumes from ``step``: the intervals count from there."""
        self.ref_step, self.ref_tokens, self.ref_time = step, tokens, time.monotonic()
