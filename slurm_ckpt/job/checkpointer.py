"""The in-job checkpoint library: ``Checkpointer``.

::

    ckpt = Checkpointer(local="/nvme/ckpt", warm="/pfs/ckpt", key="my-run",
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
2. **local write** and 3. **flush** run in the background
   (:mod:`slurm_ckpt.job.pipeline`, which says how backpressure and failures work).

This module is the facade: it builds the parts - the schedule (:mod:`.schedule`), the
staging area, the pipeline, the bookkeeping (:mod:`.bookkeeping`: ledger, events,
metrics) and the restorer (:mod:`.restore`) - and keeps the public API: ``save``,
``should_save``, ``restore``, ``restore_weights``, ``restore_rest``, ``preempted``,
``wait``, ``close``, ``stats``, ``ram_save``. Saving and the schedule are its own; the
rest it delegates to small objects, one per concept, that it builds once: the restore
side (:class:`~.restoring.Restoring`), waiting and the end of the run
(:class:`~.closing.Closing`), the doors for other checkpoint formats
(:class:`~.seams.Seams`) and the RAM tier (:class:`~.ram_methods.RamDoor`). Each public
method here is a thin, typed call into one of them, with that object's docstring; the
counters are :class:`~slurm_ckpt.job.stats.CheckpointStats`. What the parts need is one
typed :class:`~slurm_ckpt.job.context.JobContext` plus the few parts named in their
constructors, never the Checkpointer itself (no part imports this module).
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import warnings
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, Optional, Sequence, TypeVar, Union

from slurm_ckpt.core.config import Config
from slurm_ckpt.core.names import current_user, node_name, validate_key, validate_user
from slurm_ckpt.core.platform import require_supported_os
from slurm_ckpt.core.retention import RetentionPolicy
from slurm_ckpt.errors import CkptError, TierError
from slurm_ckpt.job.bookkeeping import Bookkeeper, SaveRecord
from slurm_ckpt.job.closing import Closing, finish_at_exit
from slurm_ckpt.job.context import JobContext
from slurm_ckpt.job.dcp_series import DcpSeries
from slurm_ckpt.job.dcp_series import part_key as dcp_part_key
from slurm_ckpt.job.lease import SeriesLease
from slurm_ckpt.job.option_table import docstring_section
from slurm_ckpt.job.options import OPTION_NAMES, UNSET, Options, build_config, resolve_aliases
from slurm_ckpt.job.owed import load_job_config, no_epilog, queue_owed, without_epilog
from slurm_ckpt.job.partner import PartnerLink
from slurm_ckpt.job.partner_open import open_partner
from slurm_ckpt.job.pipeline import CheckpointFailed, Pipeline, Shard
from slurm_ckpt.job.ram_methods import RamDoor, RamSetting, open_ram
from slurm_ckpt.job.replicas import ReplicaCheck
from slurm_ckpt.job.restore import Restored, shard_key, shard_prefix
from slurm_ckpt.job.restoring import Restoring
from slurm_ckpt.job.saved import Saved
from slurm_ckpt.job.saving import Saving
from slurm_ckpt.job.schedule import DEFAULT_INTERVAL_TOKENS, Schedule
from slurm_ckpt.job.seams import Seams
from slurm_ckpt.job.signals import Deadline, SignalFlag, relayed_signal, signal_number
from slurm_ckpt.job.staging import StagingArea
from slurm_ckpt.job.standalone import make_roots, sweep_debris
from slurm_ckpt.job.stats import CheckpointStats
from slurm_ckpt.job.timeline import RankTimeline
from slurm_ckpt.slurm.client import job_end_time_provider
from slurm_ckpt.slurm.env import job_env, replica_rank, resolve_rank
from slurm_ckpt.slurm.requeue import requeue_job
from slurm_ckpt.tiers.base import Tier
from slurm_ckpt.tiers.registry import tiers_from_config

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_INTERVAL_TOKENS",
    "CheckpointFailed",
    "CheckpointStats",
    "Checkpointer",
    "Restored",
    "SaveRecord",
    "Saved",
]

PathLike = Union[str, "os.PathLike[str]"]


_F = TypeVar("_F", bound=Callable[..., Any])


def _doc(of: Union[Callable[..., Any], property]) -> Callable[[_F], _F]:
    """A delegating method takes the docstring of the part's method it calls: written
    once, beside the code, and shown by ``help(Checkpointer)``."""

    def give(method: _F) -> _F:
        method.__doc__ = of.__doc__
        return method

    return give


def _under_slurm() -> bool:
    """Inside a SLURM job (a batch job, an allocation, a step): SIGINT is SLURM's and
    srun's (a status report, a kill), not a Ctrl-C to save on."""
    return bool(os.environ.get("SLURM_JOB_ID") or os.environ.get("SLURM_JOBID"))


