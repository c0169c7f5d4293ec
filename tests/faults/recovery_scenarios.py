"""The campaign's in-job recovery scenarios (issue 30, item 6): node losses while the job
recovers inside itself (``slurm_ckpt.torch.recovery``: survivors keep their processes, a
hot spare takes the lost rank, the RAM tier replicated to the partner every step).

A job here is the one of ``tests/test_in_job_recovery.py`` (its launcher and
``tests/recovery_worker.py``): 3 training ranks, each its own simulated node (``n0``..``n2``),
and hot spares (``n3``, ``n4``), real processes, gloo on 127.0.0.1, DDP, 30 steps. The
launcher plays ckpt-srun's part with the membership Coordinator: a rank whose process died
is declared lost (the ranks that died together in one declaration), a spare whose process
died is forgotten. The RAM copies go round the ring of node names (n0 -> n1 -> n2 -> n0):
rank 1's copy is held by rank 2.

Checked (besides the scenario's own expectations):

R1  with RAM partner copies on, a single node loss loses at most the step in flight: every
    survivor's recovery redid at most one completed step (``recomputed <= 1``), restored
    from its own RAM snapshot, and the spare took the lost rank's state from the partner's
    RAM copy;
R2  a job that recovered inside itself ends bitwise equal to the uninterrupted run (every
    rank's final parameters), with the survivors' processes unchanged (one PID each);
R3  a process that was replaced (fenced) commits nothing after it was replaced and exits
    with the fenced status, taking at most the step it was in;
R4  when in-job recovery cannot go on (no ready spare, or no step every rank holds), every
    remaining process ends with one line (``FAILED ... falling back to a relaunch``) and
    the RecoveryFailed exit status, never a traceback or a hang: the relaunch path.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, List, Set

from tests.faults.campaign import Run
from tests.faults.scenarios import scenario
from tests.faults.site import FaultSite

# tests/ is on sys.path (tests.faults.__main__, pytest's rootdir): the in-job recovery
# tests' launcher, reused as is.
from tests.test_in_job_recovery import (  # noqa: E402
    RANKS,
    TOTAL,
    WAIT_S,
    Job,
    Proc,
    bitwise_equal,
    committed,
    finals,
    stopped,
)

#: The collective timeout (a stopped rank counts as lost after it) and the longest wait
#: for a new membership: short, so that the relaunch outcomes end quickly.
TIMEOUT_S = 8.0
DEADLINE_S = 25.0
#: The uninterrupted run's final parameters, once per campaign process.
_REFERENCE: List[Any] = []


def recovery_site(site: FaultSite) -> Dict[str, Any]:
    """No SLURM node and no mount: the job's nodes are directories under the run's base."""
    return {"steps": TOTAL}


def _reference(base: Path) -> List[Any]:
    """The uninterrupted run's final parameters (one run per campaign process)."""
    if not _REFERENCE:
        work = base / "reference"
        work.mkdir()
        job = Job(work, spares=0, timeout_s=TIMEOUT_S, deadline_s=DEADLINE_S)
        try:
            job.watch()
            _REFERENCE.append(finals(work))
        finally:
            job.end()
    return _REFERENCE[0]


