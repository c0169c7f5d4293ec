"""What ``close()`` shows while it waits: a bar on a terminal, a log line otherwise.

Why: ``close()`` waits for the local write and the flushes (10 s for 800 MiB is
ordinary), and a silent wait of that length reads as a hang. A wait shorter than a
second shows nothing. After that, on a terminal (stderr is a TTY, or
``$SLURM_CKPT_PROGRESS=1``) a one-line bar is redrawn in place: bytes written and copied
of what was owed, and the time waited; it is erased when the wait ends, and one log line
says how long it took. Elsewhere (a batch job's output file, ``$SLURM_CKPT_PROGRESS=0``)
there is the log line when the wait starts and the one when it ends - no carriage
returns in a log file.

The byte counts come from the pipeline: what is owed (the pending local write, the
flush being copied and those queued) and how much the copy has moved, which the
flusher reports chunk by chunk (:func:`slurm_ckpt.node.flush_engine.copy_in_process`'s
``progress``). Apart from :mod:`.closing` because drawing is its own concern; the job
layer cannot use the command line's bars (:mod:`slurm_ckpt.cli.progress`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Optional, TextIO, Tuple

from slurm_ckpt.core.units import format_bytes

log = logging.getLogger(__name__)

__all__ = ["CloseProgress", "MovedBytes", "bar_enabled", "render"]


class MovedBytes:
    """The bar's counter: bytes written and copied since the start, and how much of the
    flush running now is copied. Kept here, beside the bar that reads it, because the
    pipeline only reports bytes; what is owed is the pipeline's to say (:meth:`counts`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._moved = 0
        self._copying = 0

    def wrote(self, nbytes: int) -> None:
        """A local write of ``nbytes`` committed."""
        with self._lock:
            self._moved += nbytes

    def copied(self, nbytes: int) -> None:
        """The flusher's progress: ``nbytes`` more copied (from the copy's threads)."""
        with self._lock:
            self._moved += nbytes
            self._copying += nbytes

    def flush_starts(self) -> None:
        with self._lock:
            self._copying = 0

    def counts(self, owed: int, current: Optional[int]) -> Tuple[int, int]:
        """``(moved, owed)``, with what is left of the running flush of ``current`` bytes
        (None: none runs) added to ``owed``."""
        with self._lock:
            if current is not None:
                owed += max(0, current - self._copying)
            return self._moved, owed


#: close() shows anything only once it waited this long (seconds).
WAIT_NOTE_S = 1.0
#: How often the bar is redrawn (seconds).
REDRAW_S = 0.25
BAR_WIDTH = 24


def bar_enabled(stream: Optional[TextIO] = None) -> bool:
    """A bar only on a terminal (``$SLURM_CKPT_PROGRESS``: 0 never, 1 always)."""
    forced = os.environ.get("SLURM_CKPT_PROGRESS", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    try:
        return bool((stream or sys.stderr).isatty())
    except (AttributeError, ValueError, OSError):
        return False


def render(done: int, total: int, waited_s: float) -> str:
    """One line of the bar: ``[ckpt] close(): [#####.....]  45%  360 MiB / 800 MiB  3.1s``."""
    frac = 1.0 if total <= 0 else min(1.0, max(0.0, done / total))
    full = int(round(frac * BAR_WIDTH))
    return (
        f"[ckpt] close(): [{'#' * full}{'.' * (BAR_WIDTH - full)}] {frac * 100:3.0f}%  "
        f"{format_bytes(done)} / {format_bytes(total)}  {waited_s:.1f}s"
    )


class CloseProgress:
    """Shown while ``close()`` waits (a context manager around the wait).

    ``owed() -> (done, total)``: bytes the pipeline has written or copied since the wait
    began, and what it owed in all (it may grow: close() queues the newest checkpoint's
    flush once the local write ends)."""

    def __init__(
        self,
        owed: Callable[[], Tuple[int, int]],
        *,
        stream: Optional[TextIO] = None,
        enabled: Optional[bool] = None,
        note_after_s: float = WAIT_NOTE_S,
    ) -> None:
        self.owed = owed
        self.stream = stream or sys.stderr
        self.bar = bar_enabled(self.stream) if enabled is None else enabled
        self.note_after_s = note_after_s
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._drawn = 0  # width of the line on screen (to erase it)
        self.t0 = 0.0
        #: Lines drawn (tests read it: the bar did show).
        self.frames = 0

    def __enter__(self) -> CloseProgress:
        self.t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="ckpt-close-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        waited = time.monotonic() - self.t0
        if self._drawn:
            self._write("\r" + " " * self._drawn + "\r")
        if waited > self.note_after_s:
            log.info("[ckpt] close(): done waiting after %.1fs", waited)

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken stderr: nothing to show on
            self._stop.set()

    def _run(self) -> None:
        if self._stop.wait(self.note_after_s):
            return
        if not self.bar:
            log.info("[ckpt] close(): waiting for the local write and the flushes")
            return
        while True:
            try:
                done, total = self.owed()
            except Exception:  # noqa: BLE001 - a bar must never break close()
                return
            line = render(done, max(total, done), time.monotonic() - self.t0)
            pad = max(0, self._drawn - len(line))
            self._write("\r" + line + " " * pad)
            self._drawn = len(line)
            self.frames += 1
            if self._stop.wait(REDRAW_S):
                return
