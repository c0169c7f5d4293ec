"""``ckpt-srun``'s work: the ``srun`` wrapper for checkpointing training jobs (the command
itself, :mod:`slurm_ckpt.cli.srun`, only parses options and reports errors).

Use it as the last line of a batch script, with ``exec`` so that it *is* the batch shell::

    #SBATCH --signal=B:USR1@120        # optional: ckpt-srun sends the warning itself too
    exec ckpt-srun --key my-run -- python train.py --config big.yaml

What it does, and why:

* **Settings reach every task**: ``SLURM_CKPT_CONFIG`` (absolute path of the site config),
  ``SLURM_CKPT_KEY`` (the checkpoint series; default ``$SLURM_CKPT_KEY``, else the job
  name if it is a valid key, else the job id - all stable across requeues) and
  ``SLURM_CKPT_SIGNAL`` (the warning signal) are exported to ``srun``.
* **The warning signal reaches the training processes.** ``#SBATCH --signal=B:USR1@T``
  signals only the batch shell, never the tasks of a step; and without ``exec`` a plain
  bash batch shell is killed by SIGUSR1. ckpt-srun traps USR1/USR2/TERM/CONT and forwards
  them to its ``srun``, which (tested on 22.05) relays them to every task of the step. It
  also keeps a timer: ``--warn`` seconds before the job's end time (asked from the
  controller, so extended limits count) it sends the warning itself if none came, so a
  forgotten ``--signal`` does not cost the last interval of work.
* **After the step exits** it flushes what is left on the node-local tier to the PFS (as
  the user - no root needed; on every node of a multi-node job through one more ``srun``
  step), bounded by ``--flush-timeout``. The epilog flushes anything still left.
* **Requeue**: after a time-limit warning, if the job is still ``RUNNING`` (not being
  preempted or cancelled), ckpt-srun requeues it once (``scontrol requeue``): SLURM never
  requeues a job that hit its time limit. After SIGTERM (preemption, scancel) it does
  nothing: with ``PreemptMode=REQUEUE`` SLURM requeues preempted jobs itself, and a
  second requeue would only confuse the restart count. ``--max-requeues`` bounds the
  restarts.
* **Spares** (``--spares K``, job submitted with ``N + K`` nodes and ``--no-kill``): the
  step runs on ``N`` nodes, one rank per node in a pinned order
  (:mod:`slurm_ckpt.ops.spares`). When it fails because one of its nodes died (SLURM
  says DOWN or NOT_RESPONDING, or took it out of the job), ckpt-srun relaunches the step
  at once on the surviving nodes plus a spare in the dead node's place, inside the same
  allocation: no requeue. It says which node was lost and how long the recovery took
  (from the failed step's end to the relaunched step's start). A step that fails while
  its nodes are up is not relaunched. With no spare left it requeues the job (the
  requeue path of :mod:`slurm_ckpt.slurm.requeue`), after flushing the surviving nodes.
  The relaunched step sees ``SLURM_CKPT_LOST_NODES`` (the nodes lost so far) and
  ``SLURM_CKPT_RELAUNCH`` (how many relaunches): the seam for a restore that reads a
  lost rank's shard from another node's copy; today the Restorer of a rank on a spare
  finds no local copy and reads its shard from the warm tier, verified.

Exit status: the step's (so SLURM's accounting shows the training's result).
"""

from __future__ import annotations

import contextlib
import functools
import getpass
import logging
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from slurm_ckpt.core.config import load_config, resolve_config_path
from slurm_ckpt.core.membership import RecoveryDir
from slurm_ckpt.core.names import validate_key
from slurm_ckpt.core.timeline import TIMELINE_ENV
from slurm_ckpt.errors import CkptError, InvalidName, SlurmError, UsageError
from slurm_ckpt.ops.flush_cmd import flush_series
from slurm_ckpt.ops.heartbeat import BEAT_S, Heartbeats, batch_host_address
from slurm_ckpt.ops.in_job import prepare_recovery_dir, run_in_job
from slurm_ckpt.ops.job_timeline import SrunTimeline, timeline_dir
from slurm_ckpt.ops.spares import NodeSet, check_srun_args, dead_nodes, layout_args, wait_for_dead
from slurm_ckpt.slurm.client import SlurmClient
from slurm_ckpt.slurm.env import job_end_time, job_env
from slurm_ckpt.slurm.requeue import NODE_LOST, requeue_job, requeue_reason, stop_cause

__all__ = ["SrunOptions", "StepOutcome", "resolve_key", "run_wrapper", "warning_signal"]