class Launcher:
    """One job and the launcher's decisions over it (ckpt-srun's part)."""

    def __init__(self, run: Run, spares: int) -> None:
        self.run = run
        self.work = run.site.base / "job"
        self.work.mkdir()
        self.job = Job(self.work, spares=spares, timeout_s=TIMEOUT_S, deadline_s=DEADLINE_S)
        self.declared: Set[int] = set()  # pids declared lost (or forgotten, for spares)
        self.epochs: List[Any] = []
        self.relaunch = False
        #: survivors' steps printed before each declaration (for R1)
        self.before: Dict[int, int] = {}

    @property
    def procs(self) -> List[Proc]:
        return self.job.procs

    def spare(self, i: int) -> Proc:
        return self.job.procs[RANKS + i]

    def ready(self, n: int) -> None:
        self.job.spares_ready(n)

    def wait_step(self, p: Proc, step: int) -> bool:
        """Until ``p`` printed ``STEP step`` (False if it exited first); polls tightly, so
        that a kill lands within a millisecond or so of the step's end."""
        until = time.monotonic() + WAIT_S
        head = f"STEP {step}\n"
        while time.monotonic() < until:
            if head in p.out.read_text():
                return True
            if p.p.poll() is not None:
                return False
            time.sleep(0.001)
        raise AssertionError(f"task {p.task}: no step {step}: {p.err.read_text()[-2000:]}")

    def kill(self, p: Proc, kind: str) -> None:
        p.p.send_signal(signal.SIGKILL)
        p.p.wait()
        self.run.fault(kind)

    def declare(self, ranks: List[int]) -> Any:
        """``ranks`` are lost (one declaration); None: no ready spare, relaunch instead."""
        ranks = sorted(set(ranks))
        for r in ranks:
            self.declared.add(self.job.ranks[r].p.pid)
        ep = self.job.co.declare_lost(ranks)
        self.epochs.append(ep)
        if ep is None:
            self.relaunch = True
            return None
        for r in ranks:
            task = ep.members[r].task
            self.job.ranks[r] = next(p for p in self.job.procs if p.task == task)
        return ep

    def poll(self) -> None:
        """One look: dead spares forgotten, dead ranks declared lost together."""
        serving = {self.job.ranks[r].p.pid for r in range(RANKS)}
        for p in self.job.spares:
            if p.p.pid not in serving and p.p.poll() is not None and p.p.pid not in self.declared:
                self.declared.add(p.p.pid)
                self.job.co.forget_spare(p.task)
        dead = [
            r
            for r in range(RANKS)
            if self.job.ranks[r].p.poll() not in (None, 0)
            and self.job.ranks[r].p.pid not in self.declared
        ]
        if dead and not self.relaunch:
            self.declare(dead)

    def watch(self) -> None:
        """Until every rank of the current membership finished (or the relaunch path was
        taken); then the job's end, and every process must exit."""
        until = time.monotonic() + WAIT_S
        while True:
            self.poll()
            if self.relaunch:
                break
            if all(self.job.ranks[r].p.poll() == 0 for r in range(RANKS)):
                break
            if time.monotonic() > until:
                raise AssertionError("the job did not finish")
            time.sleep(0.02)
        self.job.co.end()
        for p in self.job.procs:
            try:
                p.p.wait(WAIT_S)
            except subprocess.TimeoutExpired:
                p.end()
                raise AssertionError(
                    f"task {p.task} did not exit: {p.err.read_text()[-2000:]}"
                ) from None

    def end(self) -> None:
        self.job.end()

    # -- the checks ---------------------------------------------------------------------
    def check_recovered(self, survivors: List[Proc], single: bool) -> None:
        """R1 (``single``: one node lost at a time) and R2 for a job that finished."""
        run = self.run
        for r in range(RANKS):
            p = self.job.ranks[r]
            got = p.lines("DONE")
            run.check(bool(got), f"R2 rank {r} (task {p.task}) did not finish: {tail(p)}")
        for p in survivors:
            run.check(len(p.lines("PID")) == 1, f"R2 survivor task {p.task} restarted")
            got = p.lines("DONE")
            if not got:
                continue
            d = json.loads(got[0])
            run.check(d["last"] == TOTAL, f"R2 task {p.task} ended at step {d['last']}")
            for h in d["history"]:
                run.result.lost.append(int(h["recomputed"]))
                if single:
                    run.check(
                        h["recomputed"] <= 1 and h["tier"] == "ram",
                        f"R1 task {p.task}: a single node loss redid {h['recomputed']} "
                        f"step(s), restored from {h['tier']}",
                    )
            run.result.restarts = max(run.result.restarts, len(d["history"]))
        ref = _reference(run.site.base)
        try:
            got_finals = finals(self.work)
        except OSError as exc:
            run.check(False, f"R2 final parameters missing: {exc}")
            return
        for r in range(RANKS):
            run.check(
                bitwise_equal(got_finals[r], ref[r]),
                f"R2 rank {r}'s final parameters differ from the uninterrupted run",
            )

    def check_relaunch(self, procs: List[Proc]) -> None:
        """R4 for the processes left when in-job recovery gave up."""
        from slurm_ckpt.job.recovery import RecoveryFailed

        for p in procs:
            rc = p.p.returncode
            failed = p.lines("FAILED")
            err = p.err.read_text()
            self.run.check(
                rc == RecoveryFailed.exit_code
                and len(failed) == 1
                and "falling back to a relaunch" in failed[0]
                and "Traceback" not in err,
                f"R4 task {p.task}: exit {rc}, FAILED lines {failed}: {err[-1500:]}",
            )


