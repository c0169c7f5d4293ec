"""When a job requeues itself after its checkpoint, and how: the toolkit's one requeue path.

SLURM requeues a preempted job by itself (``PreemptMode=REQUEUE``) but never one that hit
its time limit: such a job ends TIMEOUT and the rest of the training is lost unless the
job requeues itself after saving. Both the in-job ``Checkpointer(requeue=True)`` and the
batch wrapper ``ckpt-srun`` do that, so the rule and the call live here once:

* requeue only when the job is stopping because of its **time limit** (a second requeue
  of a preempted job would only confuse its restart count);
* or when a node of the job died and ``ckpt-srun --spares`` has no spare left to
  replace it (``NODE_LOST``: a ``--no-kill`` job keeps running, so SLURM does not
  requeue it by itself);
* within ``max_requeues`` restarts;
* through :meth:`SlurmClient.requeue <slurm_ckpt.slurm.client.SlurmClient.requeue>`.
"""

from __future__ import annotations

import logging
from typing import Optional

from slurm_ckpt.errors import CkptError
from slurm_ckpt.slurm.client import SlurmClient

log = logging.getLogger(__name__)

__all__ = [
    "NODE_LOST",
    "TIME_LIMIT_CAUSES",
    "is_time_limit",
    "requeue_job",
    "requeue_reason",
    "stop_cause",
]

#: Job states (or causes) that mean "stopping for its time limit".
TIME_LIMIT_CAUSES = ("TIMEOUT", "TIME_LIMIT", "TIMELIMIT", "DEADLINE")
#: A node of the job died and no spare is left (``ckpt-srun --spares``).
NODE_LOST = "NODE_LOST"


def is_time_limit(cause: Optional[str]) -> bool:
    return cause is not None and str(cause).strip().upper() in TIME_LIMIT_CAUSES


def stop_cause(
    state: Optional[str], reason: Optional[str], *, warned: bool, terminated: bool
) -> Optional[str]:
    """Why a step that ran under ckpt-srun stopped, as a cause :func:`requeue_reason` reads.

    ``"TIME_LIMIT"``: a time-limit warning came (SLURM's ``--signal`` or ckpt-srun's own
    timer) and SLURM still has the job RUNNING, not being preempted. ``"TERMINATED"``: a
    SIGTERM came (preemption or scancel: SLURM decides). Else SLURM's state, or None when
    the step simply ended.
    """
    if terminated:
        return "TERMINATED"
    if not warned:
        return None
    if state != "RUNNING":
        return "NOT_RUNNING"  # already ending or requeued: nothing for us to do
    if reason and "preempt" in reason.lower():
        return "PREEMPTED"
    return "TIME_LIMIT"


def requeue_reason(
    cause: Optional[str],
    *,
    restarts: int = 0,
    max_requeues: Optional[int] = None,
    enabled: bool = True,
    detail: str = "",
) -> Optional[str]:
    """Why to requeue (one line), or None: only a job stopping for its time limit (or
    one that lost a node it cannot replace, :data:`NODE_LOST`), and within
    ``max_requeues`` restarts."""
    if not enabled or not (is_time_limit(cause) or cause == NODE_LOST):
        return None
    if max_requeues is not None and restarts >= max_requeues:
        return None
    what = f" ({detail})" if detail else ""
    if cause == NODE_LOST:
        return f"no spare left{what}: requeueing (restart {restarts + 1})"
    return f"time limit near{what}: requeueing (restart {restarts + 1})"


def requeue_job(job_id: Optional[str], reason: str, client: Optional[SlurmClient] = None) -> bool:
    """Requeue ``job_id`` now; False (logged, never raised) when it cannot be done.

    Outside SLURM (no job id) there is nothing to requeue. Never raises: it runs at the
    end of a job, where an exception would only hide the checkpoint that was just saved.
    """
    if not job_id:
        log.info("[ckpt] not requeueing (%s): not running under SLURM", reason)
        return False
    log.warning("[ckpt] requeueing job %s: %s", job_id, reason)
    try:
        (client or SlurmClient(backend="cli", timeout=30.0)).requeue(job_id)
    except CkptError as exc:
        log.error("[ckpt] requeue of job %s failed: %s", job_id, exc)
        return False
    return True
