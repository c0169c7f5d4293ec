"""What a hook run leaves for the operator's screen: a ``hook`` event and a fresh textfile.

Why here: the prolog, the epilog and every stager pass must each be visible on the
dashboard (``slurm_ckpt_hook_success``, ``..._hook_seconds``, ``..._hook_last_run_...``)
and in the alerts (a failing hook), and the node's textfile must show what the run changed
(flush queue, checkpoints keeping the node drained). Recording is never fatal: a hook's
own work matters more than its metrics, so a failure to record is logged and dropped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Iterator

from slurm_ckpt.core.config import Config
from slurm_ckpt.errors import CkptError
from slurm_ckpt.ledger.events import EventLog, events_path
from slurm_ckpt.ledger.ledger import Ledger
from slurm_ckpt.ledger.metrics import refresh_textfile

__all__ = ["note_hook", "recorded"]

log = logging.getLogger(__name__)


def note_hook(cfg: Config, node: str, hook: str, seconds: float, ok: bool) -> None:
    """One ``hook`` event, then the node's textfile rebuilt (both optional by config).

    Nothing is created on the way: the ledger directory (by default below the local
    tier's root) is the hooks' to make when the tier is sound. A prolog that failed
    because that root is missing must leave it missing, or the stager would find a tier
    and put the node back in service."""
    ledger_dir = os.fspath(cfg.ledger.dir)
    events = events_path(cfg, node)
    if os.path.isdir(os.path.dirname(os.fspath(events))):
        try:
            EventLog.from_config(cfg, node).emit(
                "hook", hook=hook, seconds=round(seconds, 3), ok=ok
            )
        except (CkptError, OSError, ValueError) as exc:
            log.warning("hook event not logged: %s", exc)
    if os.path.isdir(ledger_dir):
        try:
            refresh_textfile(Ledger(cfg.ledger.dir, node), cfg)
        except (CkptError, OSError, ValueError) as exc:
            log.warning("metrics textfile not refreshed: %s", exc)


@contextlib.contextmanager
def recorded(cfg: Config, node: str, hook: str) -> Iterator[None]:
    """Time the block; it succeeded unless it raised (the exception goes on)."""
    t0 = time.monotonic()
    ok = False
    try:
        yield
        ok = True
    finally:
        note_hook(cfg, node, hook, time.monotonic() - t0, ok)
