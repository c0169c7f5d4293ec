"""In-job recovery (issue 30, items 2 and 4, library side): the surviving ranks keep their
processes, a hot spare takes the lost rank's place, and the run ends bitwise equal to an
uninterrupted one.

Real processes (tests/recovery_worker.py: 3 training ranks, each its own simulated node,
plus a hot spare on a fourth), gloo over 127.0.0.1, partner copies and the RAM tier
every step. The launcher here plays ckpt-srun's part with the membership protocol's
Coordinator (core/membership.py): epoch 0 at the launch, and when a rank's process dies
(seen by its pid), ``declare_lost`` puts the ready spare in its place.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
import torch

from slurm_ckpt import Checkpointer
from slurm_ckpt.core.lease import StaleGeneration
from slurm_ckpt.core.membership import Coordinator, Member, RecoveryDir, Spare
from slurm_ckpt.job.partner_net import EPOCH_ENV, launch_tag
from slurm_ckpt.job.partner_wire import Identity, WireError, client_handshake, server_handshake
from slurm_ckpt.job.recovery import EXIT_FENCED, Recovery, RecoveryFailed

WORKER = str(Path(__file__).with_name("recovery_worker.py"))
RANKS = 3
TOTAL = 30
#: A bound on any wait of the launcher (a hang fails the test instead of blocking it).
WAIT_S = 240.0


class Proc:
    """One worker process; its stdout lines and stderr in files."""

    def __init__(
        self,
        work: Path,
        task: int,
        mode: str,
        spare: bool,
        timeout_s: float,
        deadline_s: float,
        spare_setup_s: float = 0.0,
    ):
        self.task, self.node = task, f"n{task}"
        self.out = work / f"task{task}.out"
        self.err = work / f"task{task}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
        env.update(
            SLURM_CKPT_RECOVERY_DIR=str(work / "recovery"),
            SLURM_CKPT_TASK=str(task),
            SLURM_CKPT_HOST="127.0.0.1",
            SLURM_CKPT_TIMELINE=str(work),  # rank 0's records: work/rank0.jsonl
        )
        if spare:
            env["SLURM_CKPT_SPARE"] = "1"
            env["SPARE_SETUP_S"] = str(spare_setup_s)
        args = [WORKER, str(work), self.node, mode, str(TOTAL), str(timeout_s), str(deadline_s)]
        self.p = subprocess.Popen(
            [sys.executable, *args],
            stdout=self.out.open("w"),
            stderr=self.err.open("w"),
            env=env,
        )

    def lines(self, head: str) -> List[str]:
        return [
            ln.split(" ", 1)[1]
            for ln in self.out.read_text().splitlines()
            if ln.startswith(head + " ")
        ]

    def steps(self) -> List[int]:
        return [int(s) for s in self.lines("STEP")]

    def done(self) -> Dict[str, Any]:
        got = self.lines("DONE")
        assert got, f"task {self.task} did not finish: {self.err.read_text()[-3000:]}"
        return dict(json.loads(got[0]))

    def wait_for(self, pred: Any, what: str) -> None:
        until = time.monotonic() + WAIT_S
        while not pred():
            if self.p.poll() is not None and not pred():
                raise AssertionError(
                    f"task {self.task} exited before {what}: {self.err.read_text()[-3000:]}"
                )
            if time.monotonic() > until:
                raise AssertionError(f"task {self.task}: no {what}: {self.err.read_text()[-3000:]}")
            time.sleep(0.02)

    def end(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


class Job:
    """The launcher: ranks, spares, and the coordinator's decisions."""

    def __init__(
        self,
        work: Path,
        mode: str = "ddp",
        spares: int = 1,
        timeout_s: float = 20.0,
        deadline_s: float = 60.0,
        spare_setup_s: float = 0.0,
    ):
        self.work = work
        self.spare_setup_s = spare_setup_s
        self.dir = RecoveryDir(str(work / "recovery"), create=True)
        self.co = Coordinator(self.dir)
        self.co.launch({r: Member("127.0.0.1", r) for r in range(RANKS)})
        self.ranks: Dict[int, Proc] = {}
        self.procs: List[Proc] = []
        for r in range(RANKS):
            self.ranks[r] = self._start(r, mode, False, timeout_s, deadline_s)
        self.spares = [
            self._start(RANKS + i, mode, True, timeout_s, deadline_s) for i in range(spares)
        ]
        self.lost: Dict[int, Optional[object]] = {}

    def _start(
        self, task: int, mode: str, spare: bool, timeout_s: float, deadline_s: float
    ) -> Proc:
        p = Proc(self.work, task, mode, spare, timeout_s, deadline_s, self.spare_setup_s)
        self.procs.append(p)
        return p

    def spares_ready(self, n: int) -> None:
        until = time.monotonic() + WAIT_S
        while len(self.dir.spares()) < n:
            assert time.monotonic() < until, "spares not ready"
            time.sleep(0.05)

    def declare(self, rank: int) -> Any:
        """``rank`` is lost: the spare takes it (or None: no spare ready)."""
        ep = self.co.declare_lost([rank])
        self.lost[rank] = ep
        if ep is not None:
            task = ep.members[rank].task
            self.ranks[rank] = next(p for p in self.procs if p.task == task)
        return ep

    def watch(self) -> None:
        """Until every rank of the current epoch finished: a rank that dies is declared
        lost (its pid's death is the detection here); then the end for the spares."""
        until = time.monotonic() + WAIT_S
        while True:
            cur = self.co.current
            assert cur is not None
            live = [self.ranks[r] for r in range(RANKS)]
            for r, p in enumerate(live):
                if p.p.poll() not in (None, 0) and r not in self.lost:
                    self.declare(r)
            if all(p.p.poll() == 0 for p in [self.ranks[r] for r in range(RANKS)]):
                break
            if (
                any(p.p.poll() not in (None, 0) for p in [self.ranks[r] for r in range(RANKS)])
                and all(v is None for v in self.lost.values())
                and self.lost
            ):
                break  # no spare: the survivors fall back (their own exit)
            assert time.monotonic() < until, "the job did not finish"
            time.sleep(0.05)
        self.co.end()
        for p in self.procs:
            try:
                p.p.wait(WAIT_S)
            except subprocess.TimeoutExpired:
                p.end()
                raise AssertionError(
                    f"task {p.task} did not exit: {p.err.read_text()[-2000:]}"
                ) from None

    def end(self) -> None:
        for p in self.procs:
            p.end()


