"""What the node's scans cut out of :class:`~slurm_ckpt.node.work.NodeWork` read of it.

Local retention (:mod:`slurm_ckpt.node.local_retention`) and the scrub
(:mod:`slurm_ckpt.node.scrub`) are parts of the node's work kept in modules of their own
(one concept each); :class:`~slurm_ckpt.node.work.NodeWork` calls them with itself. They
take it as this protocol, not as the class: the class imports them, so naming it there
made an import circle, and the protocol says exactly which of its members they may use
(the config, the ledger, the users scanned, the clock, a child's time limit, events).
Both run their owner children the same way: :func:`run_owner_task`.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Protocol

from slurm_ckpt.core.config import Config
from slurm_ckpt.core.names import UserIds
from slurm_ckpt.ledger import Ledger, Record
from slurm_ckpt.node.asuser import run_as

__all__ = ["WorkView", "run_owner_task"]


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


def run_owner_task(
    work: WorkView,
    user: str,
    task: Callable[..., Any],
    items: Any,
    nbytes: int,
    left: Optional[float],
    what: str,
) -> Any:
    """``task(cfg, user, uid, items, budget)`` in a child running as ``user``: what it
    sent back (unchecked: the caller checks it, the child is the user's).

    Timed by the child limit for ``nbytes`` and by ``left`` (the caller's deadline),
    whichever is shorter; the task gets 80% of that as its own budget, so that it
    stops and answers before it is killed. A child the user stops is caught by its
    silence (``[hooks] child_timeout``). Raises what :func:`run_as` raises (TimedOut,
    CkptError): the caller decides what skipping this owner means."""
    ids = work.users[user]
    cap = work.child_limit(nbytes)
    timeout = cap if left is None else min(left, cap)
    return run_as(
        ids.uid,
        ids.gid,
        task,
        work.cfg,
        user,
        ids.uid,
        items,
        max(0.05, timeout * 0.8 - 0.1),
        user=ids.name,
        timeout=timeout,
        stall_timeout=work.cfg.hooks.child_timeout,
        what=what,
    )
