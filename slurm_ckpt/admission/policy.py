"""Admission control's policy: the caps, the jitter, the timings, the queue's priorities,
and the error a store that cannot be used raises. The decisions under this policy are
:mod:`slurm_ckpt.admission.decisions`; why there are slots at all, the package docstring.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, Optional

from slurm_ckpt.errors import EXIT_FAILED, CkptError

__all__ = ["AdmissionError", "AdmissionPolicy", "Priority"]


class AdmissionError(CkptError):
    """The slot store cannot be used (missing, unsafe, unreadable, or locked too long)."""

    exit_code = EXIT_FAILED


class Priority(enum.IntEnum):
    """Queue order: higher goes first. Values leave room for site-defined levels."""

    ROUTINE = 0
    #: The job was preempted or is at its end: this flush is its last chance.
    PREEMPTED = 10
    #: The node is draining for maintenance: an admin (``ckpt-slurm maint``) waits on it.
    MAINTENANCE = 20


@dataclass(frozen=True)
class AdmissionPolicy:
    """The caps, the jitter and the timings; see :mod:`slurm_ckpt.admission`.

    ``max_nodes``/``max_bandwidth`` None = no such cap (both None: no slots at all, only
    jitter). ``lease`` is how long a holder's slot outlives its last renewal; ``poll`` how
    often a waiter looks again; ``max_wait`` the budget of a caller that has none.
    """

    max_nodes: Optional[int] = None
    max_bandwidth: Optional[float] = None
    jitter: float = 0.0
    lease: float = 60.0
    poll: float = 1.0
    max_wait: float = 300.0

    def __post_init__(self) -> None:
        if self.max_nodes is not None and (
            isinstance(self.max_nodes, bool) or int(self.max_nodes) != self.max_nodes
        ):
            raise ValueError(f"max_nodes must be a whole number, got {self.max_nodes!r}")
        if self.max_nodes is not None and self.max_nodes < 1:
            raise ValueError(f"max_nodes must be at least 1, got {self.max_nodes!r}")
        for name in ("max_bandwidth",):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be positive, got {v!r}")
        for name in ("jitter",):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must not be negative, got {v!r}")
        for name in ("lease", "poll", "max_wait"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be positive, got {v!r}")

    @property
    def enabled(self) -> bool:
        """True when a cap is set, i.e. slots are taken at all."""
        return self.max_nodes is not None or self.max_bandwidth is not None

    @classmethod
    def from_config(cls, cfg: Any) -> AdmissionPolicy:
        """From a :class:`~slurm_ckpt.core.config.Config` (its ``[admission]`` section)."""
        a = cfg.admission
        return cls(
            max_nodes=a.max_nodes,
            max_bandwidth=a.max_bandwidth,
            jitter=a.jitter,
            lease=a.lease,
            poll=a.poll,
            max_wait=a.max_wait,
        )

    def rate_of(self, requested: Optional[float]) -> float:
        """The rate a request counts with against ``max_bandwidth``.

        A flusher that knows its own cap (``tiers.pfs.bandwidth_limit``) asks with it; one
        that does not is counted as an equal share of the bandwidth cap
        (``max_bandwidth / max_nodes``, or all of it when there is no node cap: such a
        flusher then flushes alone), and is told to keep to that rate.
        """
        if requested is not None and requested > 0:
            if self.max_bandwidth is not None:
                return min(float(requested), self.max_bandwidth)
            return float(requested)
        if self.max_bandwidth is None:
            return 0.0
        return self.max_bandwidth / (self.max_nodes or 1)
