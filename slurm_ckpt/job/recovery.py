"""In-job recovery: the surviving ranks keep their processes, a hot spare takes the lost
rank's place, and training goes on from the newest step every rank holds.

Why: when a node dies, the other ranks' collectives fail, and today the whole job is
relaunched: every rank pays a cold start, and the lost rank's newest state is its newest
NVMe partner copy, up to two intervals old. Yet every survivor holds the state of the last
completed step in its own memory, and the RAM tier (:mod:`.ram_replica`) holds a copy of
the lost rank's in its partner's memory. So here:

1. **Join** (:meth:`Recovery.join`): the process reads the job's membership
   (:mod:`slurm_ckpt.core.membership`: a recovery directory with one ``epoch-<N>.json``
   per membership, written by ckpt-srun or any launcher through its ``Coordinator``),
   learns its rank from its task number and forms the gloo process group of that epoch
   (rank 0 hosts a TCP store at the epoch's rendezvous; keys under ``epoch-<N>/``), with
   the collective timeout of these options (gloo's own default is 30 minutes: detection
   must never rest on it). A **hot spare** (``SLURM_CKPT_SPARE=1``, the same script)
   says it is ready (``spare-<task>.json``), runs ``prepare()`` (the rank-independent
   part of its Checkpointer: :class:`slurm_ckpt.job.spare_prep.Prebuilt`) and waits
   here, interpreter up, torch imported, model built, for an epoch that names it, or
   for ``end.json`` (then it exits 0 with one log line). Taking a rank then only binds
   the identity. A training rank runs the same ``prepare()`` before its join.
2. **Train** (:meth:`Recovery.run`): each step runs guarded; after it, a RAM snapshot
   (``ram_save``) and, with ``wait_copy``, a wait until its copy is in the partner's
   memory, so that every rank holds the last completed step, and so does its partner.
3. **Recover**: a collective that fails (connection closed, timeout) sends the rank to
   wait, up to ``deadline_s``, for a newer epoch. A rank that is not in it was replaced
   (stopped, partitioned, declared lost): it is **fenced** and exits at once, without
   committing or serving anything. Every other rank re-forms the group of the new epoch
   (the survivors keep their rank numbers and their process), binds the partner link to
   the new epoch (sessions of another epoch never authenticate, in either direction),
   calls ``on_reform(group)`` (re-wrap DDP, re-apply ``fully_shard``), waits at a
   barrier until every rank is there (the re-form ends where the group is first usable:
   what the survivors wait for the spare is re-form time, not restore time), restores the
   newest step every rank holds (the min-reduce of the restore: survivors read their own
   ``ram`` snapshot, a memcpy; the spare the partner's RAM copy, ``partner-ram``, else
   the NVMe partner copy, else the warm tier), and trains on. At most the step in flight
   is lost. Anything else (no newer epoch in time, a failed re-form, nothing to restore)
   raises :class:`RecoveryFailed`: the job falls back to today's relaunch.

Every commit of a rank is also fenced by the membership: before each commit the series'
lease asks whether this process is still in the newest epoch (besides the generation
check every commit makes, :mod:`slurm_ckpt.core.lease`).

Rank 0 records ``in_job_failure``, ``reform_start`` and ``reform_end`` (tier, steps
recomputed, seconds) in the job timeline (:mod:`.timeline`) for ``ckpt-slurm goodput``.
torch is imported only inside the functions that need it.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional

from slurm_ckpt.core.lease import StaleGeneration
from slurm_ckpt.core.membership import (
    RECOVERY_DIR_ENV,
    SPARE_ENV,
    Epoch,
    RecoveryDir,
    Spare,
    task_from_env,
)
from slurm_ckpt.errors import EXIT_FAILED, CkptError
from slurm_ckpt.job.partner_net import EPOCH_ENV, launch_tag, local_host
from slurm_ckpt.job.timeline import RankTimeline

log = logging.getLogger(__name__)

__all__ = ["EXIT_FENCED", "HOST_ENV", "Recovery", "RecoveryFailed", "collective_failure"]

#: Exit status of a fenced process (it was replaced; it commits and serves nothing).
EXIT_FENCED = EXIT_FAILED
#: The address other processes reach this one at (default: the host name's address).
HOST_ENV = "SLURM_CKPT_HOST"
#: How often the recovery directory is looked at while waiting.
POLL_S = 0.05
#: Words of the errors gloo and the TCP store raise when a peer is gone or silent.
_FAILURE_WORDS = (
    "connection closed",
    "connection reset",
    "connection refused",
    "broken pipe",
    "timed out",
    "timeout",
    "gloo",
    "socket",
)


class RecoveryFailed(CkptError):
    """In-job recovery could not go on: the job falls back to a relaunch."""


def collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is what a collective raises when a peer died or stalls (a
    ``torch.distributed`` error, or gloo's RuntimeError naming the connection or a
    timeout), rather than a bug in the training step."""
    dist = sys.modules.get("torch.distributed")
    kinds = tuple(k for k in (getattr(dist, "DistError", None),) if isinstance(k, type))
    if kinds and isinstance(exc, kinds):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc).lower()
        return any(w in text for w in _FAILURE_WORDS)
    return False


