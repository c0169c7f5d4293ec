"""``ckpt-srun --spares K --in-job``: the launcher's side of in-job recovery.

Why: with ``--spares`` alone a node loss stops the whole step and relaunches every rank
(each pays Python, torch, the rendezvous and a restore again), and the survivors throw
away the state they hold in memory. In-job mode keeps the survivors' processes and puts
a **hot spare** (started ahead of time, interpreter up, torch imported) in the lost
rank's place, through the membership protocol of :mod:`slurm_ckpt.core.membership`.
ckpt-srun is its coordinator.

How the ranks are launched, and why so: **one ``srun --overlap`` step per node**, rank
``i`` alone on ``slots[i]``, each spare alone on its spare node. A step that loses a node
on SLURM 22.05 keeps running in the controller on its other nodes and srun waits for the
dead node's tasks for ever; with one step per node, a dead node stops only its own step,
and the survivors' steps (their tasks, their pids) simply go on. ``--overlap`` because
SLURM still counts the dead node's step as running (see docs/spares.md). Every step gets:

* ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK=0``, ``MASTER_ADDR``, ``MASTER_PORT`` (the
  epoch-0 rendezvous on rank 0's node), ``SLURM_CKPT_TASK`` (its task number: rank ``i``
  is task ``i``, the spares are tasks ``N``, ``N+1``, ...);
* ``SLURM_CKPT_RECOVERY_DIR``: the job's timeline directory + ``/recovery``, made ``0700``
  by ckpt-srun, which runs as the user;
* ``SLURM_CKPT_LAUNCH``: the launch the partner links bind to (their step ids differ);
* a spare also ``SLURM_CKPT_SPARE=1``: the same command, which waits as a spare (its
  ``spare-<task>.json`` says it is ready).

ckpt-srun writes epoch 0, then watches its heartbeats (:mod:`slurm_ckpt.ops.heartbeat`):

* **a training node falls silent**: :meth:`Coordinator.declare_lost` gives the lost ranks
  to ready spares in a new epoch (the survivors re-form their process group with them).
  The lost node's step is stopped (it hangs on the dead node) and the node is excluded
  from every later step;
* **a spare's node falls silent**, or its step ends early: it is not offered again;
* **every rank finished** (its step exited 0, or it wrote ``rank-<r>.done``): ckpt-srun
  writes ``end.json`` (the spares exit 0), stops what still hangs on a dead node, and the
  job ends with status 0.

Falling back: when no spare is ready at a loss, or a rank's step fails after a loss (the
re-form failed), every step is stopped and the caller (:mod:`slurm_ckpt.ops.srun`) takes
today's path: relaunch on the surviving nodes plus a spare, else requeue. A rank that
fails while every node is up is the program's own failure: not relaunched.

Each rank's output is prefixed with its rank (``3: ...``), a spare's with ``spare<task>``
until it takes a rank, a replaced rank's with ``lost<task>``: srun's own ``--label``
would say ``0`` for every step.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Dict, List, Optional, Sequence

from slurm_ckpt.core.membership import (
    RECOVERY_DIR_ENV,
    SPARE_ENV,
    TASK_ENV,
    Coordinator,
    Epoch,
    Member,
    MembershipError,
    RecoveryDir,
    free_port,
)
from slurm_ckpt.job.partner_net import LAUNCH_ENV
from slurm_ckpt.ops.spares import NodeSet

__all__ = ["InJobResult", "prepare_recovery_dir", "run_in_job", "step_argv"]

Say = Callable[[str], None]
#: How long ckpt-srun waits for spares to exit after ``end.json``.
SPARE_EXIT_S = 30.0
#: Grace before a stopped step's srun is killed (it waits for a dead node for ever).
STOP_GRACE_S = 5.0
#: Beyond the heartbeat timeout, how long a failed rank waits for a verdict on its node.
_VERDICT_MARGIN_S = 2.0
_PROTOCOL = re.compile(r"^(epoch-\d+\.json|spare-\d+\.json|rank-\d+\.done|end\.json)$")


@dataclass
class InJobResult:
    """How the in-job run ended, for the caller's next move."""

    rc: int
    #: Every rank finished: the training is over.
    finished: bool = False
    #: The node set now: nodes replaced in-job are out of the slots and in ``lost``.
    ns: Optional[NodeSet] = None
    #: Nodes lost that the in-job path did not repair (the caller relaunches without them).
    lost: List[str] = field(default_factory=list)
    lost_at: Optional[float] = None
    #: Relaunch on ``ns`` as it is (a re-form failed after a loss).
    relaunch: bool = False
    warned: bool = False
    terminated: bool = False
    epochs: int = 0


