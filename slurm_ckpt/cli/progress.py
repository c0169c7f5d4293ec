"""Progress bars for long operator work: bytes, rate and ETA, on stderr, only on a TTY.

Operations never print; they take an optional ``progress`` callback
(:data:`slurm_ckpt.core.progress.ProgressFn`: called with the number of bytes just
processed, from any thread). The commands wrap it::

    with ByteProgress("verify", total=nbytes) as bar:
        tier.verify(user, key, step, progress=bar.advance)

When stderr is not a terminal (a pipe, a log file, cron) nothing is drawn and
:meth:`ByteProgress.advance` costs a counter update, so scripts see exactly the output
they saw before. ``--json``/``--parsable`` do not change that: the bar is on stderr.
``$SLURM_CKPT_PROGRESS=0`` turns bars off, ``=1`` forces them (tests).
"""

from __future__ import annotations

import os
import sys
import threading
from types import TracebackType
from typing import Any, Optional, Type

__all__ = ["ByteProgress", "progress_enabled"]


def progress_enabled() -> bool:
    """Draw bars? Only when stderr is a terminal (or ``$SLURM_CKPT_PROGRESS`` says)."""
    forced = os.environ.get("SLURM_CKPT_PROGRESS", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    try:
        return bool(sys.stderr.isatty())
    except (AttributeError, ValueError, OSError):
        return False


class ByteProgress:
    """One bar (bytes done / total, rate, ETA) that the operation advances by bytes.

    ``total`` may be None (unknown: gc verifies only what it has to); the bar then
    shows bytes and rate without an ETA. :meth:`set_description` names the item being
    worked on (``alice/run step 42``). The bar is removed when done (``transient``), so
    the command's own output follows on a clean screen.
    """

    def __init__(
        self, description: str, total: Optional[int] = None, enabled: Optional[bool] = None
    ) -> None:
        self.description = description
        self.total = total
        self.enabled = progress_enabled() if enabled is None else enabled
        self.done = 0
        self._lock = threading.Lock()
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> ByteProgress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(binary_units=True),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self._progress.start()
            self._task = self._progress.add_task(self.description, total=self.total)
        return self

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def advance(self, nbytes: int) -> None:
        """Count ``nbytes`` more bytes done (thread-safe; the operations' callback)."""
        with self._lock:
            self.done += int(nbytes)
        if self._progress is not None:
            self._progress.update(self._task, advance=int(nbytes))

    def set_total(self, total: int) -> None:
        """The total once the operation knows it (a restore, when it has picked its copy):
        the bar gains its percentage and ETA."""
        self.total = int(total)
        if self._progress is not None:
            self._progress.update(self._task, total=self.total)

    def set_description(self, text: str) -> None:
        self.description = text
        if self._progress is not None:
            self._progress.update(self._task, description=text)
