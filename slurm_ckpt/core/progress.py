"""The progress callback that long operations accept (``progress=``).

Operations (verify, copy, gc, flush, drill) never print. A caller that wants to show
progress passes ``progress``: a function called with the number of bytes just processed,
possibly from several worker threads at once (so it must be thread-safe and cheap).
``None`` means nobody is watching.
"""

from __future__ import annotations

from typing import Callable, Optional

__all__ = ["ProgressFn", "report"]

#: ``progress(nbytes)``: ``nbytes`` more bytes are done.
ProgressFn = Callable[[int], None]


def report(progress: Optional[ProgressFn], nbytes: int) -> None:
    """Call ``progress(nbytes)`` if there is a callback."""
    if progress is not None and nbytes:
        progress(nbytes)