log = logging.getLogger(__name__)
_FORWARDED = ("SIGUSR1", "SIGUSR2", "SIGTERM", "SIGINT", "SIGCONT", "SIGHUP")
#: How often the end time is asked again (an admin may extend the limit).
END_TIME_REFRESH_S = 300.0

Say = Callable[[str], None]


@dataclass
class SrunOptions:
    """ckpt-srun's own options (see ``ckpt-srun --help``)."""

    config_path: Optional[str] = None
    key: Optional[str] = None
    warn_s: float = 120.0
    sig_name: str = "USR1"
    requeue: bool = True
    max_requeues: int = 100
    flush: bool = True
    flush_timeout: float = 300.0
    srun_path: str = "srun"
    flush_local: bool = False
    #: Spare nodes of the allocation (0: the step runs on every node, no relaunch).
    spares: int = 0
    #: How long a failed step waits for the controller's verdict on its nodes.
    node_wait_s: float = 60.0
    #: With spares: a node whose heartbeats stop for this long is lost (ops/heartbeat).
    node_timeout_s: float = 10.0
    #: With spares: recover inside the job (hot spares, survivors keep their processes;
    #: slurm_ckpt.ops.in_job), falling back to the relaunch.
    in_job: bool = False


def warning_signal(name: str) -> signal.Signals:
    """``USR1``/``SIGUSR1`` -> the signal; UsageError for unknown or uncatchable ones."""
    up = name.upper()
    sig = getattr(signal, up if up.startswith("SIG") else f"SIG{up}", None)
    if not isinstance(sig, signal.Signals) or sig in (signal.SIGKILL, signal.SIGSTOP):
        raise UsageError(f"--signal: unknown or uncatchable signal {name!r}")
    return sig


def resolve_key(explicit: Optional[str], env: Dict[str, str]) -> str:
    """The checkpoint series: ``--key``, ``$SLURM_CKPT_KEY``, the job name, the job id."""
    for value in (explicit, env.get("SLURM_CKPT_KEY")):
        if value:
            return validate_key(value)
    jenv = job_env(env, required=False)
    if jenv.name:
        try:
            return validate_key(jenv.name)
        except InvalidName:
            pass
    if jenv.job_id:
        return validate_key(f"job-{jenv.job_id}")
    raise InvalidName("no checkpoint key: pass --key or set $SLURM_CKPT_KEY")


@dataclass
class StepOutcome:
    rc: int
    warned: bool = False
    warned_by: Optional[str] = None
    terminated: bool = False
    #: Nodes whose heartbeats stopped while the step ran (ckpt-srun stopped the step).
    lost: Optional[List[str]] = None
    #: When they were declared lost (epoch seconds; the step was stopped after that).
    lost_at: Optional[float] = None


class _Runner:
    """Runs the step, forwards signals, fires the time-limit warning."""

    def __init__(
        self,
        argv: Sequence[str],
        env: Dict[str, str],
        warn_sig: signal.Signals,
        say: Say,
        lost_check: Optional[Callable[[], List[str]]] = None,
    ) -> None:
        self.say = say
        self.lost_check = lost_check
        self.argv = list(argv)
        self.env = env
        self.warn_sig = warn_sig
        self.proc: Optional[subprocess.Popen] = None
        self.outcome = StepOutcome(rc=0)
        self.pending: List[int] = []

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if signum == self.warn_sig:
            if not self.outcome.warned:
                self.outcome.warned, self.outcome.warned_by = True, "SLURM signal"
        elif signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self.outcome.terminated = True
        # srun treats SIGINT specially (status report, kill on the second): send TERM.
        fwd = signal.SIGTERM if signum == signal.SIGINT else signum
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, fwd)
        else:
            self.pending.append(fwd)

    def warn_now(self, why: str) -> None:
        if self.outcome.warned:
            return
        self.outcome.warned, self.outcome.warned_by = True, why
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, self.warn_sig)

    def run(self, end_time: Any, warn_s: float) -> StepOutcome:
        for name in _FORWARDED:
            signal.signal(getattr(signal, name), self._on_signal)
        signal.signal(self.warn_sig, self._on_signal)
        self.proc = subprocess.Popen(self.argv, env=self.env)
        for sig in self.pending:
            os.kill(self.proc.pid, sig)
        end = end_time()
        refreshed = time.monotonic()
        while True:
            wait = 1.0
            if warn_s > 0 and end is not None and not self.outcome.warned:
                left = end - warn_s - time.time()
                if left <= 0:
                    self.say(
                        f"time limit in {max(0, end - time.time()):.0f}s: sending "
                        f"{self.warn_sig.name} to the step"
                    )
                    self.warn_now("ckpt-srun timer")
                else:
                    wait = min(wait, left)
            try:
                self.outcome.rc = self.proc.wait(timeout=max(0.05, wait))
                break
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() - refreshed > END_TIME_REFRESH_S:
                end, refreshed = end_time() or end, time.monotonic()
            lost = self.lost_check() if self.lost_check is not None else []
            if lost:
                self.outcome.lost, self.outcome.lost_at = lost, time.time()
                self.outcome.rc = _stop_step(self.proc)
                break
        return self.outcome