@dataclass
class _Reform:
    """One recovery under way (for the timeline and the log)."""

    failed_at: float
    last_step: int
    error: str


class Recovery:
    """In-job recovery of one process (see the module docstring).

    ``directory``: the recovery directory (default ``$SLURM_CKPT_RECOVERY_DIR``).
    ``timeout_s``: the process group's collective timeout (a rank that stalls this long
    is taken for lost). ``deadline_s``: the longest wait for a new membership and for its
    re-form. ``wait_copy``: after each step's RAM snapshot, wait (at most ``timeout_s``)
    until its copy is in the partner's memory: what bounds the loss to the step in
    flight; off, a loss may cost the steps whose copies were still on their way.
    ``prepare``: called once, with no argument, before the rank is known (a hot spare:
    while it waits); its result is :attr:`prepared` (e.g. a
    :class:`~slurm_ckpt.job.spare_prep.Prebuilt`, whose ``checkpointer()`` then binds
    the rank).
    """

    def __init__(
        self,
        directory: Optional[str] = None,
        *,
        timeout_s: float = 30.0,
        deadline_s: float = 300.0,
        wait_copy: bool = True,
        environ: Optional[Mapping[str, str]] = None,
        prepare: Optional[Callable[[], Any]] = None,
    ) -> None:
        env = os.environ if environ is None else environ
        path = directory or env.get(RECOVERY_DIR_ENV, "")
        if not path:
            raise RecoveryFailed(
                f"in-job recovery needs a recovery directory: pass directory= or set "
                f"{RECOVERY_DIR_ENV} (ckpt-srun sets it)"
            )
        for name, v in (("timeout_s", timeout_s), ("deadline_s", deadline_s)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise RecoveryFailed(f"recovery: {name} must be a number of seconds > 0, got {v!r}")
        task = task_from_env(env)
        if task is None:
            raise RecoveryFailed(
                "in-job recovery: this process has no task number (SLURM_PROCID, or "
                "SLURM_CKPT_TASK outside SLURM)"
            )
        self.dir = RecoveryDir(path)
        self.task = task
        self.spare = env.get(SPARE_ENV, "") == "1"
        self.host = env.get(HOST_ENV, "") or local_host()
        self.timeout_s, self.deadline_s = float(timeout_s), float(deadline_s)
        self.wait_copy = wait_copy
        #: The membership this process is in (None before :meth:`join`).
        self.epoch: Optional[Epoch] = None
        self.rank = -1
        self.world_size = 0
        #: The process group of the current epoch (``torch.distributed.group.WORLD``).
        self.group: Any = None
        #: The newest step completed (and snapshotted) here; 0 before the first.
        self.last_step = 0
        #: The in-job recoveries this process went through: the epoch, the step every rank
        #: restored, the tier this rank read it from, the completed steps done again.
        self.history: List[Dict[str, Any]] = []
        #: What the first restore read (``step``, ``tier``; None: a fresh start). For a
        #: spare that took a lost rank's place: the state it took over.
        self.started: Optional[Dict[str, Any]] = None
        self._timeline: Optional[RankTimeline] = None
        self._ckpt: Any = None
        self._prepare = prepare
        #: What ``prepare()`` returned (a spare: built while it waited; None: no prepare).
        self.prepared: Any = None
        #: Seconds ``prepare()`` took (a spare's: before it was needed).
        self.prepare_s = 0.0

    # -- joining -------------------------------------------------------------------------
    def join(self) -> Recovery:
        """Take this process's rank in the job's membership and form its process group.
        A hot spare waits here until an epoch names it (or exits 0 at the job's end)."""
        if self.epoch is not None:
            return self
        if self.spare:
            ep = self._wait_named()
        else:
            self._run_prepare()
            until = time.monotonic() + self.deadline_s
            ep = self._wait_for(lambda e: e.rank_of(self.task) is not None, until)
            if ep is None:
                raise RecoveryFailed(
                    f"in-job recovery: task {self.task} is in no membership of "
                    f"{self.dir.path} after {self.deadline_s:.0f}s"
                )
        self._enter_first(ep)
        return self

    def _enter_first(self, ep: Epoch) -> None:
        """Form the first group of this process. Another member may die while it forms
        (a spare taking a rank while a survivor is lost): then wait, as a survivor does,
        for a newer membership and enter that one if it still names this process (fenced
        if it does not); none in time: :class:`RecoveryFailed`, never a traceback."""
        while True:
            try:
                self._enter(ep)
                return
            except Exception as exc:
                if not collective_failure(exc):
                    raise
                error = " ".join(str(exc).split())[:300] or type(exc).__name__
                _destroy_group()
                log.warning(
                    "[ckpt] task %d: forming membership epoch %d failed (%s): waiting up to "
                    "%.0fs for a new membership",
                    self.task,
                    ep.epoch,
                    error,
                    self.deadline_s,
                )
                until = time.monotonic() + self.deadline_s
                nxt = self._wait_for(lambda e, n=ep.epoch: e.epoch > n, until)
                if nxt is None:
                    raise RecoveryFailed(
                        f"task {self.task}: forming membership epoch {ep.epoch} failed "
                        f"({error}) and no newer one came within {self.deadline_s:.0f}s: "
                        "falling back to a relaunch"
                    ) from exc
                if nxt.rank_of(self.task) is None:
                    was = ep.rank_of(self.task)
                    self.epoch, self.rank = ep, -1 if was is None else was
                    self._fenced(nxt)
                ep = nxt

    def _wait_named(self) -> Epoch:
        self.dir.write_spare(Spare(self.task, self.host, os.getpid()))
        log.info("[ckpt] hot spare (task %d) ready: waiting for a rank to take", self.task)
        # Ready first (a loss right after the launch finds it), then build what does not
        # depend on the rank: taking one then only binds the identity.
        self._run_prepare()
        while True:
            ep = self.dir.newest_epoch()
            if ep is not None and ep.rank_of(self.task) is not None:
                r = ep.rank_of(self.task)
                log.warning(
                    "[ckpt] hot spare (task %d) takes rank %s in epoch %d", self.task, r, ep.epoch
                )
                return ep
            if self.dir.ended():
                log.info("[ckpt] hot spare (task %d): the job ended without needing it", self.task)
                raise SystemExit(0)
            time.sleep(POLL_S)

    def _run_prepare(self) -> None:
        if self._prepare is None or self.prepared is not None:
            return
        t0 = time.monotonic()
        self.prepared = self._prepare()
        self.prepare_s = time.monotonic() - t0
        log.info("[ckpt] task %d: prepared in %.2fs", self.task, self.prepare_s)

    def _wait_for(self, want: Callable[[Epoch], bool], until: float) -> Optional[Epoch]:
        while True:
            ep = self.dir.newest_epoch()
            if ep is not None and want(ep):
                return ep
            if time.monotonic() >= until:
                return None
            time.sleep(POLL_S)

    def _enter(self, ep: Epoch) -> None:
        """Form the process group of ``ep`` (the old one, if any, destroyed first)."""
        from datetime import timedelta

        import torch.distributed as dist

        rank = ep.rank_of(self.task)
        assert rank is not None
        os.environ[EPOCH_ENV] = str(ep.epoch)
        # What Checkpointer.from_env() reads for the rank (a spare's SLURM_PROCID is its
        # own task number, not the rank it takes).
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(ep.world_size)
        _destroy_group()
        self.epoch, self.rank, self.world_size = ep, rank, ep.world_size
        store = dist.TCPStore(
            ep.host,
            ep.port,
            ep.world_size,
            is_master=rank == 0,
            timeout=timedelta(seconds=self.deadline_s),
            wait_for_workers=False,
        )
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"epoch-{ep.epoch}/", store),
            rank=rank,
            world_size=ep.world_size,
            # Until every rank restored (a spare builds its Checkpointer and fetches its
            # state meanwhile): the deadline; then the step's timeout (_step_timeout).
            timeout=timedelta(seconds=self.deadline_s),
        )
        self.group = dist.group.WORLD
        self._timeline = RankTimeline.from_env(rank)
        log.info(
            "[ckpt] rank %d of %d (task %d) in membership epoch %d",
            rank,
            ep.world_size,
            self.task,
            ep.epoch,
        )

    # -- training ------------------------------------------------------------------------
    def run(
        self,
        ckpt: Any,
        step_fn: Callable[[int], Any],
        total: int,
        on_reform: Optional[Callable[[Any], Any]] = None,
    ) -> int:
        """Train steps ``1..total`` (from the step after the restored one): ``step_fn(step)``
        runs one step, collectives included; then the RAM snapshot. ``ckpt``: a
        ``TorchCheckpointer`` (or anything with ``restore()`` returning an object with
        ``step`` and ``tier``, ``ram_save(step=)`` and the Checkpointer as ``ckpt``).
        ``on_reform(group)`` is called before the first step and after every re-form,
        before the restore: build DDP / apply ``fully_shard`` there. Returns the last
        step; this rank then marks itself done in the recovery directory."""
        self.join()
        inner = getattr(ckpt, "ckpt", ckpt)
        self._ckpt = inner
        guard = getattr(inner, "guard_commits", None)
        if guard is not None:
            guard(self.check_member)
        reform: Optional[_Reform] = None
        step = 0
        need_restore = True
        while True:
            try:
                if need_restore:
                    step = self._restore(ckpt, on_reform, reform)
                    need_restore, reform = False, None
                    self._step_timeout()
                if step > total:
                    break
                step_fn(step)
                ckpt.ram_save(step=step)
                self._wait_copy(inner, step)
                self.last_step = step
                if self._timeline is not None:
                    # goodput's productive time and "training again": a loop that only
                    # ram_saves never calls should_save, where progress is written too
                    self._timeline.progress(step)
                step += 1
            except Exception as exc:
                if not collective_failure(exc):
                    raise
                reform = self._recover(exc, reform)
                need_restore = True
        self.dir.mark_done(self.rank)
        return self.last_step

    def _restore(
        self, ckpt: Any, on_reform: Optional[Callable[[Any], Any]], reform: Optional[_Reform]
    ) -> int:
        if on_reform is not None:
            on_reform(self.group)
        # The group is usable once every rank passed this barrier: what the survivors
        # wait here for (the spare binding its rank, wrapping its model) is the re-form's,
        # not the restore's. FSDP2's fully_shard runs no collective, so without it the
        # wait would land in the restore's min-reduce (DDP's wrapping broadcasts anyway).
        self._barrier()
        t0 = time.monotonic()
        got = ckpt.restore()
        if reform is None:
            self.started = None if got is None else {"step": int(got.step), "tier": str(got.tier)}
            return 1 if got is None else int(got.step) + 1
        if got is None:
            raise RecoveryFailed(
                f"rank {self.rank}: no step every rank holds after the re-form of epoch "
                f"{self.epoch.epoch if self.epoch else '?'}: falling back to a relaunch"
            )
        # completed steps done again (the step in flight was never completed)
        lost = max(0, reform.last_step - int(got.step))
        epoch = self.epoch.epoch if self.epoch else None
        self.history.append(
            {"epoch": epoch, "step": int(got.step), "tier": str(got.tier), "recomputed": lost}
        )
        seconds = time.monotonic() - reform.failed_at
        log.warning(
            "[ckpt] rank %d: in-job recovery done in %.2fs: step %d from %s, %d step(s) to redo",
            self.rank,
            seconds,
            got.step,
            got.tier,
            lost,
        )
        if self._timeline is not None:
            self._timeline.event(
                "reform_end",
                epoch=epoch,
                step=int(got.step),
                tier=str(got.tier),
                recomputed=lost,
                seconds=round(seconds, 3),
                ready_s=round(t0 - reform.failed_at, 3),
                restore_s=round(time.monotonic() - t0, 3),
            )
        return int(got.step) + 1

    def _barrier(self) -> None:
        if self.group is None:
            return
        import torch.distributed as dist

        dist.barrier(group=self.group)

    def _step_timeout(self) -> None:
        """The collective timeout of training steps, once the group's re-form is over.
        (torch has no public setter for a formed group's timeout; without this one the
        deadline stays the timeout: detection of a stalled rank is only slower.)"""
        from datetime import timedelta

        from torch.distributed import distributed_c10d as c10d

        setter = getattr(c10d, "_set_pg_timeout", None)
        if setter is None:
            log.warning(
                "[ckpt] this torch cannot set a group's timeout: %.0fs stays", self.deadline_s
            )
            return
        setter(timedelta(seconds=self.timeout_s), self.group)

    def _wait_copy(self, inner: Any, step: int) -> None:
        ram = getattr(inner, "ram", None)
        if not self.wait_copy or ram is None:
            return
        if not ram.wait_idle(self.timeout_s):
            log.warning(
                "[ckpt] rank %d: step %d's RAM copy not acknowledged within %.0fs",
                self.rank,
                step,
                self.timeout_s,
            )

    # -- recovering ----------------------------------------------------------------------
    def _recover(self, exc: BaseException, reform: Optional[_Reform]) -> _Reform:
        """Wait for a newer membership and enter it (or exit fenced, or raise)."""
        error = " ".join(str(exc).split())[:300] or type(exc).__name__
        if reform is None:
            reform = _Reform(time.monotonic(), self.last_step, error)
            if self._timeline is not None:
                self._timeline.event("in_job_failure", step=self.last_step, error=error)
        # Leave the broken group now. (gloo keeps its connections open while anything
        # holds the group - DDP does - so a survivor waiting on this one still fails only
        # at its timeout: documented in docs/in-job-recovery.md.)
        _destroy_group()
        cur = self.epoch.epoch if self.epoch is not None else -1
        log.warning(
            "[ckpt] rank %d: a collective failed (%s): waiting up to %.0fs for a new membership",
            self.rank,
            error,
            self.deadline_s,
        )
        until = reform.failed_at + self.deadline_s
        while True:
            ep = self._wait_for(lambda e, n=cur: e.epoch > n, until)
            if ep is None:
                raise RecoveryFailed(
                    f"rank {self.rank}: no new membership within {self.deadline_s:.0f}s after a "
                    f"failed collective ({error}): falling back to a relaunch"
                ) from exc
            if not ep.has(self.rank, self.task):
                self._fenced(ep)
            if self._timeline is not None:
                self._timeline.event("reform_start", epoch=ep.epoch, lost=list(ep.lost))
            try:
                self._enter(ep)
                self._rebind()
                return reform
            except Exception as again:
                if not collective_failure(again):
                    raise RecoveryFailed(
                        f"rank {self.rank}: re-forming epoch {ep.epoch} failed: "
                        f"{' '.join(str(again).split())[:300]}"
                    ) from again
                log.warning(
                    "[ckpt] rank %d: re-forming epoch %d failed: %s", self.rank, ep.epoch, again
                )
                cur = ep.epoch

    def _rebind(self) -> None:
        link = getattr(self._ckpt, "partner", None)
        if link is not None:
            link.rebind(launch_tag())
        ram = getattr(self._ckpt, "ram", None)
        if ram is not None:
            ram.drop_session()

    def check_member(self) -> None:
        """Before every commit: refuse it when the newest epoch replaced this process."""
        ep = self.dir.newest_epoch()
        cur = self.epoch
        if (
            ep is not None
            and cur is not None
            and ep.epoch > cur.epoch
            and not ep.has(self.rank, self.task)
        ):
            raise StaleGeneration(
                f"rank {self.rank} (task {self.task}) was replaced in membership epoch "
                f"{ep.epoch}: this process may not commit"
            )

    def _fenced(self, ep: Epoch) -> None:
        """Replaced by ``ep``: exit now, committing and serving nothing (no close(): it
        would flush and commit; the partner link dies with the process)."""
        log.error(
            "[ckpt] rank %d (task %d) is not in membership epoch %d (replaced): fenced, "
            "exiting without committing or serving",
            self.rank,
            self.task,
            ep.epoch,
        )
        for h in logging.getLogger().handlers:
            h.flush()
        sys.stderr.flush()
        os._exit(EXIT_FENCED)


def _destroy_group() -> None:
    """Destroy the default process group, if any (a broken one may complain: ignored)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - a broken group is what we leave
        log.debug("[ckpt] old process group not destroyed cleanly: %s", exc)
