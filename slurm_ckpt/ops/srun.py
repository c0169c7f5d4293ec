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

Exit status: the step's (so SLURM's accounting shows the training's result).
"""

from __future__ import annotations

import contextlib
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
from slurm_ckpt.core.names import validate_key
from slurm_ckpt.errors import CkptError, InvalidName, SlurmError, UsageError
from slurm_ckpt.ops.flush import flush_series
from slurm_ckpt.slurm.client import SlurmClient
from slurm_ckpt.slurm.env import job_end_time, job_env
from slurm_ckpt.slurm.requeue import requeue_job, requeue_reason, stop_cause

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


class _Runner:
    """Runs the step, forwards signals, fires the time-limit warning."""

    def __init__(
        self, argv: Sequence[str], env: Dict[str, str], warn_sig: signal.Signals, say: Say
    ) -> None:
        self.say = say
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
        return self.outcome


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
) -> None:
    if len(nodes) <= 1:
        for line in flush_series(cfg, user, key, timeout):
            say(f"flush {key} {line}")
        return
    argv = [
        srun,
        f"--nodes={len(nodes)}",
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
    say(f"job {jenv.job_id} key {key} restart {jenv.restart_count}: {srun} {' '.join(args)}")
    runner = _Runner([srun, *args], child_env, warn_sig, say)
    outcome = runner.run(_end_time_source(client, jenv.job_id, env), opts.warn_s)
    say(
        f"step exited with status {outcome.rc}"
        + (f" after a warning ({outcome.warned_by})" if outcome.warned else "")
        + (" after SIGTERM" if outcome.terminated else "")
    )
    if opts.flush and cfg is not None and outcome.terminated and len(jenv.nodes) > 1:
        # Preempted or cancelled: the allocation is going away, a flush step would only
        # fail ("Unable to confirm allocation"); the epilog flushes on every node.
        say("terminated: no flush step (the epilog flushes on every node)")
    elif opts.flush and cfg is not None:
        _flush_everywhere(
            cfg, cfg_file, user, key, jenv.nodes, srun, opts.flush_timeout, child_env, say
        )
    if client is not None and outcome.warned and not outcome.terminated:
        try:
            info = client.job(jenv.job_id)
            cause = stop_cause(
                info.state, info.reason, warned=outcome.warned, terminated=outcome.terminated
            )
            why = requeue_reason(
                cause,
                restarts=info.restarts,
                max_requeues=opts.max_requeues,
                enabled=opts.requeue,
                detail=f"warning from {outcome.warned_by}",
            )
            if why:
                say(why)
                requeue_job(jenv.job_id, why, client)
                # SLURM now ends this batch script; nothing after this matters.
            else:
                say(f"not requeued (state {info.state}, restarts {info.restarts})")
        except CkptError as exc:
            say(f"requeue failed: {exc}")
    elif outcome.terminated:
        say("terminated by a signal (preemption or cancel): SLURM decides about requeue")
    return outcome.rc
