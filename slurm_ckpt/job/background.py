"""Background checkpoint threads yield the CPU to training.

Why: after ``save()`` returns, the local write (hashing, writing, syncing) and the flush
to the warm tier (reading back, copying, verifying) run on threads of the training
process. Where the training's compute is on the host cores (CPU training, data loading,
a node shared with other jobs), these threads compete with it for the same cores, and
at the kernel's equal shares every CPU-second they take is one the training loop
waits for. Checkpoint I/O has minutes until the next save; a training step has
milliseconds. So these threads run at a lower priority (a higher nice value, per
thread on Linux): they still get every idle cycle and, once training stops (a
preemption's last save, ``close()``), all of the CPU, but while training runs they
take little of its share.

Not lowered: the lazy snapshot's drain (``slurm_ckpt.job.lazy``), which the next
optimizer step waits for, and the copy inside ``save()`` itself.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable

log = logging.getLogger(__name__)

__all__ = ["BACKGROUND_NICE", "yield_cpu", "yielding"]

#: Added to the nice value of the checkpoint writer and flush threads (0: unchanged).
#: 10 gives them about a tenth of a normal thread's share when both want a core.
BACKGROUND_NICE = 10


def yield_cpu(increment: int = BACKGROUND_NICE) -> None:
    """Lower the calling thread's CPU priority by ``increment`` nice steps (Linux: nice
    is per thread; threads it starts inherit it). Best effort: where the platform has
    no per-thread priority, nothing changes."""
    if increment <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, now + increment))
    except OSError as exc:  # e.g. a seccomp filter: the thread keeps its priority
        log.debug("[ckpt] background thread keeps its priority: %s", exc)


def yielding(target: Callable[[], None]) -> Callable[[], None]:
    """``target`` for a thread that first yields the CPU to training (:func:`yield_cpu`)."""

    def run() -> None:
        yield_cpu()
        target()

    return run