def tail(p: Proc) -> str:
    return p.err.read_text()[-2000:]


# --------------------------------------------------------------------------- scenarios


@scenario("recovery-ram-replication-kill", recovery_site)
def ram_replication_kill(run: Run) -> None:
    """A rank SIGKILLed right after a step, while that step's RAM copy is on its way to
    the partner (0-5 ms after the step's end): the spare takes its place from the
    partner's RAM copy (that step's, or the one before when the copy had not landed)."""
    lc = Launcher(run, spares=1)
    try:
        lc.ready(1)
        victim = lc.job.ranks[run.rng.randrange(RANKS)]
        step = run.rng.randint(4, TOTAL - 6)
        if lc.wait_step(victim, step):
            time.sleep(run.rng.uniform(0, 0.005))
            lc.kill(victim, "rank SIGKILL during RAM replication")
        lc.watch()
        survivors = [p for p in lc.procs[:RANKS] if p is not victim]
        run.check(not lc.relaunch, "R1 a single loss with a ready spare fell back to a relaunch")
        lc.check_recovered(survivors, single=True)
        spare = lc.spare(0)
        got = spare.lines("DONE")
        if got:
            d = json.loads(got[0])
            run.check(
                (d["started"] or {}).get("tier") == "partner-ram",
                f"R1 the spare started from {d['started']}, not the partner's RAM copy",
            )
            run.result.notes.append(
                f"killed after step {step}; spare restored step {d['started']['step']}"
            )
    finally:
        lc.end()


@scenario("recovery-survivor-lost", recovery_site)
def survivor_lost(run: Run) -> None:
    """A rank lost, then a survivor lost while the group re-forms (0-1.5 s after the first
    declaration): the second spare takes the second rank. The job either recovers in-job
    a second time (R2) or, when the second loss took the only RAM copy of the first
    rank's state before the spare read it or the second re-form fails, ends on the
    relaunch path (R4). Either way nothing wrong is restored."""
    lc = Launcher(run, spares=2)
    try:
        lc.ready(2)
        first, second = lc.job.ranks[1], lc.job.ranks[run.rng.choice([0, 2])]
        if lc.wait_step(first, run.rng.randint(4, TOTAL - 10)):
            lc.kill(first, "rank SIGKILL")
            lc.poll()
            time.sleep(run.rng.uniform(0, 1.5))
            lc.kill(second, "survivor SIGKILL during recovery")
        lc.watch()
        survivors = [p for p in lc.procs[:RANKS] if p not in (first, second)]
        if lc.relaunch:
            left = [p for p in lc.procs if p.p.returncode not in (0, -signal.SIGKILL)]
            lc.check_relaunch(left)
            run.result.notes.append("relaunch path")
        else:
            lc.check_recovered(survivors, single=False)
            run.result.notes.append("recovered in-job twice")
    finally:
        lc.end()


@scenario("recovery-partner-pair-lost", recovery_site)
def partner_pair_lost(run: Run) -> None:
    """Rank 1 and the holder of its RAM copy (rank 2) SIGKILLed together, two spares
    ready: rank 1's state is in no memory left and on no disk (the job saves only to the
    RAM tier; the NVMe and warm tiers hold nothing of it), so the spares cannot agree on a
    step with the survivor: every process ends on the clean RecoveryFailed (R4), and the
    launcher relaunches. Checked: nobody trains on from a fresh or foreign state."""
    lc = Launcher(run, spares=2)
    try:
        lc.ready(2)
        a, b = lc.job.ranks[1], lc.job.ranks[2]
        if lc.wait_step(a, run.rng.randint(4, TOTAL - 6)):
            time.sleep(run.rng.uniform(0, 0.05))
            a.p.send_signal(signal.SIGKILL)
            b.p.send_signal(signal.SIGKILL)
            a.p.wait()
            b.p.wait()
            run.fault("partner pair SIGKILL", 2)
        lc.watch()
        run.check(lc.relaunch, "R4 the pair's loss did not end on the relaunch path")
        left = [p for p in lc.procs if p.p.returncode not in (0, -signal.SIGKILL)]
        run.check(bool(left), "R4 no process was left to fall back")
        lc.check_relaunch(left)
        for p in left:
            run.check(not p.lines("DONE"), f"R4 task {p.task} finished a run it cannot have")
        run.result.notes.append(f"relaunch path; {len(left)} process(es) failed cleanly")
    finally:
        lc.end()


