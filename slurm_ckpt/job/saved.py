"""What ``Checkpointer.save()`` hands back, and the checks of its arguments.

Why a separate, frozen record: the pipeline's own :class:`~slurm_ckpt.job.bookkeeping.
SaveRecord` carries staging buffers and changes as the background phases run; a user who
keeps it would hold memory and read half-updated internals. :class:`Saved` is what a
training loop needs to log (the step, the size, the stall), fixed when ``save()`` returns.
The background phases are followed with ``wait()``, ``stats`` and ``on_event``.

Why check at the call: a save whose manifest can never be written (``step=2**70``, a
meta that is not JSON) used to return normally and fail later on a background thread,
far from the line that caused it. Every argument is checked here, before the snapshot.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, Optional

from slurm_ckpt.core.layout import MAX_STEP
from slurm_ckpt.errors import CkptError

__all__ = ["MAX_TOKENS", "Saved", "check_save_args"]

#: Tokens are stored as a signed 64-bit number (manifest, ledger).
MAX_TOKENS = 2**63 - 1


@dataclass(frozen=True)
class Saved:
    """One save, as ``Checkpointer.save()`` returned it (the snapshot is taken)."""

    #: The step saved.
    step: int
    #: The tokens seen, as given to ``save()`` (None when not given).
    tokens: Optional[int]
    #: Bytes of the checkpoint (payload plus its index).
    nbytes: int
    #: Seconds training stood still for this save (wait for the previous write + snapshot).
    stall_s: float
    #: True when this save answers a preemption signal or the job's near end: it is
    #: always flushed, and ``preempted`` is True afterwards.
    preemption: bool
    #: True when the state did not fit the staging memory and was written before returning.
    synchronous: bool
    #: Bytes a lazy snapshot was still copying in the background when ``save()`` returned
    #: (0 for an eager one): see :mod:`slurm_ckpt.job.lazy`.
    deferred_bytes: int = 0


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_save_args(
    step: Any, tokens: Any, meta: Any, preemption: Any, data_version: Any
) -> Dict[str, Any]:
    """Raise a one-line :class:`CkptError` for an argument ``save()`` cannot honour; return
    ``meta`` as a plain dict."""
    if not _whole(step) or not 0 <= step <= MAX_STEP:
        raise CkptError(f"save(): step must be a whole number 0..{MAX_STEP}, got {step!r}")
    if tokens is not None and (not _whole(tokens) or not 0 <= tokens <= MAX_TOKENS):
        raise CkptError(f"save(): tokens must be a whole number 0..{MAX_TOKENS}, got {tokens!r}")
    if preemption is not None and not isinstance(preemption, bool):
        raise CkptError(f"save(): preemption must be True, False or None, got {preemption!r}")
    if data_version is not None and not isinstance(data_version, str):
        raise CkptError(f"save(): data_version must be a string, got {data_version!r}")
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise CkptError(f"save(): meta must be a dict, got {type(meta).__name__}")
    try:
        json.dumps(meta, allow_nan=False, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise CkptError(f"save(): meta must be JSON (str keys, finite numbers): {exc}") from None
    return dict(meta)