def prepare_recovery_dir(path: str) -> RecoveryDir:
    """The recovery directory, made ``0700`` (as the user running ckpt-srun), emptied of a
    previous run's protocol files: a requeued job has the same id, hence the same
    directory, and its old epochs must not be read as this run's."""
    rd = RecoveryDir(path, create=True)
    for name in os.listdir(rd.fd):
        if _PROTOCOL.match(name):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=rd.fd)
    return rd


def step_argv(srun: str, node: str, args: Sequence[str]) -> List[str]:
    """One task on ``node``, beside the job's other steps. srun's ``--label`` is left out:
    ckpt-srun labels the lines itself (with the rank, not srun's task 0)."""
    user = [a for a in args if a not in ("--label", "-l")]
    return [
        srun,
        "--overlap",
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={node}",
        "--kill-on-bad-exit=0",
        *user,
    ]


class _Step:
    """One node's srun: its task, its process and the thread copying its lines out."""

    def __init__(self, node: str, task: int, argv: List[str], env: Dict[str, str]) -> None:
        self.node, self.task = node, task
        self.proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the batch shell's signals reach it only through us
        )
        self.rc: Optional[int] = None
        self.stopping = False

    def poll(self) -> Optional[int]:
        if self.rc is None:
            self.rc = self.proc.poll()
        return self.rc

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        """SIGTERM, SIGKILL after :data:`STOP_GRACE_S` (in a thread: srun of a dead node's
        step never ends by itself)."""
        if self.stopping or self.proc.poll() is not None:
            return
        self.stopping = True

        def run() -> None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

        threading.Thread(target=run, name=f"ckpt-stop-{self.node}", daemon=True).start()


class _Labeller:
    """Copies every step's lines to our stdout, prefixed with the task's rank now."""

    def __init__(self, out: IO[str], world: int) -> None:
        self.out, self.world = out, world
        self.lock = threading.Lock()
        self.epoch: Optional[Epoch] = None
        self.threads: List[threading.Thread] = []

    def label(self, task: int) -> str:
        ep = self.epoch
        rank = ep.rank_of(task) if ep is not None else None
        if rank is not None:
            return str(rank)
        return f"lost{task}" if task < self.world else f"spare{task}"

    def pump(self, step: _Step) -> None:
        def run() -> None:
            assert step.proc.stdout is not None
            for raw in iter(step.proc.stdout.readline, b""):
                line = raw.decode("utf-8", "replace").rstrip("\n")
                with self.lock, contextlib.suppress(OSError, ValueError):
                    self.out.write(f"{self.label(step.task)}: {line}\n")
                    self.out.flush()

        th = threading.Thread(target=run, name=f"ckpt-out-{step.node}", daemon=True)
        th.start()
        self.threads.append(th)

    def drain(self, timeout: float = 5.0) -> None:
        end = time.monotonic() + timeout
        for th in self.threads:
            th.join(max(0.0, end - time.monotonic()))


