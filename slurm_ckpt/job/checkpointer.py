"""The in-job checkpoint library: ``Checkpointer``.

::

    ckpt = Checkpointer(local="/nvme/ckpt", pfs="/pfs/ckpt", key="my-run",
                        interval_tokens=50_000_000)      # or Checkpointer.from_env()
    restored = ckpt.restore()                            # None, or .step .tokens .state .tier
    for step, batch in loader:
        ...
        if ckpt.should_save(step=step, tokens=tokens_seen):
            ckpt.save(state, step=step, tokens=tokens_seen)  # returns after the snapshot
        if ckpt.preempted:
            break
    ckpt.close()

A save runs in three phases, so that training stalls only for the first:

1. **snapshot** (caller's thread): the state is copied into reusable staging buffers
   (:mod:`slurm_ckpt.job.staging`); ``save()`` returns. When staging memory is short it
   writes synchronously instead (logged, counted in ``stats.sync_writes``);
2. **local write** (background thread): the staging buffers are written to the local tier
   and committed atomically; recorded in the ledger; local retention applied;
3. **flush** (second background thread): selected checkpoints (``retention.flush_every``;
   always the preemption save and, at ``close()``, the newest) are copied, verified, to
   the PFS with :func:`copy_checkpoint`.

Backpressure: a save never starts while the previous one is still being written locally
(the wait counts as stall). A flush that would start while the previous one still runs
is, with ``flush_policy="skip"`` (default), queued in a single slot that a newer
checkpoint takes over (the displaced one is not flushed: ledger says why); with
``"wait"``, ``save()`` waits for the flush to finish before snapshotting.

Failures: any error of a tier (full disk, I/O error, permission...) during the local
write or the flush is logged, recorded in the ledger (``FAILED`` with the reason) and
counted in :attr:`Checkpointer.stats`; the previous checkpoint stays and training goes
on. Only ``job.max_consecutive_failures`` failed local saves in a row raise
:class:`CheckpointFailed`, from the next ``save()``/``should_save()`` on the caller's
thread (a failing PFS alone never stops training: unflushed checkpoints are kept locally
until they fill the local tier, and then local saves fail).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import functools
import logging
import os
import socket
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Union

from slurm_ckpt.core.commit import AlreadyCommitted
from slurm_ckpt.core.config import Config
from slurm_ckpt.core.names import current_user, node_name, validate_key, validate_user
from slurm_ckpt.core.planner import auto_interval
from slurm_ckpt.core.retention import (
    CkptInfo,
    RetentionPolicy,
    plan_local_deletions,
    selected_for_flush,
)
from slurm_ckpt.core.units import format_bytes
from slurm_ckpt.errors import CkptError, NotFound, TierError, VerifyError
from slurm_ckpt.job.dist import dist_agree
from slurm_ckpt.job.restore import Restored, Restorer, shard_key, shard_prefix
from slurm_ckpt.job.signals import Deadline, SignalFlag
from slurm_ckpt.job.staging import StagingArea, write_direct
from slurm_ckpt.job.state import flatten, index_bytes, layout
from slurm_ckpt.ledger import events
from slurm_ckpt.ledger.ledger import Ledger
from slurm_ckpt.ledger.metrics import refresh_textfile
from slurm_ckpt.ledger.node_status import publish_status
from slurm_ckpt.ledger.record import Record, State
from slurm_ckpt.slurm.env import job_end_time, job_env, resolve_rank
from slurm_ckpt.slurm.requeue import requeue_job, requeue_reason
from slurm_ckpt.tiers.copy import copy_checkpoint
from slurm_ckpt.tiers.registry import tiers_from_config

log = logging.getLogger("slurm_ckpt")

__all__ = [
    "DEFAULT_INTERVAL_TOKENS",
    "CheckpointFailed",
    "CheckpointStats",
    "Checkpointer",
    "Restored",
    "SaveRecord",
]

PathLike = Union[str, "os.PathLike[str]"]

#: The interval when none is configured anywhere.
DEFAULT_INTERVAL_TOKENS = 50_000_000
FLUSH_POLICIES = ("skip", "wait")
#: Assumed save cost for ``interval="auto"`` until the first save has been measured.
BOOTSTRAP_COST_S = 1.0
#: Work planned to end this long before the deadline (clock skew, process teardown).
DEADLINE_MARGIN_S = 5.0
_UNSET: Any = object()


class CheckpointFailed(CkptError):
    """``max_consecutive_failures`` saves in a row failed: stop rather than train on
    with nothing saved."""


@dataclass
class CheckpointStats:
    """Counters and last durations, for logs, metrics and tests (a copy: a snapshot)."""

    saves: int = 0
    committed: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    sync_writes: int = 0
    flushes: int = 0
    flush_failures: int = 0
    flush_skipped: int = 0
    left_to_epilog: int = 0
    stall_s: float = 0.0
    wait_s: float = 0.0
    bytes_written: int = 0
    bytes_flushed: int = 0
    last_snapshot_s: Optional[float] = None
    last_stall_s: Optional[float] = None
    last_local_s: Optional[float] = None
    last_flush_s: Optional[float] = None
    last_step: Optional[int] = None
    last_flushed_step: Optional[int] = None
    last_error: Optional[str] = None


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
    #: "-", "not selected", "queued", "flushing", "done", "skipped", "failed", "left to epilog"
    flush_status: str = "-"
    error: Optional[str] = None
    buffers: Any = field(default=None, repr=False)
    index_data: bytes = field(default=b"", repr=False)
    direct: Any = field(default=None, repr=False)
    meta: Dict[str, Any] = field(default_factory=dict, repr=False)
    logged: bool = field(default=False, repr=False)


#: Progress events after which the node's metrics textfile is rebuilt (never on the
#: caller's thread: these all fire on the background writer and flusher threads).
_METRIC_EVENTS = frozenset({"local_done", "local_failed", "flush_done", "flush_failed"})


def _one_line(text: object) -> str:
    return " ".join(str(text).split())[:500]


def _crossed(every: Optional[int], now: Optional[int], ref: Optional[int]) -> bool:
    """A multiple of ``every`` was reached since ``ref`` (aligned intervals)."""
    return bool(every) and now is not None and ref is not None and now // every > ref // every


def _finish_at_exit(ref: Callable[[], Optional[Checkpointer]]) -> None:
    """At interpreter exit without close(): finish the local write (the background
    threads are daemons and die with the interpreter); flushes are left to the
    epilog/stager, which find them in the ledger as FLUSH_PENDING. A no-op after close()."""
    ckpt = ref()
    if ckpt is None or ckpt._closed:
        return
    with ckpt._cv:
        writing = ckpt._local_job is not None
    if writing:
        log.warning("[ckpt] exiting without close(): finishing the local write")
    ckpt.wait(flush=False)
    with ckpt._cv:
        owed = [r.step for r in ckpt._flush_queue]
        ckpt._flush_queue.clear()
        current = ckpt._flush_current
        ckpt._stop = True
        ckpt._cv.notify_all()
    for step in owed:
        ckpt._set_state(step, "pfs", State.FLUSH_PENDING, "left to epilog")
    if current is not None:
        owed.append(current.step)  # in flight: killed with the interpreter, ledger FLUSHING
    if owed:
        log.warning("[ckpt] exiting without close(): flush of step(s) %s left to the epilog", owed)


class Checkpointer:
    """Fast, verified, tiered checkpoints from inside a training job.

    Standalone (no SLURM, no config file)::

        Checkpointer(local="/nvme/ckpt", pfs="/pfs/ckpt", key="my-run",
                     interval_tokens=50_000_000)

    Interval: any of ``interval_tokens``, ``interval_steps``, ``interval_seconds`` or
    ``interval="auto"`` (Young/Daly from the measured save stall and ``mtbi``); a save is
    due when the first one is reached. Given here, they replace the config's interval
    settings; with none anywhere, every 50M tokens. Token and step intervals are aligned
    to multiples (saves at 50M, 100M, ... also after a restart).

    Other keywords (all optional): ``config`` (a :class:`Config`; else one is built with
    :meth:`Config.standalone` from ``local``/``pfs``), ``mtbi``, ``flush_policy``
    ("skip"/"wait"), ``keep_local``, ``flush_every``, ``signals`` (names; ``[]`` = none),
    ``install_signals``, ``max_consecutive_failures``, ``staging_memory_limit`` (bytes or
    "8GiB"; 0 = auto), ``pfs_bandwidth``, ``ledger_dir``, ``rank``/``world_size``
    (default: ``RANK``/``WORLD_SIZE``, else ``SLURM_PROCID`` and the step's task count),
    ``user``, ``node``, ``job``, ``requeue`` (requeue after a time-limit preemption save),
    ``requeue_fn(reason)``, ``job_state_fn() -> state`` (decides time limit vs
    preemption; e.g. "TIMEOUT"), ``end_time_fn() -> epoch seconds`` (default:
    ``SLURM_JOB_END_TIME``), ``kill_wait_s``, ``signal_lead_s`` (the ``@seconds`` of
    ``--signal``), ``agree(value) -> min over ranks`` (default: torch.distributed if
    initialised), ``on_event(name, info)`` (progress callback, called from the
    background threads too: keep it quick, never call the Checkpointer from it).
    """

    def __init__(
        self,
        local: Optional[PathLike] = None,
        pfs: Optional[PathLike] = None,
        key: Optional[str] = None,
        *,
        config: Optional[Config] = None,
        interval_tokens: Optional[int] = None,
        interval_steps: Optional[int] = None,
        interval_seconds: Optional[Union[float, str]] = None,
        interval: Optional[str] = None,
        mtbi: Optional[Union[float, str]] = None,
        flush_policy: str = "skip",
        keep_local: Optional[int] = None,
        flush_every: Optional[int] = None,
        signals: Optional[Sequence[Union[str, int]]] = None,
        install_signals: bool = True,
        max_consecutive_failures: Optional[int] = None,
        staging_memory_limit: Optional[Union[int, str]] = None,
        pfs_bandwidth: Optional[Union[float, str]] = None,
        ledger_dir: Optional[PathLike] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        user: Optional[str] = None,
        node: Optional[str] = None,
        job: Optional[Union[str, int]] = None,
        requeue: bool = False,
        requeue_fn: Optional[Callable[[str], None]] = None,
        job_state_fn: Optional[Callable[[], Optional[str]]] = None,
        end_time_fn: Optional[Callable[[], Optional[float]]] = _UNSET,
        kill_wait_s: float = 30.0,
        signal_lead_s: Optional[float] = None,
        agree: Optional[Callable[[int], int]] = None,
        on_event: Optional[Callable[[str, Dict[str, Any]], None]] = None,
    ) -> None:
        if key is None:
            raise CkptError("Checkpointer: key= is required (or use Checkpointer.from_env())")
        if flush_policy not in FLUSH_POLICIES:
            raise CkptError(f"flush_policy must be one of {FLUSH_POLICIES}, got {flush_policy!r}")
        self.config = self._build_config(
            config,
            local,
            pfs,
            ledger_dir,
            pfs_bandwidth,
            job={
                "interval_tokens": interval_tokens,
                "interval_steps": interval_steps,
                "interval_seconds": interval_seconds,
                "interval": interval,
                "mtbi": mtbi,
                "signals": None if signals is None else list(signals),
                "max_consecutive_failures": max_consecutive_failures,
                "staging_memory_limit": staging_memory_limit,
            },
            retention={"keep_local": keep_local, "flush_every": flush_every},
        )
        cfg = self.config
        self.rank, self.world_size = resolve_rank(rank, world_size)
        self.key = validate_key(key)
        self.shard_key = validate_key(shard_key(key, self.rank, self.world_size))
        self.prefix = shard_prefix(self.rank)
        self.user = validate_user(user or current_user())
        self.node = node_name(node or socket.gethostname())
        self.job = None if job is None else str(job)
        self.flush_policy = flush_policy
        self.policy = RetentionPolicy(
            keep_local=cfg.retention.keep_local,
            flush_every=cfg.retention.flush_every,
            keep_pfs=cfg.retention.keep_pfs,
            keep_pfs_every_s=cfg.retention.keep_pfs_every,
        )
        jc = cfg.job
        self.interval_tokens = jc.interval_tokens
        self.interval_steps = jc.interval_steps
        self.interval_seconds = jc.interval_seconds
        self.interval_auto = jc.interval == "auto"
        if (
            not (self.interval_tokens or self.interval_steps or self.interval_seconds)
            and not self.interval_auto
        ):
            self.interval_tokens = DEFAULT_INTERVAL_TOKENS
        self.mtbi_s = jc.mtbi
        self.max_consecutive_failures = jc.max_consecutive_failures

        tiers = tiers_from_config(cfg)
        # The warm tier every flush goes to: the PFS, or the object store on a site
        # without one (the ledger keeps its state in the "pfs" slot either way).
        self.local, self.pfs = tiers["local"], tiers[cfg.tiers.warm]
        self.tiers = list(tiers.values())  # restore looks at all of them, hot to cold
        self.local.check_user(self.user)
        try:
            self.pfs.check_user(self.user)
        except TierError as exc:
            log.warning("[ckpt] PFS tier not usable now (flushes will fail): %s", exc)
        self.min_free = cfg.tiers.local.min_free
        self.ledger: Optional[Ledger] = None
        try:
            self.ledger = Ledger(self._ledger_dir(cfg), self.node)
        except CkptError as exc:
            log.warning("[ckpt] running without a ledger: %s", exc)

        self._staging = StagingArea(jc.staging_memory_limit)
        self._flag = SignalFlag()
        self._deadline = Deadline(
            self._flag,
            job_end_time if end_time_fn is _UNSET else end_time_fn,
            kill_wait_s,
            signal_lead_s,
        )
        if install_signals and jc.signals:
            self._flag.install(jc.signals)
        self._requeue = requeue
        self._requeue_fn = requeue_fn or functools.partial(requeue_job, self.job)
        self._job_state_fn = job_state_fn
        self._requeued = False
        self._agree = agree
        self._on_event = on_event
        self._cfg = cfg
        # Every save, flush and failure is also a structured event and a node metric.
        # The event log sits next to the ledger this process uses (the user's own on a
        # secure node) unless the site names a directory; the node's metrics textfile is
        # refreshed only where this process may write it (otherwise the hooks do it).
        self._events: Optional[events.EventLog] = None
        try:
            if cfg.metrics.events_dir is None and self.ledger is not None:
                path = os.path.join(os.fspath(self.ledger.directory), "events.jsonl")
                self._events = events.EventLog(path, self.node)
            else:
                self._events = events.EventLog.from_config(cfg, self.node)
        except (CkptError, OSError, ValueError) as exc:
            log.warning("[ckpt] no event log: %s", exc)
        tdir = cfg.metrics.textfile_dir
        self._metrics_ok = tdir is not None and (
            os.access(tdir, os.W_OK | os.X_OK)
            if os.path.isdir(tdir)
            else os.access(os.path.dirname(os.fspath(tdir)), os.W_OK | os.X_OK)
        )
        self._event_cb = events.listener(self.user, self.shard_key, self.job, self._events)

        self._cv = threading.Condition()
        self._stats = CheckpointStats()
        self._fatal: Optional[CheckpointFailed] = None
        self._local_job: Optional[SaveRecord] = None
        self._flush_queue: Deque[SaveRecord] = collections.deque()
        self._flush_current: Optional[SaveRecord] = None
        self._newest: Optional[SaveRecord] = None
        self._threads: List[threading.Thread] = []
        self._stop = False
        self._closed = False
        self._retention_lock = threading.Lock()
        self._seq = 0
        self._cost_s: Optional[float] = None
        self._flush_rate: Optional[float] = None
        self._preempt_saved = False
        self._ref_step: Optional[int] = None
        self._ref_tokens: Optional[int] = None
        self._ref_time = time.monotonic()
        self._restorer: Optional[Restorer] = None
        self.restored: Optional[Restored] = None
        # A script that ends without close() must not lose the checkpoint being written.
        # threading's own exit hooks run (in reverse order) *before* concurrent.futures
        # refuses new work at shutdown, which the tier writer needs; plain atexit is too
        # late. The private hook exists since Python 3.9; fall back to atexit otherwise.
        hook = functools.partial(_finish_at_exit, weakref.ref(self))
        register = getattr(threading, "_register_atexit", None)
        try:
            if register is None:
                raise RuntimeError("no threading._register_atexit")
            register(hook)
        except RuntimeError:  # pragma: no cover - other interpreters
            atexit.register(hook)

    # ------------------------------------------------------------------ construction
    def _ledger_dir(self, cfg: Config) -> str:
        """The node ledger when this process may write it (root, standalone use), else a
        ledger of this user's own in ``<local root>/<user>/.slurm_ckpt``.

        On a SLURM node the node ledger is root's alone (a user-writable directory that
        root opens files in would be a symlink attack); root's hooks rebuild their view
        from the tiers, so the user's ledger only has to serve this user's process.
        """
        node_dir = os.fspath(cfg.ledger.dir)
        probe = node_dir if os.path.isdir(node_dir) else os.path.dirname(node_dir)
        if os.geteuid() == 0 or os.access(probe, os.W_OK | os.X_OK):
            return node_dir
        udir = os.path.join(os.fspath(cfg.tiers.local.root), self.user)
        with contextlib.suppress(FileExistsError):
            os.mkdir(udir, 0o700)
        return os.path.join(udir, ".slurm_ckpt")

    @staticmethod
    def _build_config(
        config: Optional[Config],
        local: Optional[PathLike],
        pfs: Optional[PathLike],
        ledger_dir: Optional[PathLike],
        pfs_bandwidth: Any,
        job: Dict[str, Any],
        retention: Dict[str, Any],
    ) -> Config:
        """One validated Config from a config (or the tier paths) plus keyword overrides.

        Going through :meth:`Config.from_dict` means keyword arguments are checked with
        the same one-line errors as the site config file.
        """
        if config is None:
            if local is None or pfs is None:
                raise CkptError("Checkpointer: give local= and pfs= (or config=)")
            base = Config.standalone(local, pfs).to_dict()
            source = "<standalone>"
        else:
            base = config.to_dict()
            source = config.source
            if local is not None:
                base["tiers"]["local"]["root"] = os.path.abspath(os.fspath(local))
            if pfs is not None:
                base["tiers"]["pfs"]["root"] = os.path.abspath(os.fspath(pfs))
        if ledger_dir is not None:
            base["ledger"]["dir"] = os.path.abspath(os.fspath(ledger_dir))
        if pfs_bandwidth is not None:
            base["tiers"]["pfs"]["bandwidth_limit"] = pfs_bandwidth
        intervals = ("interval_tokens", "interval_steps", "interval_seconds", "interval")
        if any(job.get(k) is not None for k in intervals):
            for k in intervals:
                base["job"][k] = None
        for section, values in (("job", job), ("retention", retention)):
            for k, v in values.items():
                if v is not None:
                    base[section][k] = v
        return Config.from_dict(base, source)

    @classmethod
    def from_env(
        cls,
        key: Optional[str] = None,
        *,
        config: Optional[Config] = None,
        config_path: Optional[PathLike] = None,
        **kwargs: Any,
    ) -> Checkpointer:
        """The site config (``SLURM_CKPT_CONFIG`` or /etc/slurm-ckpt/config.toml) plus the
        SLURM environment: the key defaults to the job id, the node to SLURMD_NODENAME,
        rank/world to SLURM_PROCID and the step's task count."""
        senv = job_env(required=False)
        cfg = config if config is not None else Config.load(config_path)
        key = key or senv.job_id
        if not key:
            raise CkptError("Checkpointer.from_env(): no key given and SLURM_JOB_ID is not set")
        kwargs.setdefault("job", senv.job_id)
        if senv.node:
            kwargs.setdefault("node", senv.node)
        return cls(key=key, config=cfg, **kwargs)

    def __repr__(self) -> str:
        return (
            f"Checkpointer(key={self.shard_key!r}, local={self.local.root!r}, "
            f"warm={self.pfs.where(self.user, self.shard_key)!r}, "
            f"rank={self.rank}/{self.world_size})"
        )

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ public state
    @property
    def stats(self) -> CheckpointStats:
        with self._cv:
            return dataclasses.replace(self._stats)

    @property
    def preempted(self) -> bool:
        """True once the save that answers a preemption signal has been taken."""
        return self._preempt_saved

    @property
    def signal_received(self) -> Optional[int]:
        """The first preemption signal number received, or None."""
        return self._flag.received

    def time_left(self) -> Optional[float]:
        """Seconds until the job must be done (None when unknown)."""
        return self._deadline.time_left()

    def _emit(self, name: str, **info: Any) -> None:
        if self._events is not None:
            self._event_cb(name, info)
            if name in _METRIC_EVENTS and self.ledger is not None and self._metrics_ok:
                try:  # runs on the background threads that finished the work
                    refresh_textfile(self.ledger, self._cfg)
                except (CkptError, OSError) as exc:
                    log.warning("[ckpt] metrics textfile not written: %s", exc)
        if self._on_event is None:
            return
        try:
            self._on_event(name, info)
        except Exception:  # noqa: BLE001 - a callback must not break checkpointing
            log.exception("[ckpt] on_event callback failed for %s", name)

    def _raise_if_failed(self) -> None:
        if self._fatal is not None:
            raise self._fatal

    # ------------------------------------------------------------------ when to save
    def _auto_period(self) -> float:
        cost = BOOTSTRAP_COST_S if self._cost_s is None else max(self._cost_s, 1e-3)
        return auto_interval(cost, self.mtbi_s)

    def should_save(self, step: Optional[int] = None, tokens: Optional[int] = None) -> bool:
        """True when an interval is reached or a preemption signal arrived (until the
        preemption save is taken). Raises :class:`CheckpointFailed` after too many
        failures in a row."""
        self._raise_if_failed()
        if self._flag.received is not None and not self._preempt_saved:
            return True
        if step is not None and self._ref_step is None:
            self._ref_step = step
        if tokens is not None and self._ref_tokens is None:
            self._ref_tokens = tokens
        if _crossed(self.interval_tokens, tokens, self._ref_tokens):
            return True
        if _crossed(self.interval_steps, step, self._ref_step):
            return True
        period = self._auto_period() if self.interval_auto else self.interval_seconds
        return bool(period) and time.monotonic() - self._ref_time >= period  # type: ignore[operator]

    # ------------------------------------------------------------------ save
    def save(
        self,
        state: Any,
        *,
        step: int,
        tokens: Optional[int] = None,
        meta: Optional[Dict[str, Any]] = None,
        preemption: Optional[bool] = None,
        data_version: Optional[str] = None,
    ) -> SaveRecord:
        """Snapshot ``state`` and return; the write and the flush go on in the background.

        ``state`` may be changed as soon as this returns. A state that cannot be
        serialised raises ``TypeError`` at once; storage failures never raise here
        (see the module docstring), except :class:`CheckpointFailed` after
        ``max_consecutive_failures`` in a row. ``meta`` (JSON-able) goes into the
        manifest. ``preemption`` marks this as the preemption save (always flushed, sets
        :attr:`preempted`); by default it is one when this process received a signal -
        pass True when another rank did (e.g. after an all-reduce of the flags).
        ``data_version`` names the data this state was trained on (any string, e.g.
        :func:`slurm_ckpt.torch.data_version`); it goes into the manifest, ``list`` and
        ``status`` show it, and ``restore(expect_data_version=...)`` checks it.
        """
        if data_version is not None and not isinstance(data_version, str):
            raise CkptError(f"save(): data_version must be a string, got {data_version!r}")
        self._raise_if_failed()
        if self._closed:
            raise CkptError("Checkpointer.save(): already closed")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CkptError(f"save(): step must be a whole number >= 0, got {step!r}")
        t0 = time.monotonic()
        if preemption is None:
            preempt = self._flag.received is not None and not self._preempt_saved
        else:
            preempt = bool(preemption)
        reason = "signal" if preempt else "interval"
        index, tensors = flatten(state)
        blobs = layout(index)
        data = index_bytes(index)
        nbytes = sum(b["nbytes"] for b in blobs) + len(data)
        self._emit("save_start", step=step, reason=reason)
        self._start_threads()

        # Backpressure: the staging buffers are busy until the previous local write ends.
        with self._cv:
            busy = self._local_job is not None
        if busy:
            self._emit("backpressure_wait", step=step)
        with self._cv:
            while self._local_job is not None:
                self._cv.wait()
            flush_busy = self._flush_current is not None or bool(self._flush_queue)
        if self.flush_policy == "wait" and not preempt and flush_busy:
            self._emit("flush_wait", step=step)
            with self._cv:
                while self._flush_current is not None or self._flush_queue:
                    self._cv.wait()
        waited = time.monotonic() - t0

        seq = self._seq
        self._seq += 1
        rec = SaveRecord(
            step=step,
            tokens=tokens,
            seq=seq,
            reason=reason,
            nbytes=nbytes,
            forced=preempt,
            selected=preempt or selected_for_flush(seq, self.policy),
            index_data=data,
            meta=dict(meta or {}),
        )
        if data_version is not None:
            rec.meta["data_version"] = data_version
        self._emit("snapshot_start", step=step)
        t1 = time.monotonic()
        if self._staging.ensure([b["nbytes"] for b in blobs], tensors):
            rec.buffers = self._staging.snapshot(index, tensors)
            rec.snapshot_s = time.monotonic() - t1
            rec.stall_s = time.monotonic() - t0
            self._emit("snapshot_done", step=step)
            with self._cv:
                self._local_job = rec
                self._cv.notify_all()
        else:
            log.warning(
                "[ckpt] step=%d: %s does not fit the staging memory limit (%s): writing "
                "synchronously",
                step,
                format_bytes(nbytes),
                format_bytes(self._staging.budget(nbytes)),
            )
            rec.synchronous = True
            rec.direct = (index, tensors)
            with self._cv:
                self._stats.sync_writes += 1
                self._local_job = rec
            try:
                self._run_local(rec)
            finally:
                with self._cv:
                    self._local_job = None
                    self._cv.notify_all()
            self._apply_retention()
        self._ref_step, self._ref_tokens, self._ref_time = step, tokens, time.monotonic()
        if preempt:
            self._preempt_saved = True
        stall = time.monotonic() - t0
        rec.stall_s = stall
        self._cost_s = stall if self._cost_s is None else 0.5 * (self._cost_s + stall)
        with self._cv:
            self._stats.saves += 1
            self._stats.stall_s += stall
            self._stats.wait_s += waited
            self._stats.last_stall_s = stall
            self._stats.last_snapshot_s = rec.snapshot_s
        self._emit("save_returned", step=step, stall_s=stall)
        return rec

    # ------------------------------------------------------------------ background threads
    def _start_threads(self) -> None:
        if self._threads:
            return
        for name, target in (("ckpt-local", self._local_loop), ("ckpt-flush", self._flush_loop)):
            t = threading.Thread(target=target, name=f"{name}-{self.shard_key}", daemon=True)
            t.start()
            self._threads.append(t)

    def _local_loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and (
                    self._local_job is None
                    or self._local_job.local_status != "pending"
                    or self._local_job.synchronous
                ):
                    self._cv.wait()
                if self._stop:
                    return
                rec = self._local_job
            try:
                self._run_local(rec)
            finally:
                with self._cv:
                    self._local_job = None
                    self._cv.notify_all()
            self._apply_retention()

    def _check_space(self, nbytes: int) -> None:
        free = self.local.free_bytes()
        if free < nbytes + self.min_free:
            raise TierError(
                f"{self.local.where(self.user, self.shard_key)}: not enough space: "
                f"{format_bytes(nbytes)} to write, {format_bytes(free)} free, "
                f"{format_bytes(self.min_free)} to keep free"
            )

    def _write_local(self, rec: SaveRecord) -> None:
        meta = dict(rec.meta)
        meta.update(
            rank=self.rank,
            world_size=self.world_size,
            base_key=self.key,
            reason=rec.reason,
            state_format="slurm_ckpt.state/1",
        )
        kw = dict(tokens=rec.tokens, job=self.job, node=self.node, meta=meta)
        try:
            w = self.local.writer(self.user, self.shard_key, rec.step, **kw)
        except AlreadyCommitted:
            # A step of an abandoned timeline (we restored from an older step and came
            # back to this one): the current state supersedes it.
            log.warning(
                "[ckpt] step=%d already committed on the local tier (older run): replacing it",
                rec.step,
            )
            self.local.delete(self.user, self.shard_key, rec.step)
            w = self.local.writer(self.user, self.shard_key, rec.step, **kw)
        with w:
            if rec.direct is not None:
                index, tensors = rec.direct
                write_direct(w, self.prefix, index, tensors)
            else:
                items = {f"{self.prefix}/{n}": v for n, v in rec.buffers.items()}
                items[f"{self.prefix}/index.json"] = rec.index_data
                w.write_buffers(items)
            w.commit()

    def _run_local(self, rec: SaveRecord) -> None:
        """Phase two of a save (background thread, or the caller's for a sync write)."""
        t0 = time.monotonic()
        try:
            self._check_space(rec.nbytes)
            self._emit("local_start", step=rec.step)
            self._write_local(rec)
        except Exception as exc:  # noqa: BLE001 - a failed save must never kill training
            if not isinstance(exc, (CkptError, OSError)):
                log.exception("[ckpt] step=%d: unexpected error in the local write", rec.step)
            self._local_failed(rec, exc, time.monotonic() - t0)
            return
        finally:
            rec.buffers = None
            rec.direct = None
        rec.local_s = time.monotonic() - t0
        rec.local_status = "committed"
        with self._cv:
            s = self._stats
            s.committed += 1
            s.consecutive_failures = 0
            s.bytes_written += rec.nbytes
            s.last_local_s = rec.local_s
            s.last_step = rec.step
            self._newest = rec
        self._ledger(
            "record_local_commit",
            self.user,
            self.shard_key,
            rec.step,
            rec.nbytes,
            rec.seq,
            self.job,
            rec.selected,
            rec.forced,
            {"snapshot_s": rec.snapshot_s, "local_s": rec.local_s},
        )
        self._emit("local_done", step=rec.step, local_s=rec.local_s)
        if rec.selected:
            self._queue_flush(rec)
        else:
            rec.flush_status = "not selected"
            self._log_save(rec)

    def _local_failed(self, rec: SaveRecord, exc: BaseException, seconds: float) -> None:
        reason = _one_line(exc) or type(exc).__name__
        rec.local_status = "failed"
        rec.local_s = seconds
        rec.error = reason
        with self._cv:
            s = self._stats
            s.failures += 1
            s.consecutive_failures += 1
            s.last_error = reason
            if s.consecutive_failures >= self.max_consecutive_failures:
                self._fatal = CheckpointFailed(
                    f"{s.consecutive_failures} checkpoints failed in a row "
                    f"(job.max_consecutive_failures={self.max_consecutive_failures}); "
                    f"last: {reason}"
                )
        self._set_state(rec.step, "local", State.FAILED, reason, code="local_write_failed")
        self._emit("local_failed", step=rec.step, error=reason)
        self._log_save(rec)

    # ------------------------------------------------------------------ flush
    def _queue_flush(self, rec: SaveRecord) -> None:
        skipped: List[SaveRecord] = []
        with self._cv:
            if self.flush_policy == "skip" and (self._flush_current or self._flush_queue):
                keep: Deque[SaveRecord] = collections.deque()
                for old in self._flush_queue:
                    (keep if old.forced else skipped).append(old)
                self._flush_queue = keep
            rec.flush_status = "queued"
            self._flush_queue.append(rec)
            for old in skipped:
                old.flush_status = "skipped"
                self._stats.flush_skipped += 1
            self._cv.notify_all()
        for old in skipped:
            self._deselect(old.step, f"flush skipped: step {rec.step} is newer")
            self._emit("flush_skipped", step=old.step, newer=rec.step)
            self._log_save(old)
        self._emit("flush_queued", step=rec.step)

    def _flush_loop(self) -> None:
        while True:
            with self._cv:
                while not self._flush_queue and not self._stop:
                    self._cv.wait()
                if not self._flush_queue:
                    return
                rec = self._flush_queue.popleft()
                self._flush_current = rec
                rec.flush_status = "flushing"
            try:
                self._run_flush(rec)
            except Exception:  # noqa: BLE001 - keep the flusher alive whatever happens
                log.exception("[ckpt] step=%d: unexpected error in the flush", rec.step)
            finally:
                with self._cv:
                    self._flush_current = None
                    self._cv.notify_all()
            self._apply_retention()

    def _estimate_flush_s(self, nbytes: int) -> float:
        if self._flush_rate:
            return nbytes / self._flush_rate
        if self.pfs.limiter is not None:
            return nbytes / self.pfs.limiter.rate
        return 0.0

    def _run_flush(self, rec: SaveRecord) -> None:
        left = self._deadline.time_left()
        if left is not None and left - DEADLINE_MARGIN_S < self._estimate_flush_s(rec.nbytes):
            self._leave_to_epilog(rec, left)
            return
        self._emit("flush_start", step=rec.step)
        self._set_state(rec.step, "pfs", State.FLUSHING)
        t0 = time.monotonic()
        try:
            self._replace_stale_pfs(rec.step)
            res = copy_checkpoint(self.local, self.pfs, self.user, self.shard_key, rec.step)
        except Exception as exc:  # noqa: BLE001 - a failed flush must never kill training
            if not isinstance(exc, (CkptError, OSError)):
                log.exception("[ckpt] step=%d: unexpected error in the flush", rec.step)
            reason = _one_line(exc) or type(exc).__name__
            rec.flush_s = time.monotonic() - t0
            rec.error = reason
            with self._cv:
                rec.flush_status = "failed"
                self._stats.flush_failures += 1
                self._stats.last_error = reason
            self._set_state(rec.step, "pfs", State.FAILED, reason, code="flush_failed")
            self._emit("flush_failed", step=rec.step, error=reason)
            self._log_save(rec)
            return
        rec.flush_s = time.monotonic() - t0
        if res.copied_bytes and res.seconds > 0:
            self._flush_rate = res.copied_bytes / res.seconds
        with self._cv:
            rec.flush_status = "done"
            s = self._stats
            s.flushes += 1
            s.bytes_flushed += res.copied_bytes
            s.last_flush_s = rec.flush_s
            s.last_flushed_step = rec.step
        self._set_state(rec.step, "pfs", State.VERIFIED, durations={"flush_s": rec.flush_s})
        self._emit("flush_done", step=rec.step, flush_s=rec.flush_s)
        self._log_save(rec)

    def _replace_stale_pfs(self, step: int) -> None:
        """A different (or corrupt) checkpoint of this step on the PFS is from an abandoned
        timeline (we restored from an older step and trained back to this one): the copy
        engine would refuse to overwrite it, so it goes first."""
        try:
            theirs: Optional[bytes] = self.pfs.manifest(self.user, self.shard_key, step).to_bytes()
        except NotFound:
            return
        except VerifyError:
            theirs = None
        except (TierError, OSError):
            return  # the copy will report the PFS problem
        ours = self.local.manifest(self.user, self.shard_key, step).to_bytes()
        if theirs != ours:
            log.warning("[ckpt] step=%d: replacing an older run's copy on the PFS", step)
            self.pfs.delete(self.user, self.shard_key, step)

    def _leave_to_epilog(self, rec: SaveRecord, left: Optional[float]) -> None:
        with self._cv:
            rec.flush_status = "left to epilog"
            self._stats.left_to_epilog += 1
        self._set_state(rec.step, "pfs", State.FLUSH_PENDING, "left to epilog", forced=True)
        log.warning(
            "[ckpt] step=%d: %s left before the job ends, flush needs ~%.1fs: left to the epilog",
            rec.step,
            "unknown time" if left is None else f"{left:.1f}s",
            self._estimate_flush_s(rec.nbytes),
        )
        self._emit("flush_left_to_epilog", step=rec.step)
        self._log_save(rec)

    # ------------------------------------------------------------------ ledger and retention
    def _ledger(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.ledger is None:
            return None
        try:
            return getattr(self.ledger, method)(*args, **kwargs)
        except (CkptError, OSError) as exc:
            log.warning("[ckpt] ledger %s failed: %s", method, exc)
            return None

    def _set_state(
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
        key = key or self.shard_key
        now = time.time()

        def fn(rec: Optional[Record]) -> Record:
            if rec is None:
                rec = Record(self.user, key, step, job=self.job, created_at=now)
            rec.tiers[tier] = state
            if state is State.VERIFIED:
                rec.verified_at[tier] = now
                rec.committed_at.setdefault(tier, now)
            elif state is State.FLUSHING:
                rec.flush_started_at[tier] = now
                rec.attempts += 1
            if reason is not None:
                rec.error = _one_line(reason)
            for k, v in (durations or {}).items():
                rec.durations[k] = float(v)
            if forced:
                rec.forced = True
                rec.selected_for_flush = True
            return rec

        self._ledger("update", self.user, key, step, fn)
        if code:
            self._ledger("count_failure", code)

    def _deselect(self, step: int, why: str) -> None:
        def fn(rec: Optional[Record]) -> Optional[Record]:
            if rec is None:
                return None
            rec.selected_for_flush = False
            if rec.tiers.get("pfs") == State.FLUSH_PENDING:
                del rec.tiers["pfs"]
            rec.extra["flush_note"] = why
            return rec

        self._ledger("update", self.user, self.shard_key, step, fn)

    def _apply_retention(self) -> None:
        """Delete local checkpoints the retention policy no longer needs; never one that
        still waits for (or is in) its flush."""
        if self.ledger is None:
            return
        with self._retention_lock:
            try:
                records = {r.step: r for r in self.ledger.records(self.user, self.shard_key)}
                with self._cv:
                    busy = {r.step for r in self._flush_queue}
                    if self._flush_current is not None:
                        busy.add(self._flush_current.step)
                    if self._local_job is not None:
                        busy.add(self._local_job.step)
                infos = []
                for info in self.local.steps(self.user, self.shard_key):
                    r = records.get(info.step)
                    if r is not None:
                        ci = r.to_local_info()
                    else:
                        ci = CkptInfo(info.step, wall_time=info.manifest.wall_time, seq=-1)
                    ci.pinned = ci.pinned or info.step in busy
                    infos.append(ci)
                for step in plan_local_deletions(infos, self.policy):
                    self.local.delete(self.user, self.shard_key, step)
                    if step in records:
                        self._ledger(
                            "mark", self.user, self.shard_key, step, "local", State.DELETED
                        )
                    self._emit("local_deleted", step=step)
            except (CkptError, OSError) as exc:
                log.warning("[ckpt] local retention failed: %s", exc)

    # ------------------------------------------------------------------ logging
    def _log_save(self, rec: SaveRecord) -> None:
        """The one line per save, once its fate is known."""
        with self._cv:
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

    # ------------------------------------------------------------------ waiting and closing
    def _wait_for(self, pred: Callable[[], bool], until: Optional[float]) -> bool:
        with self._cv:
            while not pred():
                if until is None:
                    self._cv.wait()
                else:
                    left = until - time.time()
                    if left <= 0:
                        return False
                    self._cv.wait(min(left, 1.0))
            return True

    def wait(self, flush: bool = True, timeout: Optional[float] = None) -> bool:
        """Block until the local write (and, with ``flush``, every queued flush) is done.
        Returns False on timeout."""
        until = None if timeout is None else time.time() + timeout

        def idle() -> bool:
            if self._local_job is not None:
                return False
            return not flush or (self._flush_current is None and not self._flush_queue)

        return self._wait_for(idle, until)

    def close(self) -> CheckpointStats:
        """Wait for the local write and the PFS flushes, flush the newest checkpoint if it
        was not, requeue if asked, and put the signal handlers back.

        After a preemption signal the wait for the flushes ends at the job's deadline
        (minus a margin): flushes still open are left to the epilog (ledger:
        FLUSH_PENDING). The local write is always awaited.
        Never raises for storage problems."""
        if self._closed:
            return self.stats
        self._closed = True
        if self._restorer is not None:
            self._restorer.cancel()  # a weights-first restore whose rest was never asked for
        until = None
        if self._flag.received is not None or self._preempt_saved:
            d = self._deadline.deadline()
            until = None if d is None else d - DEADLINE_MARGIN_S
        # The local write is always awaited: it is the checkpoint that survives a kill.
        self._wait_for(lambda: self._local_job is None, None)
        newest = self._newest
        if newest is not None and newest.flush_status in ("not selected", "skipped"):
            newest.forced = newest.selected = True
            self._set_state(newest.step, "pfs", State.FLUSH_PENDING, forced=True)
            self._queue_flush(newest)
        done = self._wait_for(lambda: self._flush_current is None and not self._flush_queue, until)
        if not done:
            with self._cv:
                open_jobs = list(self._flush_queue)
                self._flush_queue.clear()
                if self._flush_current is not None:
                    open_jobs.append(self._flush_current)
                for rec in open_jobs:
                    if rec.flush_status in ("queued", "flushing"):
                        self._leave_to_epilog(rec, self._deadline.time_left())
        self._maybe_requeue()
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=None if done else 0.1)
        self._flag.uninstall()
        self._staging.close()
        if self.ledger is not None and self._cfg.tiers.pfs is not None:
            try:
                publish_status(self.ledger, self._cfg.tiers.pfs.root)
            except (CkptError, OSError) as exc:
                log.debug("[ckpt] cannot publish node status: %s", exc)
        return self.stats

    def _maybe_requeue(self) -> None:
        if not self._requeue or not self._preempt_saved or self._requeued:
            return
        cause: Optional[str] = None
        if self._job_state_fn is not None:
            try:
                cause = self._job_state_fn()
            except Exception as exc:  # noqa: BLE001 - never fail close() on a provider
                log.warning("[ckpt] job state provider failed: %s", exc)
        why = requeue_reason(
            cause,
            detail=f"checkpoint of step {self._ref_step} saved after signal "
            f"{self._flag.received}, job state {cause}",
        )
        if why is None:
            log.info(
                "[ckpt] not requeueing: job state is %s (only a time limit is requeued here; "
                "SLURM requeues preempted jobs itself)",
                cause or "unknown",
            )
            return
        self._requeued = True
        reason = why
        try:
            self._requeue_fn(reason)
        except Exception as exc:  # noqa: BLE001
            log.error("[ckpt] requeue failed: %s", exc)
        self._emit("requeue", reason=reason)

    # ------------------------------------------------------------------ restore
    def _mark_bad(self, key: str, tier: str, step: int, reason: str) -> None:
        self._set_state(step, tier, State.BAD, reason, code="verify_failed", key=key)

    def _make_restorer(
        self,
        tiers: Optional[Sequence[str]] = None,
        step: Optional[int] = None,
        expect_data_version: Optional[str] = None,
        on_data_change: str = "warn",
    ) -> Restorer:
        return Restorer(
            self.tiers if tiers is None else [t for t in self.tiers if t.name in tiers],
            self.user,
            self.key,
            self.rank,
            self.world_size,
            mark_bad=self._mark_bad,
            agree=self._agree or dist_agree(),
            step=step,
            expect_data_version=expect_data_version,
            on_data_change=on_data_change,
        )

    def restore(
        self,
        weights_only: bool = False,
        *,
        step: Optional[int] = None,
        tiers: Optional[Sequence[str]] = None,
        expect_data_version: Optional[str] = None,
        on_data_change: str = "warn",
    ) -> Optional[Restored]:
        """The newest complete checkpoint that verifies, on any configured tier (local,
        PFS, object store, cold; the fastest that holds it); None when there is none.
        With ``weights_only`` only the model weights (top-level keys such as ``model``)
        are returned as soon as they are read and verified, while the rest of the step is
        read in the background; get it with :meth:`restore_rest` (which may roll back to
        an older step, see there).

        ``step`` restores that step only (e.g. back to three days ago, from the cold
        tier); ``tiers`` limits the tiers looked at (names, e.g. ``["cold"]``).
        ``expect_data_version``: the data version the job has now; a checkpoint trained
        on another one is restored with a warning (``on_data_change="warn"``) or refused
        with :class:`~slurm_ckpt.job.restore.DataVersionMismatch` (``"refuse"``)."""
        if self._restorer is not None:
            self._restorer.cancel()
        self._restorer = self._make_restorer(tiers, step, expect_data_version, on_data_change)
        got = self._restorer.restore(weights_only=weights_only)
        if got is None:
            log.info("[ckpt] restore: no checkpoint of %s found", self.shard_key)
            return None
        self.restored = got
        self._ref_step, self._ref_tokens, self._ref_time = got.step, got.tokens, time.monotonic()
        log.info(
            "[ckpt] restored step=%d tokens=%s from %s (%s in %.3fs)%s",
            got.step,
            got.tokens,
            got.tier,
            format_bytes(got.nbytes),
            got.seconds,
            " weights only" if weights_only else "",
        )
        return got

    def restore_weights(self) -> Optional[Restored]:
        """``restore(weights_only=True)``."""
        return self.restore(weights_only=True)

    def restore_rest(self) -> Restored:
        """Everything but the weights, from the step :meth:`restore_weights` chose.

        If that part of the step fails verification and no other tier holds it with the
        same weights, an older step is restored whole and returned with
        ``rolled_back=True``: its ``state`` has the weights too, apply them again. Raises
        :class:`VerifyError` when no older step verifies either."""
        if self._restorer is None:
            raise CkptError("restore_rest(): call restore(weights_only=True) first")
        got = self._restorer.restore_rest()
        if got.rolled_back:
            self.restored = got
            self._ref_step, self._ref_tokens = got.step, got.tokens
            self._ref_time = time.monotonic()
        return got
