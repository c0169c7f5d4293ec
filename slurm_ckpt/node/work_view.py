"""What the node's scans cut out of :class:`~slurm_ckpt.node.work.NodeWork` read of it.

Local retention (:mod:`slurm_ckpt.node.local_retention`) and the scrub
(:mod:`slurm_ckpt.node.scrub`) are parts of the node's work kept in modules of their own
(one concept each); :class:`~slurm_ckpt.node.work.NodeWork` calls them with itself. They
take it as this protocol, not as the class: the class imports them, so naming it there
made an import circle, and the protocol says exactly which of its members they may use
(the config, the ledger, the users scanned, the clock, a child's time limit, events).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Protocol

from slurm_ckpt.core.config import Config
from slurm_ckpt.core.names import UserIds
from slurm_ckpt.ledger import Ledger, Record

__all__ = ["WorkView"]


class WorkView(Protocol):
    """The node's work as a retention run or a scrub sees it."""

    cfg: Config
    ledger: Ledger
    #: The users found on the local tier this run (their ids, for the owner children).
    users: Dict[str, UserIds]
    #: Monotonic seconds (deadlines are on this clock).
    clock: Callable[[], float]

    def child_limit(self, nbytes: int) -> float:
        """The most an owner child handling ``nbytes`` may take in all."""
        ...

    def job_of(self, rec: Record) -> Optional[str]:
        """The job that wrote ``rec`` (its record, else what the scan found)."""
        ...

    def emit(self, event_type: str, **fields: Any) -> None:
        """An event in the node's event log (never fatal)."""
        ...