def run_in_job(
    *,
    srun: str,
    args: Sequence[str],
    env: Dict[str, str],
    ns: NodeSet,
    monitor: Any,
    recovery: RecoveryDir,
    address: Callable[[str], str],
    note: Callable[..., None],
    say: Say,
    warn_sig: signal.Signals,
    poll_s: float = 0.2,
) -> InJobResult:
    """Launch the ranks and the hot spares, coordinate the epochs, end the job (see the
    module docstring). ``monitor``: the heartbeat monitor (``lost(nodes)``,
    ``last_heard_wall(node)``); ``address(node)``: where other nodes reach ``node``;
    ``note(event, **fields)``: the job's timeline."""
    world = len(ns.slots)
    host0 = address(ns.slots[0])
    port = free_port(host0)
    coord = Coordinator(recovery)
    try:
        ep = coord.launch({i: Member(address(n), i) for i, n in enumerate(ns.slots)}, port=port)
    except (MembershipError, OSError) as exc:
        say(f"in-job recovery unavailable ({exc}): relaunching on a loss instead")
        return InJobResult(rc=-1, ns=ns, relaunch=True)
    base = dict(env)
    base.update(
        {
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": "0",
            "MASTER_ADDR": host0,
            "MASTER_PORT": str(port),
            RECOVERY_DIR_ENV: recovery.path,
            # One launch for the partner links of every rank (each runs its own step).
            LAUNCH_ENV: f"in-job-{env.get('SLURM_JOB_ID', '')}-{port}",
        }
    )
    labels = _Labeller(sys.stdout, world)
    labels.epoch = ep
    steps: Dict[int, _Step] = {}
    tasks = [(i, n, False) for i, n in enumerate(ns.slots)]
    tasks += [(world + j, n, True) for j, n in enumerate(ns.spares)]
    for task, node, spare in tasks:
        step_env = dict(base, **{TASK_ENV: str(task)})
        if spare:
            step_env[SPARE_ENV] = "1"
            step_env.pop("RANK", None)
        else:
            step_env["RANK"] = str(task)
        steps[task] = _Step(node, task, step_argv(srun, node, args), step_env)
        labels.pump(steps[task])
    spare_nodes = {world + j: n for j, n in enumerate(ns.spares)}
    say(
        f"in-job: {world} rank(s) on {','.join(ns.slots)}, one step per node; hot spare(s) "
        f"on {','.join(ns.spares) or 'none'}; epoch 0 meets at {host0}:{port}"
    )
    note("in_job_launch", epoch=0, nodes=list(ns.slots), spares=list(ns.spares))
    res = InJobResult(rc=0, ns=ns)
    handler = _Signals(steps, warn_sig, res)
    handler.install()
    lost_any = False
    first_fail: Optional[float] = None
    try:
        while True:
            time.sleep(poll_s)
            cur = coord.current
            assert cur is not None
            # 1. Spares: a silent node or an ended step is not offered again.
            for task, node in list(spare_nodes.items()):
                rc = steps[task].poll()
                if rc is not None or monitor.lost([node]):
                    del spare_nodes[task]
                    coord.forget_spare(task)
                    steps[task].stop()
                    ns = NodeSet(ns.slots, [n for n in ns.spares if n != node], ns.lost + [node])
                    say(
                        f"in-job: spare {node} is gone ({'exited' if rc is not None else 'silent'})"
                    )
                    note("spare_lost", nodes=[node], rc=rc)
            # 2. A training node falls silent: its ranks go to ready spares.
            live = {r: steps[m.task].node for r, m in cur.members.items()}
            silent = monitor.lost(sorted(set(live.values())))
            if silent:
                lost_any, first_fail = True, None
                at = time.time()
                heard = [monitor.last_heard_wall(n) for n in silent]
                ranks = sorted(r for r, n in live.items() if n in silent)
                note(
                    "node_lost",
                    nodes=silent,
                    by="heartbeat",
                    at=at,
                    last_heard=min((h for h in heard if h is not None), default=None),
                    ranks=ranks,
                )
                new = coord.declare_lost(ranks)
                for r in ranks:
                    steps[cur.members[r].task].stop()
                if new is None:
                    say(
                        f"in-job: node {','.join(silent)} lost and no spare ready: "
                        "falling back to a relaunch"
                    )
                    res.lost, res.lost_at = silent, at
                    break
                labels.epoch = new
                moved = {r: steps[new.members[r].task].node for r in ranks}
                for r in moved:
                    spare_nodes.pop(new.members[r].task, None)
                slots = [moved.get(i, n) for i, n in enumerate(ns.slots)]
                ns = NodeSet(
                    slots, [n for n in ns.spares if n not in moved.values()], ns.lost + silent
                )
                say(
                    f"in-job: node {','.join(silent)} lost (no heartbeat for "
                    f"{monitor.timeout_s:.0f}s); epoch {new.epoch}: "
                    + ", ".join(f"rank {r} -> spare {n}" for r, n in moved.items())
                    + "; the other ranks keep their processes"
                )
                note("in_job_reform", epoch=new.epoch, ranks=ranks, nodes=slots, lost=silent)
                res.epochs = new.epoch
                continue
            # 3. A rank's step ended: done, or failed.
            failed = {
                r: steps[m.task].rc
                for r, m in cur.members.items()
                if steps[m.task].poll() not in (None, 0)
            }
            if failed and not (res.warned or res.terminated):
                # A dead node's srun may end before its heartbeats time out: first the
                # heartbeats' verdict on the nodes (as for a failed step without --in-job).
                first_fail = first_fail or time.monotonic()
                if time.monotonic() - first_fail < monitor.timeout_s + _VERDICT_MARGIN_S:
                    continue
            if failed:
                r, rc = sorted(failed.items())[0]
                res.rc = int(rc or 1)
                if res.warned or res.terminated or not lost_any:
                    say(f"in-job: rank {r} exited with status {rc}")
                    break  # the program's own failure, a time limit or a cancel
                say(
                    f"in-job: rank {r} exited with status {rc} after a node loss: the "
                    "in-job re-form failed; falling back to a relaunch"
                )
                note("in_job_failed", rank=r, rc=rc, epoch=cur.epoch)
                res.relaunch = True
                break
            done = set(recovery.done_ranks())
            if all(steps[m.task].rc == 0 or r in done for r, m in cur.members.items()):
                res.finished = True
                break
    finally:
        handler.restore()
        coord.end()  # waiting spares exit 0 (and on a fallback: the relaunch has none)
        end = time.monotonic() + (SPARE_EXIT_S if res.finished else 0.0)
        cur = coord.current
        if res.finished and cur is not None:  # the ranks' own steps end by themselves
            for m in cur.members.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    steps[m.task].proc.wait(timeout=max(0.0, end - time.monotonic()))
        for task in spare_nodes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                steps[task].proc.wait(timeout=max(0.0, end - time.monotonic()))
        for step in steps.values():
            step.stop()
        for step in steps.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                step.proc.wait(timeout=STOP_GRACE_S + 2)
        labels.drain()
    res.ns = ns
    if res.finished:
        res.rc = 0
        say(f"in-job: every rank finished (epochs: {res.epochs + 1})")
        note("in_job_end", epochs=res.epochs + 1)
    return res


class _Signals:
    """Forwards the batch shell's signals to every step (as ckpt-srun does to its srun)."""

    _NAMES = ("SIGUSR1", "SIGUSR2", "SIGTERM", "SIGINT", "SIGCONT", "SIGHUP")

    def __init__(self, steps: Dict[int, _Step], warn_sig: signal.Signals, res: InJobResult):
        self.steps, self.warn_sig, self.res = steps, warn_sig, res
        self.old: Dict[int, Any] = {}

    def install(self) -> None:
        for name in self._NAMES:
            sig = getattr(signal, name)
            self.old[sig] = signal.signal(sig, self._on)
        self.old[self.warn_sig] = signal.signal(self.warn_sig, self._on)

    def restore(self) -> None:
        for sig, old in self.old.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, old)

    def _on(self, signum: int, _frame: Any) -> None:
        if signum == self.warn_sig:
            self.res.warned = True
        elif signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self.res.terminated = True
        fwd = signal.SIGTERM if signum == signal.SIGINT else signum
        for step in self.steps.values():
            step.signal(fwd)