def _stop_step(proc: subprocess.Popen, grace_s: float = 5.0) -> int:
    """End a step that lost a node: srun relays SIGTERM to the tasks it can still reach,
    but waits for the dead node's tasks for ever, so it is killed after ``grace_s``."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def _end_time_source(client: Any, job_id: str, env: Dict[str, str]) -> Any:
    def get() -> Optional[float]:
        if client is not None:
            try:
                return client.end_time(job_id)
            except CkptError as exc:
                log.debug("end time from the controller failed: %s", exc)
        return job_end_time(env)

    return get


def _flush_everywhere(
    cfg: Any,
    config_path: Optional[str],
    user: str,
    key: str,
    nodes: List[str],
    srun: str,
    timeout: float,
    env: Dict[str, str],
    say: Say,
    pinned: bool = False,
    overlap: bool = False,
) -> None:
    """Flush ``key`` on every node (``pinned``: on exactly these nodes of the job, which
    may have lost others; ``overlap``: beside a step SLURM still counts as running)."""
    if len(nodes) <= 1 and not pinned:
        for line in flush_series(cfg, user, key, timeout):
            say(f"flush {key} {line}")
        return
    argv = [
        srun,
        f"--nodes={len(nodes)}",
        *([f"--nodelist={','.join(nodes)}"] if pinned else []),
        *(["--overlap"] if overlap else []),
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=0",
        sys.executable,
        "-m",
        "slurm_ckpt.cli.srun",
        "--flush-local",
        "--key",
        key,
    ]
    if config_path:
        argv += ["--config", config_path]
    try:
        subprocess.run(argv, env=env, timeout=timeout + 30, check=False)
    except subprocess.TimeoutExpired:
        say("flush step timed out; the epilog flushes what is left")


def _inside_job(env: Dict[str, str]) -> Any:
    """The job's environment, or UsageError when ckpt-srun runs outside a SLURM job."""
    try:
        return job_env(env)
    except SlurmError as exc:
        raise UsageError(f"{exc}: ckpt-srun wraps srun inside a batch script or salloc") from None