class Checkpointer:
    """Fast, verified, tiered checkpoints from inside a training job.

    Standalone (no SLURM, no config file; a laptop needs only ``local``)::

        Checkpointer(local="/nvme/ckpt", warm="/pfs/ckpt", key="my-run", interval_steps=500)

    Under SLURM: :meth:`from_env` (site config, job id, rank, ckpt-srun's signal).
    Every option is keyword-only; given here, a site setting overrides the config's.
    docs/user-guide-options.md explains each one at more length. The options below are
    defined once, in :mod:`slurm_ckpt.job.option_table` (this list is made from it).

    """

    def __init__(
        self,
        local: Optional[PathLike] = None,
        warm: Optional[PathLike] = None,
        key: Optional[str] = None,
        *,
        config: Optional[Config] = None,
        interval_tokens: Optional[int] = None,
        interval_steps: Optional[int] = None,
        interval_seconds: Optional[Union[float, str]] = None,
        interval: Optional[str] = None,
        mtbi: Optional[Union[float, str]] = None,
        signals: Optional[Sequence[Union[str, int]]] = None,
        keep_local: Optional[int] = None,
        flush_every: Optional[int] = None,
        flush_policy: str = "skip",
        max_consecutive_failures: Optional[int] = None,
        staging_memory_limit: Optional[Union[int, str]] = None,
        warm_bandwidth: Optional[Union[float, str]] = None,
        ledger_dir: Optional[PathLike] = None,
        partner: Optional[bool] = None,
        keep_partner: Optional[int] = None,
        partner_bandwidth: Optional[Union[float, str]] = None,
        partner_dir: Optional[PathLike] = None,
        partner_host: Optional[str] = None,
        ram: RamSetting = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        user: Optional[str] = None,
        node: Optional[str] = None,
        job: Optional[Union[str, int]] = None,
        takeover: bool = False,
        install_signals: bool = True,
        requeue: bool = False,
        requeue_fn: Optional[Callable[[str], None]] = None,
        job_state_fn: Optional[Callable[[], Optional[str]]] = None,
        end_time_fn: Optional[Callable[[], Optional[float]]] = UNSET,
        kill_wait_s: float = 30.0,
        signal_lead_s: Optional[float] = None,
        agree: Optional[Callable[[int], int]] = None,
        on_event: Optional[Callable[[str, Dict[str, Any]], None]] = None,
        replicas: Any = None,
        replicated: str = "weights",
        on_suspect: Any = None,
        pfs: Optional[PathLike] = None,
        pfs_bandwidth: Optional[Union[float, str]] = None,
    ) -> None:
        given = dict(locals())
        options = {name: given[name] for name in OPTION_NAMES}
        if key is None:
            raise CkptError("Checkpointer: key= is required (or use Checkpointer.from_env())")
        opts = Options(**options).validate()
        warm = resolve_aliases(warm, opts)
        require_supported_os()
        self.config = cfg = build_config(config, local, warm, opts)
        standalone = config is None
        if standalone:
            make_roots(cfg)
        self.rank, self.world_size = resolve_rank(opts.rank, opts.world_size)
        self._timeline = RankTimeline.from_env(self.rank)  # ckpt-srun's job timeline
        self.key = validate_key(key)
        self.shard_key = validate_key(shard_key(key, self.rank, self.world_size))
        self.prefix = shard_prefix(self.rank)
        self.user = validate_user(opts.user or current_user())
        self.node = node_name(opts.node or socket.gethostname())
        self.job = None if opts.job is None else str(opts.job)
        self.flush_policy = opts.flush_policy
        r = cfg.retention
        self.policy = RetentionPolicy(
            keep_local=r.keep_local,
            flush_every=r.flush_every,
            keep_warm=r.keep_warm,
            keep_warm_every_s=r.keep_warm_every,
        )
        tiers = tiers_from_config(cfg)
        # The warm tier flushes go to (PFS or object store); a laptop (local= alone) has none.
        self.local = tiers["local"]
        self.warm: Optional[Tier] = tiers.get(cfg.tiers.warm)
        self.tiers = list(tiers.values())  # restore looks at all of them, hot to cold
        self.local.check_user(self.user)
        if self.warm is not None:
            try:
                self.warm.check_user(self.user)
            except TierError as exc:
                log.warning("[ckpt] warm tier not usable now (flushes will fail): %s", exc)
        # One writer per series: a second one stops here, before it touches anything. A
        # replica rank of a one-part series (Lightning: only global rank 0 writes) takes
        # the lease at its first save, if it ever saves.
        self._lease = SeriesLease(
            self.local, self.warm, self.user, self.shard_key, self.node, job=self.job,
            takeover=opts.takeover,
        ).owned_by(self)  # fmt: skip
        if not ((opts.rank, opts.world_size) == (0, 1) and replica_rank()):
            self._lease.acquire()
        try:
            self._setup(cfg, opts, standalone)
        except BaseException:
            self._lease.release()
            raise

    def _setup(self, cfg: Config, opts: Options, standalone: bool) -> None:
        """The rest of the construction, once the series' lease is held."""
        if standalone:
            # No site hooks: this Checkpointer alone owns its tiers, so what a killed or
            # interrupted save or flush left there goes now (copies in progress too).
            keys = [self.shard_key, dcp_part_key(self.key, self.rank)]
            for tier in (self.local, self.warm):
                if tier is not None:
                    sweep_debris(tier, self.user, keys)

        self._flag = SignalFlag()
        self._deadline = Deadline(
            self._flag,
            job_end_time_provider(self.job) if opts.end_time_fn is UNSET else opts.end_time_fn,
            opts.kill_wait_s,
            opts.signal_lead_s,
        )
        signals = list(cfg.job.signals)
        if opts.signals is None and "SIGINT" not in signals and not _under_slurm():
            # A laptop: the first Ctrl-C saves at the next step boundary and ends the
            # run cleanly, a second one interrupts at once (job/signals.py).
            signals.append("SIGINT")
        if opts.install_signals and signals:
            self._flag.install(signals)
        self._schedule = Schedule(cfg.job, self._flag)
        self._books = Bookkeeper(cfg, self.user, self.shard_key, self.job, self.node, opts.on_event)
        self.ledger = self._books.ledger
        self._staging = StagingArea(cfg.job.staging_memory_limit)
        self._pipeline = Pipeline(
            self.local,
            self.warm,
            Shard(
                self.user,
                self.shard_key,
                self.key,
                self.prefix,
                self.rank,
                self.world_size,
                self.job,
                self.node,
            ),
            self._books,
            self.policy,
            self._deadline,
            flush_policy=opts.flush_policy,
            min_free=cfg.tiers.local.min_free,
            max_consecutive_failures=cfg.job.max_consecutive_failures,
            lease=self._lease,
        )
        #: What the parts acting for this facade share (:mod:`slurm_ckpt.job.context`).
        self._ctx = JobContext(
            config=cfg, local=self.local, warm=self.warm, tiers=self.tiers, user=self.user,
            key=self.key, shard_key=self.shard_key, prefix=self.prefix, rank=self.rank,
            world_size=self.world_size, job=self.job, node=self.node, policy=self.policy,
            flush_policy=self.flush_policy, lease=self._lease, schedule=self._schedule,
            books=self._books, pipeline=self._pipeline, deadline=self._deadline,
        )  # fmt: skip
        #: Partner copies of this rank's checkpoints on the next node (None: off).
        self.partner: Optional[PartnerLink] = None
        if cfg.partner.enabled:
            self.partner = open_partner(
                cfg,
                self.local,
                self._books,
                user=self.user,
                key=self.shard_key,
                base_key=self.key,
                rank=self.rank,
                world_size=self.world_size,
                node=self.node,
                job=self.job,
                host=opts.partner_host,
            )
            if self.partner is not None:
                self._pipeline.after_commit = self.partner.offer
        if self.warm is not None and no_epilog():
            # No epilog will flush what a run leaves: say so, and take over what an
            # earlier run of this series left (slurm_ckpt.job.owed).
            without_epilog(self._pipeline)
            queue_owed(self._pipeline)
        if opts.replicas is not None and opts.replicas is not False:
            # collective (a gloo group of its own): every rank builds its Checkpointer
            self._pipeline.replicas = ReplicaCheck(
                opts.replicas, self.rank, self.node, scope=opts.replicated
            )
        #: The RAM tier (None: off): snapshots in memory, copies in the partner's.
        self.ram = open_ram(opts.ram, self._ctx, self.partner)
        self._ram_door = RamDoor(self._ctx, self.ram)
        self._restoring = Restoring(
            self._ctx, partner=self.partner, ram=self.ram, agree=opts.agree,
            timeline=self._timeline,
        )  # fmt: skip
        self._seams = Seams(self._ctx, self._restoring)
        self._closing = Closing(
            self._ctx, flag=self._flag, staging=self._staging, restoring=self._restoring,
            seams=self._seams, partner=self.partner, ram=self.ram,
            on_suspect=opts.on_suspect, requeue=opts.requeue,
            requeue_fn=opts.requeue_fn or functools.partial(requeue_job, self.job),
            job_state_fn=opts.job_state_fn,
        )  # fmt: skip
        self._saving = Saving(
            self._ctx, staging=self._staging, timeline=self._timeline, closing=self._closing,
            on_suspect=opts.on_suspect,
        )  # fmt: skip
        # A script that ends without close() must not lose the checkpoint being written.
        finish_at_exit(self._ctx)

    @classmethod
    def from_env(
        cls,
        key: Optional[str] = None,
        *,
        config: Optional[Config] = None,
        config_path: Optional[PathLike] = None,
        **kwargs: Any,
    ) -> Checkpointer:
        """The configuration ``ckpt-slurm`` reads (``config_path``, else
        ``$SLURM_CKPT_CONFIG``, else /etc/slurm-ckpt/config.toml, else - not as root - your
        own ~/.config/slurm-ckpt/config.toml; one log line says which) plus the SLURM
        environment: the key defaults to ``SLURM_CKPT_KEY`` (ckpt-srun exports it),
        else the job id; the node to SLURMD_NODENAME, rank/world to SLURM_PROCID and the
        step's task count. The warning signal ckpt-srun relays (``SLURM_CKPT_SIGNAL``) is
        added to the signals saved on, so the job reacts to it whatever the config lists.
        ``kwargs``: any option of :class:`Checkpointer` (an unknown one is a one-line
        error naming the nearest)."""
        Options.from_kwargs(kwargs)  # a one-line error (with a hint) for a misspelt option
        senv = job_env(required=False)
        cfg = config if config is not None else load_job_config(config_path)
        key = key or os.environ.get("SLURM_CKPT_KEY") or senv.job_id
        if not key:
            raise CkptError("Checkpointer.from_env(): no key given and SLURM_JOB_ID is not set")
        kwargs.setdefault("job", senv.job_id)
        if senv.node:
            kwargs.setdefault("node", senv.node)
        relayed = relayed_signal()
        if relayed is not None:
            signals = list(kwargs.get("signals") or cfg.job.signals)
            if relayed not in {signal_number(s) for s in signals}:
                signals.append(relayed.name)
            kwargs["signals"] = signals
        return cls(key=key, config=cfg, **kwargs)

    @property
    def pfs(self) -> Optional[Tier]:
        """Deprecated (one release): the old name of :attr:`warm`, the warm tier."""
        warnings.warn(
            "Checkpointer.pfs is deprecated, say Checkpointer.warm", DeprecationWarning, 2
        )
        return self.warm

    def __repr__(self) -> str:
        return (
            f"Checkpointer(key={self.shard_key!r}, local={self.local.root!r}, "
            f"warm={None if self.warm is None else self.warm.where(self.user, self.shard_key)!r}, "
            f"rank={self.rank}/{self.world_size})"
        )

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ public state
    @property
    def stats(self) -> CheckpointStats:
        """This run's counters (saves, stalls, flushes, failures; the RAM tier's too)."""
        return self._closing.stats()

    @property
    def preempted(self) -> bool:
        """True once the save that answers a preemption signal has been taken."""
        return self._schedule.preempt_saved

    @property
    def signal_received(self) -> Optional[int]:
        """The first preemption signal number received, or None."""
        return self._flag.received

    @property
    def interval_tokens(self) -> Optional[int]:
        return self._schedule.interval_tokens

    @property
    def interval_steps(self) -> Optional[int]:
        return self._schedule.interval_steps

    @property
    def interval_seconds(self) -> Optional[float]:
        return self._schedule.interval_seconds

    def time_left(self) -> Optional[float]:
        """Seconds until the job must be done (None when unknown)."""
        return self._deadline.time_left()

    # ------------------------------------------------------------------ save
    @_doc(Saving.should_save)
    def should_save(self, step: Optional[int] = None, tokens: Optional[int] = None) -> bool:
        return self._saving.should_save(step, tokens)

    @_doc(Saving.save)
    def save(
        self,
        state: Any,
        *,
        step: int,
        tokens: Optional[int] = None,
        meta: Optional[Dict[str, Any]] = None,
        preemption: Optional[bool] = None,
        data_version: Optional[str] = None,
        lazy: Union[bool, Callable[[Any], bool]] = False,
    ) -> Saved:
        return self._saving.save(
            state, step=step, tokens=tokens, meta=meta, preemption=preemption,
            data_version=data_version, lazy=lazy,
        )  # fmt: skip

    # ------------------------------------------------------------------ the RAM tier
    @_doc(RamDoor.ram_save)
    def ram_save(
        self,
        state: Any,
        *,
        step: int,
        tokens: Optional[int] = None,
        meta: Optional[Dict[str, Any]] = None,
        force: bool = False,
    ) -> bool:
        return self._ram_door.ram_save(state, step=step, tokens=tokens, meta=meta, force=force)

    @_doc(RamDoor.guard_commits)
    def guard_commits(self, guard: Callable[[], None]) -> None:
        self._ram_door.guard_commits(guard)

    # ------------------------------------------------------------------ restore
    @property
    def restored(self) -> Optional[Restored]:
        """What the newest restore (``restore``, ``restore_rest``, ``restore_path``)
        returned; None before one found something."""
        return self._restoring.restored

    @_doc(Restoring.restore)
    def restore(
        self,
        weights_only: bool = False,
        *,
        step: Optional[int] = None,
        tiers: Optional[Sequence[str]] = None,
        expect_data_version: Optional[str] = None,
        on_data_change: str = "warn",
        lineage: Optional[str] = None,
        replicas: Any = None,
    ) -> Optional[Restored]:
        return self._restoring.restore(
            weights_only, step=step, tiers=tiers, expect_data_version=expect_data_version,
            on_data_change=on_data_change, lineage=lineage, replicas=replicas,
        )  # fmt: skip

    @_doc(Restoring.restore_weights)
    def restore_weights(self) -> Optional[Restored]:
        return self._restoring.restore_weights()

    @_doc(Restoring.restore_rest)
    def restore_rest(self) -> Restored:
        return self._restoring.restore_rest()

    @_doc(Restoring.pin_last_healthy)
    def pin_last_healthy(self, step: int) -> None:
        self._restoring.pin_last_healthy(step)

    @property
    @_doc(Restoring.last_healthy)
    def last_healthy(self) -> Optional[int]:
        return self._restoring.last_healthy

    # ------------------------------------------------------------------ other formats
    @_doc(Seams.output)
    def output(
        self,
        *,
        step: int,
        tokens: Optional[int] = None,
        meta: Optional[Dict[str, Any]] = None,
        preemption: Optional[bool] = None,
    ) -> ContextManager[Path]:
        return self._seams.output(step=step, tokens=tokens, meta=meta, preemption=preemption)

    @_doc(Seams.adopt)
    def adopt(
        self,
        step: int,
        path: PathLike,
        *,
        tokens: Optional[int] = None,
        meta: Optional[Dict[str, Any]] = None,
        preemption: Optional[bool] = None,
    ) -> Saved:
        return self._seams.adopt(step, path, tokens=tokens, meta=meta, preemption=preemption)

    @_doc(Seams.restore_path)
    def restore_path(
        self,
        *,
        step: Optional[int] = None,
        tiers: Optional[Sequence[str]] = None,
        expect_data_version: Optional[str] = None,
        on_data_change: str = "warn",
    ) -> Optional[Path]:
        return self._seams.restore_path(
            step=step, tiers=tiers, expect_data_version=expect_data_version,
            on_data_change=on_data_change,
        )  # fmt: skip

    @property
    @_doc(Seams.preemption_pending)
    def preemption_pending(self) -> bool:
        return self._seams.preemption_pending

    @_doc(Seams.mark_preemption_saved)
    def mark_preemption_saved(self, step: int, tokens: Optional[int] = None) -> None:
        self._seams.mark_preemption_saved(step, tokens)

    @_doc(Seams.dcp_writer)
    def dcp_writer(
        self,
        *,
        step: int,
        tokens: Optional[int] = None,
        meta: Optional[Dict[str, Any]] = None,
        preemption: Optional[bool] = None,
    ) -> Any:
        return self._seams.dcp_writer(step=step, tokens=tokens, meta=meta, preemption=preemption)

    @_doc(Seams.dcp_reader)
    def dcp_reader(
        self,
        *,
        step: Optional[int] = None,
        process_group: Any = None,
        no_dist: bool = False,
        ranged: bool = False,
    ) -> Any:
        return self._seams.dcp_reader(
            step=step, process_group=process_group, no_dist=no_dist, ranged=ranged
        )

    @property
    def _dcp(self) -> Optional[DcpSeries]:
        """The DCP part series (None before the first ``dcp_writer()``), for tests."""
        return self._seams.dcp

    # ------------------------------------------------------------------ waits and the end
    @_doc(Closing.wait_snapshot)
    def wait_snapshot(self) -> float:
        return self._closing.wait_snapshot()

    @_doc(Closing.wait)
    def wait(self, flush: bool = True, timeout: Optional[float] = None) -> bool:
        return self._closing.wait(flush, timeout)

    @_doc(Closing.close)
    def close(self) -> CheckpointStats:
        return self._closing.close()


# The options part of help(Checkpointer), from the one definition of the options.
Checkpointer.__doc__ = (Checkpointer.__doc__ or "").rstrip(" ") + docstring_section()