@pytest.fixture
def jobs(tmp_path: Path) -> Any:
    made: List[Job] = []

    def start(name: str, **kw: Any) -> Job:
        (tmp_path / name).mkdir()
        made.append(Job(tmp_path / name, **kw))
        return made[-1]

    yield start
    for j in made:
        j.end()


def finals(work: Path) -> List[Dict[str, torch.Tensor]]:
    return [torch.load(work / f"final.rank{r}.pt", weights_only=True) for r in range(RANKS)]


def bitwise_equal(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype
        and a[k].shape == b[k].shape
        and bytes(a[k].numpy().tobytes()) == bytes(b[k].numpy().tobytes())
        for k in a
    )


_REFERENCE: Dict[str, List[Dict[str, torch.Tensor]]] = {}


def reference(jobs: Any, mode: str) -> List[Dict[str, torch.Tensor]]:
    """The same run without a failure (no spare); run once per mode and session."""
    if mode not in _REFERENCE:
        ref = jobs(f"ref-{mode}", mode=mode, spares=0)
        ref.watch()
        for r in range(RANKS):
            assert ref.ranks[r].done()["history"] == []
        _REFERENCE[mode] = finals(ref.work)
    return _REFERENCE[mode]


def pids(p: Proc) -> List[int]:
    return [int(x) for x in p.lines("PID")]