def run_wrapper(opts: SrunOptions, srun_args: Sequence[str], say: Say) -> int:
    """Run the step, then flush and maybe requeue (see the module docstring); returns the
    step's exit status."""
    env = dict(os.environ)
    user = pwd.getpwuid(os.getuid()).pw_name if os.getuid() else getpass.getuser()
    warn_sig = warning_signal(opts.sig_name)
    key = resolve_key(opts.key, env)
    # Outside a job first, and as a usage error (exit 2, like a hook run outside SLURM):
    # SLURM is not unreachable, ckpt-srun was run where it has no job to wrap.
    jenv = None if opts.flush_local else _inside_job(env)
    cfg = None
    cfg_file: Optional[str] = None
    try:
        path, _ = resolve_config_path(opts.config_path)
        cfg = load_config(path)
        cfg_file = str(path.absolute())
    except CkptError as exc:
        if opts.flush_local or opts.config_path:
            raise
        say(f"no checkpoint config ({exc}); running without flush")

    if opts.flush_local:  # internal: one task per node of a multi-node job
        for line in flush_series(cfg, user, key, opts.flush_timeout):  # type: ignore[arg-type]
            say(f"{env.get('SLURMD_NODENAME', '?')}: flush {key} {line}")
        return 0

    assert jenv is not None  # not the flush_local path
    if not srun_args:
        raise UsageError("nothing to run: give srun options and the training command")
    srun = shutil.which(opts.srun_path) or opts.srun_path
    child_env = dict(env)
    child_env["SLURM_CKPT_KEY"] = key
    child_env["SLURM_CKPT_SIGNAL"] = warn_sig.name
    if cfg_file:
        child_env["SLURM_CKPT_CONFIG"] = cfg_file

    client = None
    try:
        client = SlurmClient(timeout=20.0)
    except CkptError as exc:
        say(f"SLURM client unavailable ({exc}); no end-time timer or requeue")
    args = list(srun_args)
    if args and args[0] == "--":
        args = args[1:]
    ns: Optional[NodeSet] = None
    beats: Optional[Heartbeats] = None
    if opts.spares:
        check_srun_args(args)
        ns = NodeSet.initial(jenv.nodes, opts.spares)
        if client is None:
            say("no SLURM client: a lost node cannot be told apart, no relaunch on a spare")
        else:
            beats = Heartbeats.start(client, jenv, srun, child_env, opts.node_timeout_s, say)
    say(f"job {jenv.job_id} key {key} restart {jenv.restart_count}: {srun} {' '.join(args)}")
    timeline = SrunTimeline(timeline_dir(cfg, user, str(jenv.job_id)), say)
    if timeline.path is not None:
        child_env[TIMELINE_ENV] = str(timeline.directory)
    timeline.note("start", job=str(jenv.job_id), restart=jenv.restart_count)
    ends = _end_time_source(client, jenv.job_id, env)

    def job_nodes() -> List[str]:
        """The job's nodes now (a --no-kill job loses the ones SLURM took away)."""
        assert client is not None and jenv is not None
        return list(client.job(jenv.job_id).nodes)

    def run_step() -> StepOutcome:
        """Today's step: all ranks in one srun (relaunched on a loss)."""
        step_env = dict(child_env)
        layout: List[str] = []
        if ns is not None:
            layout = layout_args(ns)
            spares = ",".join(ns.spares) or "none"
            say(f"step on {','.join(ns.slots)} (rank i on the i-th; spares: {spares})")
            if ns.lost:
                step_env["SLURM_CKPT_LOST_NODES"] = ",".join(ns.lost)
                step_env["SLURM_CKPT_RELAUNCH"] = str(relaunches)
        lost_check = None
        if beats is not None and ns is not None:
            lost_check = functools.partial(beats.monitor.lost, list(ns.slots))
        runner = _Runner([srun, *layout, *args], step_env, warn_sig, say, lost_check)
        timeline.note("step_start", relaunch=relaunches, nodes=list(ns.slots) if ns else [])
        if failed_at is not None:
            say(
                f"recovery: relaunched step {relaunches} starts "
                f"{time.monotonic() - failed_at:.1f}s after the failed step ended "
                "(same job, no requeue)"
            )
        outcome = runner.run(ends, opts.warn_s)
        timeline.note("step_end", rc=outcome.rc)
        say(
            f"step exited with status {outcome.rc}"
            + (f" after a warning ({outcome.warned_by})" if outcome.warned else "")
            + (" after SIGTERM" if outcome.terminated else "")
        )
        return outcome

    lost_now: List[str] = []
    failed_at: Optional[float] = None
    relaunches = 0
    in_job = _in_job_setup(opts, ns, beats, timeline, say)
    while True:
        if in_job is not None and ns is not None and beats is not None and client is not None:
            res = run_in_job(
                srun=srun,
                args=args,
                env=child_env,
                ns=ns,
                monitor=beats.monitor,
                recovery=in_job,
                address=functools.partial(batch_host_address, client),
                note=timeline.note,
                say=say,
                warn_sig=warn_sig,
            )
            in_job.close()
            in_job = None  # once: after a fallback, steps are relaunched as without it
            ns = res.ns or ns
            outcome = StepOutcome(
                rc=res.rc,
                warned=res.warned,
                warned_by="SLURM signal" if res.warned else None,
                terminated=res.terminated,
                lost=res.lost or None,
                lost_at=res.lost_at,
            )
            if res.finished or (outcome.rc == 0 and not outcome.lost):
                break
            if res.relaunch:  # a re-form failed: relaunch on the node set as it is now
                relaunches += 1
                failed_at = time.monotonic()
                continue
            # A loss with no spare ready, or a failed rank: decided as for a failed step.
        else:
            outcome = run_step()
            if ns is None or client is None or (outcome.rc == 0 and not outcome.lost):
                break
        if outcome.warned or outcome.terminated:
            break  # the time limit or SLURM ends the job: not a node loss to repair
        failed_at = time.monotonic()
        silent = beats.monitor.lost if beats is not None else None
        if outcome.lost:
            lost_now = list(outcome.lost)
            verdict = f"no heartbeat for {opts.node_timeout_s:.0f}s; the step was stopped"
        else:
            wait_s = opts.node_wait_s
            if beats is not None:  # heartbeats tell a lost node within their timeout
                wait_s = min(wait_s, opts.node_timeout_s + 2 * BEAT_S)
            lost_now = wait_for_dead(ns.slots, client.node, job_nodes, wait_s, silent=silent)
            verdict = f"found {time.monotonic() - failed_at:.1f}s after the step ended"
        if not lost_now:
            say(
                f"step failed with status {outcome.rc} while all its nodes are up: "
                "the program's own failure, not relaunched"
            )
            break
        heard = [beats.monitor.last_heard_wall(n) for n in lost_now] if beats else []
        timeline.note(
            "node_lost",
            nodes=lost_now,
            by="heartbeat" if beats is not None else "slurm",
            at=outcome.lost_at,
            last_heard=min((h for h in heard if h is not None), default=None),
        )
        dead_spares = dead_nodes(ns.spares, client.node, job_nodes, silent=silent)
        new = ns.replace(lost_now + dead_spares)
        if new is None:
            say(
                f"node {','.join(lost_now)} lost ({verdict}) and no spare left: "
                "falling back to a requeue"
            )
            ns = NodeSet([n for n in ns.slots if n not in lost_now], [], ns.lost + lost_now)
            break
        relaunches += 1
        took_over = [b for a, b in zip(ns.slots, new.slots) if a != b]
        say(
            f"node {','.join(lost_now)} lost ({verdict}); relaunching the step on spare "
            f"{','.join(took_over)} in its place"
        )
        ns, lost_now = new, []
        if dead_spares:
            say(f"spare {','.join(dead_spares)} is down too: not used")
    flush_nodes = ns.slots if ns is not None else jenv.nodes
    if opts.flush and cfg is not None and outcome.terminated and len(jenv.nodes) > 1:
        # Preempted or cancelled: the allocation is going away, a flush step would only
        # fail ("Unable to confirm allocation"); the epilog flushes on every node.
        say("terminated: no flush step (the epilog flushes on every node)")
    elif opts.flush and cfg is not None:
        _flush_everywhere(
            cfg,
            cfg_file,
            user,
            key,
            flush_nodes,
            srun,
            opts.flush_timeout,
            child_env,
            say,
            pinned=ns is not None,
            overlap=bool(ns is not None and ns.lost),
        )
    if beats is not None:
        beats.stop()
    timeline.note("end", rc=outcome.rc)
    if client is not None and lost_now:
        _requeue_after(client, jenv.job_id, NODE_LOST, opts, f"node {','.join(lost_now)} lost", say)
    elif client is not None and outcome.warned and not outcome.terminated:
        try:
            info = client.job(jenv.job_id)
            cause = stop_cause(
                info.state, info.reason, warned=outcome.warned, terminated=outcome.terminated
            )
        except CkptError as exc:
            say(f"requeue failed: {exc}")
        else:
            _requeue_after(
                client, jenv.job_id, cause, opts, f"warning from {outcome.warned_by}", say, info
            )
    elif outcome.terminated:
        say("terminated by a signal (preemption or cancel): SLURM decides about requeue")
    return outcome.rc


