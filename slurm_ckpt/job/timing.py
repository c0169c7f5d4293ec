"""When the job's end is near enough that the next save must be taken now.

Apart from :mod:`slurm_ckpt.job.checkpointer` because it is a cost estimate, not part of
the facade: the job's end time (SLURM's ``SLURM_JOB_END_TIME``, else squeue) against what
one save and its flush cost as measured so far. The answer makes the next save one like
a save answering a warning signal (always flushed; ``preempted`` set afterwards), so no
one has to guess ``--signal``.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from slurm_ckpt.job.pipeline import DEADLINE_MARGIN_S, Pipeline
from slurm_ckpt.job.schedule import BOOTSTRAP_COST_S

log = logging.getLogger(__name__)

__all__ = ["near_end"]


def near_end(end: Optional[float], pipeline: Pipeline) -> bool:
    """True when ``end`` (epoch; None: unknown, never near) is closer than one save plus
    its flush (as measured so far by ``pipeline``, x1.5, plus a margin); says so in the
    log when it is."""
    if end is None:
        return False
    s = pipeline.stats
    need = (s.last_stall_s or BOOTSTRAP_COST_S) + (s.last_local_s or 0.0)
    newest = pipeline.newest
    if newest is not None:
        need += pipeline.estimate_flush_s(newest.nbytes)
    if end - time.time() > 1.5 * need + DEADLINE_MARGIN_S:
        return False
    log.warning(
        "[ckpt] the job ends in %.0fs; a save and its flush take ~%.0fs: saving now",
        end - time.time(),
        need,
    )
    return True
