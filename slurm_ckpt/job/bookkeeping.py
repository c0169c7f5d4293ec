"""What a Checkpointer leaves behind besides checkpoints: ledger states, events, metrics
and one log line per save.

The ledger is a cache of the tiers and the events are for humans and dashboards: none of
it may ever fail a save. Every call here logs what went wrong and carries on.

Where things go: the node's ledger when this process may write it (root, standalone
use), else a ledger of this user's own in ``<local root>/<user>/.slurm_ckpt`` (on a
SLURM node the node ledger is root's alone, and root's hooks rebuild their view from the
tiers). The event log sits next to that ledger unless the site names a directory; the
node's metrics textfile is refreshed only where this process may write it (otherwise
the hooks do it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

from slurm_ckpt.core.config import Config
from slurm_ckpt.core.units import format_bytes
from slurm_ckpt.errors import CkptError
from slurm_ckpt.job.payload import Payload
from slurm_ckpt.ledger import events
from slurm_ckpt.ledger.ledger import Ledger
from slurm_ckpt.ledger.metrics import refresh_textfile
from slurm_ckpt.ledger.record import WARM_SLOT, Record, State, one_line
from slurm_ckpt.ledger.user_status import publish_user_status

log = logging.getLogger(__name__)

__all__ = ["Bookkeeper", "SaveRecord"]

#: Progress events after which the node's metrics textfile is rebuilt (never on the
#: caller's thread: these all fire on the background writer and flusher threads).
_METRIC_EVENTS = frozenset(
    {"local_done", "local_failed", "flush_done", "flush_failed", "replicas_suspect"}
)


@dataclass
class SaveRecord:
    """One save through its phases (returned by :meth:`Checkpointer.save`)."""

    step: int
    tokens: Optional[int]
    seq: int
    reason: str
    nbytes: int
    forced: bool = False
    selected: bool = False
    synchronous: bool = False
    snapshot_s: float = 0.0
    stall_s: float = 0.0
    local_s: Optional[float] = None
    flush_s: Optional[float] = None
    #: "pending", "committed" or "failed"
    local_status: str = "pending"
    #: "-", "not selected", "queued", "flushing", "done", "skipped", "failed", "left to
    #: epilog" (outside SLURM: "left for the next run", slurm_ckpt.job.owed)
    flush_status: str = "-"
    error: Optional[str] = None
    index_data: bytes = field(default=b"", repr=False)
    #: What the local write writes (:mod:`slurm_ckpt.job.payload`: staged, lazy, direct
    #: or a prepared directory); None before the snapshot and once written.
    payload: Optional[Payload] = field(default=None, repr=False)
    meta: Dict[str, Any] = field(default_factory=dict, repr=False)
    logged: bool = field(default=False, repr=False)
    #: The payload files replicas compare (``replicas=``, :mod:`slurm_ckpt.job.replicas`),
    #: None when they do not; ``agreed``: this save took its part in the exchange.
    replicated: Optional[Tuple[str, ...]] = field(default=None, repr=False)
    agreed: bool = field(default=False, repr=False)


def ledger_dir(cfg: Config, user: str) -> str:
    """The node ledger when this process may write it, else the user's own (see the
    module docstring)."""
    node_dir = os.fspath(cfg.ledger.dir)
    probe = node_dir if os.path.isdir(node_dir) else os.path.dirname(node_dir)
    if os.geteuid() == 0 or os.access(probe, os.W_OK | os.X_OK):
        return node_dir
    udir = os.path.join(os.fspath(cfg.tiers.local.root), user)
    with contextlib.suppress(FileExistsError):
        os.mkdir(udir, 0o700)
    return os.path.join(udir, ".slurm_ckpt")


class Bookkeeper:
    """Ledger, events, metrics and save log lines of one Checkpointer series."""

    def __init__(
        self,
        cfg: Config,
        user: str,
        key: str,
        job: Optional[str],
        node: str,
        on_event: Optional[Callable[[str, Dict[str, Any]], None]] = None,
    ) -> None:
        self.cfg = cfg
        self.user, self.key, self.job, self.node = user, key, job, node
        self.on_event = on_event
        self.ledger: Optional[Ledger] = None
        try:
            self.ledger = Ledger(ledger_dir(cfg, user), node)
        except CkptError as exc:
            log.warning("[ckpt] running without a ledger: %s", exc)
        self.events: Optional[events.EventLog] = None
        try:
            if cfg.metrics.events_dir is None and self.ledger is not None:
                path = os.path.join(os.fspath(self.ledger.directory), "events.jsonl")
                self.events = events.EventLog(path, node)
            else:
                self.events = events.EventLog.from_config(cfg, node)
        except (CkptError, OSError, ValueError) as exc:
            log.warning("[ckpt] no event log: %s", exc)
        tdir = cfg.metrics.textfile_dir
        self.metrics_ok = tdir is not None and (
            os.access(tdir, os.W_OK | os.X_OK)
            if os.path.isdir(tdir)
            else os.access(os.path.dirname(os.fspath(tdir)), os.W_OK | os.X_OK)
        )
        self._event_cb = events.listener(user, key, job, self.events)

    # -- events ------------------------------------------------------------------------
    def emit(self, name: str, **info: Any) -> None:
        """One progress event: the event log, the metrics textfile, the user's callback."""
        self.log_event(name, info)
        self.notify(name, info)

    def log_event(self, name: str, info: Dict[str, Any]) -> None:
        """The event log and metrics part of :meth:`emit` (file writes: milliseconds,
        which is why ``save()`` leaves its own to the background writer)."""
        if self.events is not None:
            self._event_cb(name, info)
            if name in _METRIC_EVENTS and self.ledger is not None and self.metrics_ok:
                try:  # runs on the background threads that finished the work
                    refresh_textfile(self.ledger, self.cfg)
                except (CkptError, OSError) as exc:
                    log.warning("[ckpt] metrics textfile not written: %s", exc)

    def notify(self, name: str, info: Dict[str, Any]) -> None:
        """The user's ``on_event`` callback part of :meth:`emit`."""
        if self.on_event is None:
            return
        try:
            self.on_event(name, info)
        except Exception:  # noqa: BLE001 - a callback must not break checkpointing
            log.exception("[ckpt] on_event callback failed for %s", name)

    # -- ledger ------------------------------------------------------------------------
    def _ledger(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.ledger is None:
            return None
        try:
            return getattr(self.ledger, method)(*args, **kwargs)
        except (CkptError, OSError) as exc:
            log.warning("[ckpt] ledger %s failed: %s", method, exc)
            return None

    def set_state(
        self,
        step: int,
        tier: str,
        state: State,
        reason: Optional[str] = None,
        *,
        code: Optional[str] = None,
        key: Optional[str] = None,
        durations: Optional[Dict[str, float]] = None,
        forced: Optional[bool] = None,
    ) -> None:
        """Set a tier state, creating the record if this node has none (e.g. a failed
        first write, or a PFS copy found bad at restore)."""
        key = key or self.key
        now = time.time()

        def fn(rec: Optional[Record]) -> Record:
            if rec is None:
                rec = Record(self.user, key, step, job=self.job, created_at=now)
            rec.set_state(tier, state, now, reason)
            for k, v in (durations or {}).items():
                rec.durations[k] = float(v)
            if forced:
                rec.forced = rec.selected_for_flush = True
            return rec

        self._ledger("update", self.user, key, step, fn)
        if code:
            self._ledger("count_failure", code)

    def state(self, step: int, tier: str, key: Optional[str] = None) -> Optional[str]:
        """What this node's ledger says of ``step`` on ``tier`` (None: nothing, or no
        ledger): a restore asks before it tells the user that a good copy exists."""
        rec = self._ledger("get", self.user, key or self.key, step)
        return None if rec is None else rec.tiers.get(tier)

    def commit_local(self, rec: SaveRecord) -> None:
        self._ledger(
            "record_local_commit",
            self.user,
            self.key,
            rec.step,
            rec.nbytes,
            rec.seq,
            self.job,
            rec.selected,
            # forced means "must reach the warm tier": never where there is none (a
            # preemption save in laptop mode is kept by keep_local like any other)
            rec.forced and rec.selected,
            {"snapshot_s": rec.snapshot_s, "local_s": rec.local_s},
        )

    def deselect(self, step: int, why: str) -> None:
        """This step will not be flushed after all (a newer one took its place)."""

        def fn(rec: Optional[Record]) -> Optional[Record]:
            if rec is None:
                return None
            rec.selected_for_flush = False
            if rec.tiers.get(WARM_SLOT) == State.FLUSH_PENDING:
                del rec.tiers[WARM_SLOT]
            rec.extra["flush_note"] = why
            return rec

        self._ledger("update", self.user, self.key, step, fn)

    def records(self) -> Dict[int, Record]:
        got = self._ledger("records", self.user, self.key)
        return {r.step: r for r in got or []}

    def publish(self, pfs_root: str) -> None:
        """This user's own status on the PFS (never the node's: that is root's, and what
        ``maint`` decides a reboot on; see :mod:`slurm_ckpt.ledger.user_status`)."""
        if self.ledger is None:
            return
        try:
            publish_user_status(self.ledger, pfs_root, self.user)
        except (CkptError, OSError) as exc:
            log.debug("[ckpt] cannot publish this job's status: %s", exc)

    # -- the log line ------------------------------------------------------------------
    def log_save(self, rec: SaveRecord, lock: Any) -> None:
        """The one line per save, once its fate is known (``lock`` guards ``logged``)."""
        with lock:
            if rec.logged:
                return
            rec.logged = True
        if rec.local_status == "failed":
            local = f"FAILED ({rec.error})"
        else:
            local = "-" if rec.local_s is None else f"{rec.local_s:.3f}s"
        if rec.flush_status == "done" and rec.flush_s is not None:
            flush = f"{rec.flush_s:.3f}s"
        elif rec.flush_status == "failed":
            flush = f"FAILED ({rec.error})"
        else:
            flush = rec.flush_status
        level = logging.WARNING if "FAILED" in local + flush else logging.INFO
        log.log(
            level,
            "[ckpt] step=%d snapshot=%.3fs local=%s flush=%s stall=%.3fs bytes=%s reason=%s%s",
            rec.step,
            rec.snapshot_s,
            local,
            flush,
            rec.stall_s,
            format_bytes(rec.nbytes),
            rec.reason,
            " sync" if rec.synchronous else "",
        )


def reason_of(exc: BaseException) -> str:
    return one_line(exc) or type(exc).__name__