def _requeue_after(
    client: Any,
    job_id: str,
    cause: Optional[str],
    opts: SrunOptions,
    detail: str,
    say: Say,
    info: Any = None,
) -> None:
    """Requeue the job when :func:`requeue_reason` says so (SLURM then ends this batch
    script: nothing after this matters)."""
    try:
        info = info if info is not None else client.job(job_id)
        why = requeue_reason(
            cause,
            restarts=info.restarts,
            max_requeues=opts.max_requeues,
            enabled=opts.requeue,
            detail=detail,
        )
        if why:
            say(why)
            requeue_job(job_id, why, client)
        else:
            say(f"not requeued (state {info.state}, restarts {info.restarts})")
    except CkptError as exc:
        say(f"requeue failed: {exc}")


def _in_job_setup(
    opts: SrunOptions,
    ns: Optional[NodeSet],
    beats: Optional[Heartbeats],
    timeline: SrunTimeline,
    say: Say,
) -> Optional[RecoveryDir]:
    """The recovery directory for ``--in-job`` (timeline dir + ``/recovery``), or None
    (said why) when in-job recovery cannot run: the relaunch path is used instead."""
    if not opts.in_job:
        return None
    if ns is None or not ns.spares:
        raise UsageError("--in-job needs --spares 1 or more (the hot spares' nodes)")
    if beats is None:
        say("in-job recovery needs the heartbeats: a lost node is relaunched instead")
        return None
    if timeline.directory is None:
        say("in-job recovery needs a PFS tier (its recovery directory): relaunching instead")
        return None
    try:
        return prepare_recovery_dir(os.path.join(timeline.directory, "recovery"))
    except (CkptError, OSError) as exc:
        say(f"in-job recovery unavailable ({exc}): relaunching instead")
        return None
