"""Crash points: where tests kill a writer to prove that no crash loses or fakes data.

Every step of the commit and copy protocols that changes durable state calls
:func:`crashpoint`. Normally that is one global check. When the environment variable
``SLURM_CKPT_CRASH_AT=N`` is set (tests only), the process SIGKILLs itself at the N-th
crash point it reaches, so a test can enumerate every point of a save or copy
deterministically instead of hoping a random kill lands somewhere interesting.
"""

from __future__ import annotations

import os
import signal
import threading

_TARGET = int(os.environ.get("SLURM_CKPT_CRASH_AT", "0") or 0)
_count = 0
_lock = threading.Lock()


def crashpoint(label: str) -> None:
    """Die here with SIGKILL if this is the crash point a test asked for."""
    if not _TARGET:
        return
    global _count
    with _lock:
        _count += 1
        hit = _count == _TARGET
    if hit:
        log = os.environ.get("SLURM_CKPT_CRASH_LOG")
        if log:
            with open(log, "a") as fh:
                fh.write(f"{_TARGET} {label}\n")
        os.kill(os.getpid(), signal.SIGKILL)