def kill_mid_run(jobs: Any, mode: str, **kw: Any) -> Job:
    job = jobs(f"run-{mode}", mode=mode, **kw)
    job.spares_ready(1)
    victim = job.ranks[1]
    victim.wait_for(lambda: len(victim.steps()) >= 8, "step 8")
    victim.p.send_signal(signal.SIGKILL)
    job.watch()
    return job


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_lost_rank_is_replaced_by_the_hot_spare_inside_the_job(jobs: Any, mode: str) -> None:
    job = kill_mid_run(jobs, mode)
    survivors = [job.procs[0], job.procs[2]]
    spare = job.procs[RANKS]
    ep = job.lost[1]
    assert ep is not None and ep.epoch == 1 and ep.members[1].task == spare.task
    for p in survivors:
        assert len(pids(p)) == 1  # the same process before and after
        d = p.done()
        assert d["last"] == TOTAL and len(d["history"]) == 1
        h = d["history"][0]
        assert h["epoch"] == 1 and h["tier"] == "ram" and h["recomputed"] <= 1
    d = spare.done()
    assert d["rank"] == 1 and d["last"] == TOTAL
    assert spare.lines("RANK") == ["1"]
    restored = job.procs[0].done()["history"][0]["step"]
    # the spare's shard came from the partner's memory, at the step every rank restored
    assert d["started"] == {"step": restored, "tier": "partner-ram"}
    assert min(spare.steps()) == restored + 1
    assert job.dir.done_ranks() == [0, 1, 2]
    # rank 0's timeline tells goodput what the failure cost
    events = [json.loads(ln) for ln in (job.work / "rank0.jsonl").read_text().splitlines()]
    mine = [e for e in events if e["event"] in ("in_job_failure", "reform_start", "reform_end")]
    assert [e["event"] for e in mine] == ["in_job_failure", "reform_start", "reform_end"]
    assert mine[1]["epoch"] == 1 and mine[1]["lost"] == [1]
    end = mine[2]
    redone = job.procs[0].done()["history"][0]["recomputed"]
    assert (end["step"], end["tier"], end["recomputed"]) == (restored, "ram", redone)
    assert end["seconds"] > 0
    # the step loop reports progress (goodput's productive time), the first step after
    # the re-form at once ("training again")
    progress = [e for e in events if e["event"] == "progress"]
    assert progress and progress[0]["step"] == 1, progress
    after = [e for e in progress if e["t"] >= end["t"]]
    assert after and after[0]["step"] == restored + 1, (end, progress)
    want = reference(jobs, mode)
    got = finals(job.work)
    for r in range(RANKS):
        assert bitwise_equal(got[r], want[r]), f"rank {r} differs from the uninterrupted run"


#: The spare's setup after it learns its rank, made slow (seconds), in the test below.
SLOW_SETUP_S = 4.0
#: The resolution of the timeline's ``restore_s`` (rounded to ms), and a margin for it.
RESOLUTION_S = 0.002


def test_fsdp2s_wait_for_the_spare_is_reform_time_not_restore_time(jobs: Any) -> None:
    """FSDP2's ``fully_shard`` runs no collective: without a barrier where the group is
    first usable, the survivors' wait for a slow spare (here: it sleeps SLOW_SETUP_S
    once it knows its rank) landed in the restore's min-reduce, and goodput counted it
    as restore time. Now the re-form ends at that barrier, so rank 0's restore begins
    only after the spare's setup is over (its ``READY`` mark): an order of events on one
    clock, not a bound on any duration. Without the barrier it began about SLOW_SETUP_S
    before that mark."""
    job = kill_mid_run(jobs, "fsdp", spare_setup_s=SLOW_SETUP_S)
    events = [json.loads(ln) for ln in (job.work / "rank0.jsonl").read_text().splitlines()]
    [end] = [e for e in events if e["event"] == "reform_end"]
    spare = job.procs[RANKS]
    [ready] = [float(t) for t in spare.lines("READY")]
    # reform_end is written at the restore's end ("t", time.time()): its start is that
    # less restore_s. RESOLUTION_S: the record's rounding (ms), nothing of the machine.
    restore_began = end["t"] - end["restore_s"]
    assert restore_began >= ready - RESOLUTION_S, (end, ready)
    assert end["seconds"] >= end["ready_s"] + end["restore_s"] - 0.01, end
    assert spare.done()["started"]["tier"] == "partner-ram"


def stopped(pid: int) -> None:
    """Until the kernel says ``pid`` is stopped (state T)."""
    for _ in range(100_000):
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        os.sched_yield()
    raise AssertionError(f"process {pid} did not stop")


def committed(work: Path, node: str) -> List[str]:
    """Every step directory committed on a node's local tier (every series)."""
    return sorted(str(p.relative_to(work)) for p in (work / node / "local").rglob("manifest.json"))


def test_a_stopped_rank_that_was_replaced_is_fenced_when_it_wakes(jobs: Any) -> None:
    """A rank SIGSTOPped past the collective timeout (a partitioned node) is declared
    lost and replaced by the spare; SIGCONTed once the spare trains, it learns it is
    out, commits nothing, serves nothing, and exits; the run ends bitwise exact."""
    job = jobs("fence", timeout_s=4.0)
    job.spares_ready(1)
    victim, spare = job.ranks[1], job.procs[RANKS]
    victim.wait_for(lambda: len(victim.steps()) >= 8, "step 8")
    victim.p.send_signal(signal.SIGSTOP)
    stopped(victim.p.pid)
    before = committed(job.work, victim.node)
    ep = job.declare(1)  # ckpt-srun's verdict on its missed heartbeats
    assert ep is not None and ep.members[1].task == spare.task
    spare.wait_for(lambda: len(spare.steps()) >= 3, "the spare's steps")
    steps_stopped = victim.steps()
    victim.p.send_signal(signal.SIGCONT)
    assert victim.p.wait(WAIT_S) == EXIT_FENCED
    err = victim.err.read_text()
    assert "is not in membership epoch 1 (replaced): fenced" in err, err[-3000:]
    assert committed(job.work, victim.node) == before
    assert len(victim.steps()) <= len(steps_stopped) + 1  # at most the step it was in
    job.watch()
    for p in (job.procs[0], job.procs[2]):
        assert len(pids(p)) == 1 and p.done()["history"][0]["tier"] == "ram"
    assert spare.done()["started"]["tier"] == "partner-ram"
    want = reference(jobs, "ddp")
    got = finals(job.work)
    for r in range(RANKS):
        assert bitwise_equal(got[r], want[r]), f"rank {r} differs from the uninterrupted run"


