"""Phase one of a save: the state into staging buffers, handed to the local writer.

Apart from :mod:`slurm_ckpt.job.checkpointer` because it is the one step whose length
training waits for (the stall), with its own choices: a state that fits the staging
memory is copied (all of it now, or, ``lazy``, part of it by a background drain) and the
local write goes on in the background; one that does not fit is written on the caller's
thread straight from the tensors (:meth:`slurm_ckpt.job.pipeline.Pipeline.write_now`).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable, Dict, List, Optional, Union

from slurm_ckpt.core.units import format_bytes
from slurm_ckpt.job.bookkeeping import Bookkeeper, SaveRecord
from slurm_ckpt.job.lazy import Drain, defer_mask
from slurm_ckpt.job.payload import Direct, Lazy, Staged
from slurm_ckpt.job.pipeline import Pipeline
from slurm_ckpt.job.staging import StagingArea

log = logging.getLogger(__name__)

__all__ = ["hand_over"]


def _accept_all(_tensor: Any) -> bool:
    return True


def hand_over(
    staging: StagingArea,
    pipe: Pipeline,
    books: Bookkeeper,
    rec: SaveRecord,
    index: Any,
    tensors: List[Any],
    blobs: List[Dict[str, Any]],
    lazy: Union[bool, Callable[[Any], bool]],
    t0: float,
) -> Optional[Drain]:
    """Snapshot ``tensors`` into ``staging`` and submit ``rec`` to ``pipe`` (or write it
    synchronously when it does not fit); ``t0`` is when the save began (its stall).
    Returns the started lazy drain, None when nothing was deferred."""
    step, nbytes = rec.step, rec.nbytes
    t1 = time.monotonic()
    drain: Optional[Drain] = None
    if staging.ensure([b["nbytes"] for b in blobs], tensors):
        mask = defer_mask(tensors, _accept_all if lazy is True else lazy) if lazy else None
        if mask is not None and any(mask):
            staging.snapshot(index, tensors, select=[not m for m in mask])
            drain = Drain(
                functools.partial(staging.snapshot, index, tensors, mask),
                tensors,
                mask,
            ).start()
            rec.payload = Lazy(drain)
        else:
            rec.payload = Staged(staging.snapshot(index, tensors))
        rec.snapshot_s = time.monotonic() - t1
        rec.stall_s = time.monotonic() - t0
        books.emit("snapshot_done", step=step)
        pipe.submit(rec)
    else:
        log.warning(
            "[ckpt] step=%d: %s does not fit the staging memory limit (%s): writing synchronously",
            step,
            format_bytes(nbytes),
            format_bytes(staging.budget(nbytes)),
        )
        rec.synchronous = True
        rec.payload = Direct(index, tensors)
        pipe.write_now(rec)
    return drain