@scenario("recovery-partition-fenced", recovery_site)
def partition_fenced(run: Run) -> None:
    """A rank SIGSTOPped (a partitioned node) and declared lost past the collective
    timeout, replaced by the spare; SIGCONTed after the spare trained 1-4 steps: fenced
    (R3), and the job ends bitwise exact (R2) with at most one step redone (R1)."""
    from slurm_ckpt.job.recovery import EXIT_FENCED

    lc = Launcher(run, spares=1)
    try:
        lc.ready(1)
        victim = lc.job.ranks[run.rng.choice([1, 2])]
        spare = lc.spare(0)
        if not lc.wait_step(victim, run.rng.randint(4, TOTAL - 12)):
            run.check(False, f"victim exited early: {tail(victim)}")
            return
        time.sleep(run.rng.uniform(0, 0.02))
        victim.p.send_signal(signal.SIGSTOP)
        stopped(victim.p.pid)
        run.fault("rank SIGSTOP (partition)")
        before = committed(lc.work, victim.node)
        steps_stopped = len(victim.steps())
        rank = next(r for r in range(RANKS) if lc.job.ranks[r] is victim)
        lc.declare([rank])
        k = run.rng.randint(1, 4)
        spare.wait_for(lambda: len(spare.steps()) >= k, f"the spare's step {k}")
        victim.p.send_signal(signal.SIGCONT)
        rc = victim.p.wait(WAIT_S)
        err = victim.err.read_text()
        run.check(
            rc == EXIT_FENCED and "(replaced): fenced" in err,
            f"R3 the woken rank exited {rc}: {err[-1500:]}",
        )
        run.check(
            committed(lc.work, victim.node) == before,
            "R3 the fenced rank committed after it was replaced",
        )
        run.check(
            len(victim.steps()) <= steps_stopped + 1,
            f"R3 the fenced rank took {len(victim.steps()) - steps_stopped} steps after waking",
        )
        lc.watch()
        survivors = [p for p in lc.procs[:RANKS] if p is not victim]
        lc.check_recovered(survivors, single=True)
    finally:
        lc.end()


@scenario("recovery-spare-lost", recovery_site)
def spare_lost(run: Run) -> None:
    """A hot spare SIGKILLed: while it waits (then a rank lost: the second spare takes it)
    or while it takes a lost rank (0-1.5 s after the declaration: the launcher declares
    the rank lost again and names the second spare). A spare that dies while waiting is
    never named (forgotten), and the single loss after it costs at most one step (R1, R2).
    A spare lost while it takes a rank is a second loss during a re-form: the job either
    recovers in-job with the second spare (R2) or ends on the relaunch path (R4)."""
    lc = Launcher(run, spares=2)
    try:
        lc.ready(2)
        waiting = run.rng.random() < 0.5
        victim = lc.job.ranks[run.rng.randrange(RANKS)]
        step = run.rng.randint(4, TOTAL - 10)
        first = lc.spare(0)
        if waiting:
            lc.kill(first, "hot spare SIGKILL while waiting")
            lc.poll()  # forgotten before any rank is lost
        if lc.wait_step(victim, step):
            lc.kill(victim, "rank SIGKILL")
            lc.poll()
            ep = lc.epochs[-1] if lc.epochs else None
            if not waiting and ep is not None:
                taker = lc.job.ranks[ep.lost[0]]
                time.sleep(run.rng.uniform(0, 1.5))
                lc.kill(taker, "hot spare SIGKILL while taking a rank")
        lc.watch()
        survivors = [p for p in lc.procs[:RANKS] if p is not victim]
        if waiting:
            run.check(not lc.relaunch, "R1 a spare was left, yet the job fell back to a relaunch")
            lc.check_recovered(survivors, single=True)
            named = {m.task for ep in lc.epochs if ep is not None for m in ep.members.values()}
            run.check(first.task not in named, "a dead spare was named in a membership")
        elif lc.relaunch:
            left = [p for p in lc.procs if p.p.returncode not in (0, -signal.SIGKILL)]
            lc.check_relaunch(left)
            run.result.notes.append("relaunch path after the second re-form failed")
        else:
            lc.check_recovered(survivors, single=False)
        run.result.notes.append(f"spare lost {'while waiting' if waiting else 'taking a rank'}")
    finally:
        lc.end()
