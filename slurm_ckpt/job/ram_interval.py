"""When the RAM tier takes a snapshot: every N calls, or as often as a budget of step
time allows.

Apart from :mod:`.ram_replica` (which takes, commits and copies the snapshots) because it
is pure arithmetic over measured times, with its own tests: ``"auto"`` measures what a
snapshot costs (the caller's stall plus the background CPU time, the holder's included)
and how long its copy takes, against the median step time, and sets the interval to the
smallest N that keeps the cost within ``budget`` of N steps and lets each copy end before
the next is due.
"""

from __future__ import annotations

import collections
import math
import statistics
from typing import Any, Deque, Optional

__all__ = ["STEP_WINDOW", "Interval"]

#: Step times the interval's median is taken over.
STEP_WINDOW = 32


class Interval:
    """Every ``every`` calls, or (``"auto"``) as often as ``budget`` of step time allows."""

    def __init__(self, every: Any, budget: float) -> None:
        self.fixed: Optional[int] = None if every == "auto" else int(every)
        self.budget = float(budget)
        self.k = self.fixed or 1
        self.since: Optional[int] = None  # calls since the last snapshot (None: none yet)
        self._last: Optional[float] = None
        self._steps: Deque[float] = collections.deque(maxlen=STEP_WINDOW)
        self.cost_s: Optional[float] = None
        self.copy_s: Optional[float] = None

    @property
    def step_s(self) -> Optional[float]:
        return statistics.median(self._steps) if self._steps else None

    def tick(self, now: float) -> bool:
        """One call at a step boundary: whether a snapshot is due now."""
        if self._last is not None:
            self._steps.append(now - self._last)
        self._last = now
        if self.since is None:
            return True
        self.since += 1
        return self.since >= self.k

    def taken(self) -> None:
        self.since = 0

    def measured(self, cost_s: float, copy_s: float) -> int:
        """One snapshot's cost (stall + background CPU) and its copy's wall time; returns
        the interval from now on."""
        a = 0.3
        self.cost_s = cost_s if self.cost_s is None else (1 - a) * self.cost_s + a * cost_s
        self.copy_s = copy_s if self.copy_s is None else (1 - a) * self.copy_s + a * copy_s
        step = self.step_s
        if self.fixed is None and step:
            # (less a hair: 0.01 / (0.02 * 0.1) is 5.000000000000001 in floats)
            by_budget = math.ceil(self.cost_s / (self.budget * step) - 1e-9)
            by_copy = math.ceil(self.copy_s / step - 1e-9)
            self.k = max(1, by_budget, by_copy)
        return self.k