def test_without_a_ready_spare_the_survivors_fail_clearly(jobs: Any) -> None:
    """No spare: the coordinator writes no new epoch (declare_lost gives None: the caller
    relaunches), and each survivor ends with one line saying so, not a traceback."""
    job = jobs("nospare", spares=0, deadline_s=3.0)
    victim = job.ranks[1]
    victim.wait_for(lambda: len(victim.steps()) >= 5, "step 5")
    victim.p.send_signal(signal.SIGKILL)
    victim.p.wait()
    assert job.declare(1) is None
    assert job.dir.newest_epoch() is not None and job.dir.newest_epoch().epoch == 0
    for r in (0, 2):
        p = job.ranks[r]
        assert p.p.wait(WAIT_S) == RecoveryFailed.exit_code
        failed = p.lines("FAILED")
        assert len(failed) == 1 and "no new membership within 3s" in failed[0], p.err.read_text()[
            -2000:
        ]
        assert "falling back to a relaunch" in failed[0]
        assert "Traceback" not in p.err.read_text()
    assert job.dir.done_ranks() == []


def test_sessions_of_another_epoch_never_authenticate(monkeypatch: pytest.MonkeyPatch) -> None:
    """The partner link's handshake binds the launch tag, and the tag binds the epoch:
    a process of an older epoch can neither serve a newer one nor reach it."""
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.delenv(EPOCH_ENV, raising=False)
    assert launch_tag() == "0/0"
    monkeypatch.setenv(EPOCH_ENV, "2")
    assert launch_tag() == "0/0/e2"
    secret = os.urandom(32)

    def handshake(client: str, server: str) -> bool:
        a, b = socket.socketpair()
        errors: List[BaseException] = []

        def serve() -> None:
            try:
                server_handshake(b, Identity(secret, 0, 3, server, "run"), time.monotonic() + 5)
            except (WireError, OSError) as exc:
                errors.append(exc)
            finally:
                b.close()

        t = threading.Thread(target=serve)
        t.start()
        try:
            client_handshake(a, Identity(secret, 1, 3, client, "run"), 0, timeout=5)
            ok = True
        except (WireError, OSError):
            ok = False
        finally:
            a.close()
            t.join()
        return ok and not errors

    assert handshake("0/0/e1", "0/0/e1")
    assert not handshake("0/0/e1", "0/0/e2")  # a stale client
    assert not handshake("0/0/e2", "0/0/e1")  # a stale server


def test_a_replaced_process_commits_nothing(tmp_path: Path) -> None:
    """The membership fences commits: once an epoch names another process for this
    rank, a save of this one is refused before its commit."""
    rd = RecoveryDir(str(tmp_path / "recovery"), create=True)
    co = Coordinator(rd)
    e0 = co.launch({0: Member("127.0.0.1", 0), 1: Member("127.0.0.1", 1)})
    rec = Recovery(rd.path, environ={"SLURM_CKPT_TASK": "1"})
    rec.epoch, rec.rank = e0, 1
    rec.check_member()  # in the newest epoch: fine
    local = tmp_path / "local"
    local.mkdir()
    with Checkpointer(local=local, key="run", rank=1, world_size=2, install_signals=False) as ck:
        ck.guard_commits(rec.check_member)
        ck.save({"x": torch.ones(3)}, step=1)
        ck.wait()
        rd.write_spare(Spare(7, "127.0.0.1", os.getpid()))
        assert co.declare_lost([1]) is not None
        with pytest.raises(StaleGeneration, match="replaced in membership epoch 1"):
            rec.check_member()
        ck.save({"x": torch.ones(3)}, step=2)
        ck.wait()
    assert [p.parent.name for p in local.rglob("manifest.json")] == ["step-0000000001"]
