"""Crash points: where tests kill a writer to prove that no crash loses or fakes data.

Every step of the commit and copy protocols that changes durable state calls
:func:`crashpoint`. Normally that is one global check. When the environment variable
``SLURM_CKPT_CRASH_AT=N`` is set (tests only), the process SIGKILLs itself at the N-th
crash point it reaches, so a test can enumerate every point of a save or copy
deterministically instead of hoping a random kill lands somewhere interesting.

``SLURM_CKPT_PAUSE_AT=<label>`` with ``SLURM_CKPT_PAUSE_FILE=<path>`` (tests only) makes
the first crash point of that label in a process a *pause* instead: it creates
``<path>.paused`` and waits (at most :data:`PAUSE_MAX_S`) until ``<path>.go`` exists, so
that a test can run another writer while this one stands at a known point of its
protocol (two nodes copying one step at once).
"""

from __future__ import annotations

import os
import signal
import threading
import time

_TARGET = int(os.environ.get("SLURM_CKPT_CRASH_AT", "0") or 0)
_PAUSE_AT = os.environ.get("SLURM_CKPT_PAUSE_AT", "")
_count = 0
_lock = threading.Lock()
_paused = False
#: The longest a pause waits for its go (a test that never says go fails, never hangs).
PAUSE_MAX_S = 120.0


def _pause() -> None:
    """The first pause point of this process: ``<file>.paused``, then wait for ``.go``."""
    global _paused
    with _lock:
        if _paused:
            return
        _paused = True
    path = os.environ.get("SLURM_CKPT_PAUSE_FILE", "")
    if not path:
        return
    with open(path + ".paused", "w") as fh:
        fh.write(str(os.getpid()))
    end = time.monotonic() + PAUSE_MAX_S
    while not os.path.exists(path + ".go") and time.monotonic() < end:
        time.sleep(0.01)


def crashpoint(label: str) -> None:
    """Die here with SIGKILL if this is the crash point a test asked for (or pause, see
    the module docstring)."""
    if _PAUSE_AT and label == _PAUSE_AT:
        _pause()
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
