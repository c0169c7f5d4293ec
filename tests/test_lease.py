"""One writer per series, and a rollback that sticks (issue 29, "never silently wrong").

Two processes on one key: the second gets one line naming the first and touches
nothing; a requeue of the same job takes over with the next generation; a writer taken
over (stopped, then woken) can commit nothing. A rollback (restore an older step, save
on) retires the newer steps: after a crash the automatic restore gives the new lineage's
newest, ``list`` shows the old steps as retired, and they stay restorable by lineage.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest
from helpers.cli import ckpt_slurm
from helpers.site import Site

from slurm_ckpt import Checkpointer
from slurm_ckpt.core.lease import LEASE_FILE, LeaseRecord, StaleGeneration
from slurm_ckpt.core.lineage import Lineage, SeriesView, lineage_of
from slurm_ckpt.core.names import current_user
from slurm_ckpt.core.retention import (
    CkptInfo,
    RetentionPolicy,
    plan_local_deletions,
    plan_warm_deletions,
)
from slurm_ckpt.errors import CkptError
from slurm_ckpt.job.lease import STALE_AFTER_S
from slurm_ckpt.tiers.posix import PosixTier

WORKER = Path(__file__).with_name("lease_worker.py")
USER = current_user()


class Worker:
    """A Checkpointer in a child process, driven line by line (tests/lease_worker.py)."""

    def __init__(self, local: Path, warm: Optional[Path], *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), str(local), str(warm or ""), "run", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.ready = self.read()
        self.pid = self.proc.pid

    def read(self) -> Dict[str, object]:
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            self.proc.wait(60)
            raise AssertionError(f"worker ended: {self.proc.stderr.read()}")  # type: ignore[union-attr]
        return json.loads(line)

    def ask(self, cmd: str) -> Dict[str, object]:
        self.proc.stdin.write(cmd + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self.read()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(60)

    def finish(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # type: ignore[union-attr]
            self.proc.wait(60)


def attempt(local: Path, warm: Optional[Path], *args: str) -> subprocess.CompletedProcess:
    """A second writer in its own process: construct, and end."""
    code = (
        "import sys; from slurm_ckpt import Checkpointer; from slurm_ckpt.errors import CkptError\n"
        "a = sys.argv[1:]\n"
        "try:\n"
        "    c = Checkpointer(local=a[0], warm=a[1] or None, key='run', install_signals=False,"
        " node=a[2] or None, job=a[3] or None)\n"
        "except CkptError as e:\n"
        "    print(e, file=sys.stderr); sys.exit(3)\n"
        "c.close()\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, str(local), str(warm or ""), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def tree(*roots: Path) -> List[Tuple[str, int, int, int]]:
    """Every entry below the series directories: path, inode, size, mtime (ns)."""
    out = []
    for root in roots:
        base = root / USER / "run"
        for dirpath, dirs, files in os.walk(base):
            for name in dirs + files:
                p = Path(dirpath) / name
                st = p.lstat()
                out.append((str(p), st.st_ino, st.st_size, st.st_mtime_ns))
    return sorted(out)


def record(root: Path) -> LeaseRecord:
    rec = LeaseRecord.from_bytes((root / USER / "run" / LEASE_FILE).read_bytes())
    assert rec is not None
    return rec


def generation(tier: PosixTier, step: int) -> int:
    return tier.manifest(USER, "run", step).meta["generation"]


@pytest.fixture
def dirs(tmp_path: Path) -> Tuple[Path, Path]:
    return tmp_path / "local", tmp_path / "warm"


def test_second_process_on_one_key_gets_one_line_and_touches_nothing(dirs) -> None:
    local, warm = dirs
    first = Worker(local, warm)
    try:
        for step in (1, 2, 3):
            assert first.ask(f"save {step}")["committed"] == step
        before = tree(local, warm)
        r = attempt(local, warm, "", "")
        assert r.returncode == 3
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1, r.stderr
        assert f"key run is being written by pid {first.pid} on node " in lines[0]
        assert "takeover=True" in lines[0] and "another key" in lines[0]
        assert tree(local, warm) == before  # nothing of the first's series touched
        # ... and the first goes on as if nothing happened
        assert first.ask("save 4") == {"saved": 4, "committed": 4, "error": None}
        assert first.ask("close") == {"closed": True}
    finally:
        first.finish()
    # closed: the next writer takes over at once, with the next generation
    with Checkpointer(local=local, warm=warm, key="run", install_signals=False) as c:
        assert c.restore().step == 4
        c.save({"x": 5}, step=5)
    assert generation(PosixTier("pfs", str(warm)), 5) == 2
    assert generation(PosixTier("local", str(local)), 4) == 1


def test_second_checkpointer_in_one_process_is_flagged(dirs) -> None:
    local, warm = dirs
    first = Checkpointer(local=local, warm=warm, key="run", install_signals=False)
    with pytest.raises(CkptError, match=rf"key run is being written by pid {os.getpid()} "):
        Checkpointer(local=local, key="run", install_signals=False)
    first.close()
    Checkpointer(local=local, warm=warm, key="run", install_signals=False).close()


def test_requeue_of_the_same_job_takes_over(tmp_path: Path) -> None:
    warm = tmp_path / "warm"
    a = Worker(tmp_path / "nodeA", warm, "--node", "nodeA", "--job", "4242")
    for step in (1, 2, 3):
        a.ask(f"save {step}")
    a.kill()  # the node went away: the warm-tier record is fresh and not released
    # another job on another node: refused while the heartbeat is fresh
    r = attempt(tmp_path / "nodeC", warm, "nodeC", "999")
    assert r.returncode == 3 and f"pid {a.pid} on node nodeA" in r.stderr, r.stderr
    # the same job, requeued onto another node: takes over, next generation
    with Checkpointer(
        local=tmp_path / "nodeB",
        warm=warm,
        key="run",
        node="nodeB",
        job="4242",
        install_signals=False,
    ) as b:
        got = b.restore()
        assert (got.step, got.tier) == (3, "pfs")
        b.save({"x": 4}, step=4)
        b.wait()
        assert record(warm).generation == 2 and record(warm).node == "nodeB"
    assert generation(PosixTier("pfs", str(warm)), 4) == 2
    assert record(warm).released
    # a dead holder on the same node (pid gone) is taken over too
    a2 = Worker(tmp_path / "nodeA", warm, "--node", "nodeA", "--job", "4243")
    a2.kill()
    with Checkpointer(
        local=tmp_path / "nodeA",
        warm=warm,
        key="run",
        node="nodeA",
        job="4244",
        install_signals=False,
    ) as again:
        assert again.restore().step == 4
    assert record(warm).generation == 4


def test_a_stale_heartbeat_of_another_node_is_taken_over(tmp_path: Path) -> None:
    warm = tmp_path / "warm"
    a = Worker(tmp_path / "nodeA", warm, "--node", "nodeA", "--job", "1")
    a.ask("save 1")
    a.kill()
    rec = record(warm)
    old = LeaseRecord(**{**rec.__dict__, "heartbeat": time.time() - STALE_AFTER_S - 5})
    PosixTier("pfs", str(warm)).write_lease(USER, "run", old.to_bytes())
    r = attempt(tmp_path / "nodeC", warm, "nodeC", "2")
    assert r.returncode == 0, r.stderr
    assert record(warm).generation == 2


def test_a_stale_writer_that_wakes_up_cannot_commit(dirs) -> None:
    local, warm = dirs
    a = Worker(local, warm)
    try:
        for step in (1, 2, 3):
            a.ask(f"save {step}")
        os.kill(a.pid, signal.SIGSTOP)  # hung: alive, holding the lease
        with pytest.raises(CkptError, match=f"pid {a.pid}"):
            Checkpointer(local=local, warm=warm, key="run", install_signals=False)
        b = Checkpointer(local=local, warm=warm, key="run", takeover=True, install_signals=False)
        assert b.restore().step == 3
        b.save({"x": 4}, step=4)
        b.wait()
        os.kill(a.pid, signal.SIGCONT)
        woke = a.ask("save 5")
        assert woke["committed"] == 3 and "taken over" in str(woke["error"]), woke
        assert "taken over" in str(a.ask("save 6")["error"])  # and stays stopped for good
        for root in (local, warm):
            steps = [s.step for s in PosixTier("t", str(root)).steps(USER, "run")]
            assert steps == [1, 2, 3, 4] or steps == [2, 3, 4] or steps[-1] == 4, steps
            assert not (root / USER / "run" / "step-0000000005").exists()
            assert not (root / USER / "run" / "step-0000000006").exists()
        b.close()
        assert record(local).generation == 2
    finally:
        if a.proc.poll() is None:
            os.kill(a.pid, signal.SIGCONT)
        a.finish()
    with Checkpointer(local=local, warm=warm, key="run", install_signals=False) as c:
        got = c.restore()
        assert (got.step, got.state) == (4, {"x": 4})


def test_a_stale_writers_flush_never_replaces_a_newer_generation(dirs) -> None:
    """The warm tier's fence: a copy of generation 1 cannot replace generation 2's step."""
    local, warm = dirs
    with Checkpointer(local=local, warm=warm, key="run", install_signals=False) as c:
        c.save({"x": 1}, step=1)
    with Checkpointer(local=local, warm=warm, key="run", install_signals=False) as c:
        c.restore()
        c.save({"x": 2}, step=2)
    lt, wt = PosixTier("local", str(local)), PosixTier("pfs", str(warm))
    from slurm_ckpt.tiers.copy import copy_checkpoint

    # a generation-1 copy of step 2 appears locally (written by the stale writer)
    wt_m = wt.manifest(USER, "run", 2)
    lt.delete(USER, "run", 2)
    with lt.writer(USER, "run", 2, meta={**wt_m.meta, "generation": 1}) as w:
        w.write_buffers({"rank-00000/index.json": b"{}"})
    with pytest.raises(CkptError, match="newer writer"):
        copy_checkpoint(lt, wt, USER, "run", 2, replace_older=True)
    assert generation(wt, 2) == 2
    assert StaleGeneration.__mro__[1] is CkptError


def test_rollback_sticks_after_a_crash(tmp_path: Path) -> None:
    site = Site(tmp_path)
    local, warm = site.roots["local"], site.roots["pfs"]
    first = Worker(local, warm)
    first.ask("save 10")
    first.ask("save 20")
    first.ask("close")
    first.finish()
    second = Worker(local, warm)
    assert second.ask("restore 10")["restored"] == 10
    second.ask("save 11")
    second.ask("save 12")
    second.kill()  # crash
    with Checkpointer(local=local, warm=warm, key="run", install_signals=False) as c:
        got = c.restore()
        assert (got.step, got.state) == (12, {"x": 12})  # today: 20, the abandoned timeline
        assert got.lineage == "g2@10"
        with pytest.raises(CkptError, match=r"step is retired \(lineage main"):
            c.restore(step=20)
        old = c.restore(step=20, lineage="main")
        assert (old.step, old.state, old.retired) == (20, {"x": 20}, True)
        got = c.restore()  # back to the current one: nothing branches
        assert got.step == 12
        c.save({"x": 13}, step=13)
    r = ckpt_slurm("list", "run", "--json", config=site.cfg_path)
    assert r.returncode == 0, r.stderr
    rows = {(x["tier"], x["step"]): x for x in json.loads(r.stdout)["checkpoints"]}
    assert rows[("pfs", 20)]["retired"] and rows[("pfs", 20)]["lineage"] == "main"
    assert not rows[("pfs", 12)]["retired"] and rows[("pfs", 12)]["lineage"] == "g2@10"
    assert not rows[("pfs", 10)]["retired"]
    text = ckpt_slurm("list", "run", config=site.cfg_path).stdout
    assert "main (retired)" in text
    r = ckpt_slurm(
        "restore",
        "run",
        "--step",
        "20",
        "--lineage",
        "main",
        "--to",
        str(tmp_path / "out"),
        config=site.cfg_path,
    )
    assert r.returncode == 0 and "lineage main, retired" in r.stdout, r.stdout + r.stderr


def test_the_new_lineage_reaching_a_retired_step_number_supersedes_it(dirs) -> None:
    local, warm = dirs
    with Checkpointer(local=local, warm=warm, key="run", install_signals=False) as c:
        for step in (1, 2, 3):
            c.save({"x": step}, step=step)
    with Checkpointer(local=local, warm=warm, key="run", install_signals=False) as c:
        c.restore(step=1)
        c.save({"x": "b2"}, step=2)
        c.save({"x": "b3"}, step=3)
    with Checkpointer(local=local, warm=warm, key="run", install_signals=False) as c:
        got = c.restore()
        assert (got.step, got.state) == (3, {"x": "b3"})
        assert got.lineage == "g2@1"
        for tier in ("local", "pfs"):
            assert c.restore(tiers=[tier]).state == {"x": "b3"}


def test_retention_does_not_count_retired_steps() -> None:
    """Retired steps 20, 19, 18 (a rollback to 10) never crowd out the new lineage."""
    policy = RetentionPolicy(keep_local=2, keep_warm=2, keep_warm_every_s=0)
    old = [
        CkptInfo(s, wall_time=s, verified=True, warm_verified=True, retired=True, lineage="main")
        for s in (18, 19, 20)
    ]
    new = [CkptInfo(s, wall_time=100 + s, verified=True, warm_verified=True) for s in (11, 12)]
    assert plan_local_deletions(old + new, policy) == [18, 19, 20]
    # warm: the new lineage's newest two are kept, and the retired lineage's newest as history
    assert plan_warm_deletions(old + new, now=1000, policy=policy) == [18, 19]


def test_a_chain_of_rollbacks_keeps_each_ancestor_up_to_its_branch_point() -> None:
    """main 1..20; back to 10 (g2@10: 11..15); back to 12 (g3@12: 13, 14). Current: main up
    to 10, g2@10 up to 12, all of g3@12; the rest is retired, whichever step is higher."""
    main = Lineage()
    b2 = main.branch("g2@10", 10)
    b3 = b2.branch("g3@12", 12)
    items = [(s, {"generation": 1, **main.meta()}, s) for s in range(1, 21)]
    items += [(s, {"generation": 2, **b2.meta()}, 100 + s) for s in range(11, 16)]
    items += [(s, {"generation": 3, **b3.meta()}, 200 + s) for s in (13, 14)]
    view = SeriesView.of(items)
    assert view.head.name == "g3@12" and view.newest_active() == 14
    active = sorted((s, lineage_of(m).name) for s, m, _ in items if view.active(s, m))
    assert active == [(s, "main") for s in range(1, 11)] + [
        (11, "g2@10"),
        (12, "g2@10"),
        (13, "g3@12"),
        (14, "g3@12"),
    ]


@pytest.mark.parametrize(
    "doc",
    [
        b"not json",
        b'{"key": "run", "node": "n\\n1", "pid": 1, "generation": 1, "since": 1, "heartbeat": 1}',
        b'{"key": "run", "node": "n", "pid": true, "generation": 1, "since": 1, "heartbeat": 1}',
        b'{"key": "run", "node": "n", "pid": 1, "generation": -1, "since": 1, "heartbeat": 1}',
        b'{"key": "run", "node": "n", "pid": 1, "generation": 1, "since": 1e999, "heartbeat": 1}',
        b"[" * 5000,
    ],
)
def test_a_malformed_lease_record_reads_as_none(doc: bytes) -> None:
    """The record is the user's file, read by whoever writes next: anything odd is no
    record (the next writer rewrites it), never a crash or a forged line."""
    assert LeaseRecord.from_bytes(doc) is None


def test_a_requeue_that_resumed_behind_the_old_newest_supersedes_it(tmp_path: Path) -> None:
    """Generation 1 saved 15 (flushed) and 20 (its flush never happened); the requeued
    job (generation 2, another node) resumed from 15 and saved 16, 17; then the old
    node's 20 reaches the warm tier (its epilog, late). The restart takes 17: 20 is the
    old timeline, retired, and still restorable by step and lineage."""
    warm = tmp_path / "warm"
    lost = Checkpointer(
        local=tmp_path / "nodeA",
        warm=warm,
        key="run",
        node="nodeA",
        job="7",
        install_signals=False,
    )
    for step in (15, 20):
        lost.save({"x": step}, step=step)
    lost.close()
    wt = PosixTier("pfs", str(warm))
    wt.delete(USER, "run", 20)  # its flush never happened
    with Checkpointer(
        local=tmp_path / "nodeB",
        warm=warm,
        key="run",
        node="nodeB",
        job="7",
        install_signals=False,
    ) as b:
        assert b.restore().step == 15
        for step in (16, 17):
            b.save({"x": step}, step=step)
    from slurm_ckpt.tiers.copy import copy_checkpoint

    copy_checkpoint(PosixTier("local", str(tmp_path / "nodeA")), wt, USER, "run", 20)
    with Checkpointer(
        local=tmp_path / "nodeC",
        warm=warm,
        key="run",
        node="nodeC",
        job="7",
        install_signals=False,
    ) as c:
        got = c.restore()
        assert (got.step, got.state) == (17, {"x": 17})  # today: 20, the old timeline
        old = c.restore(step=20, lineage="main")
        assert (old.step, old.retired) == (20, True)


def test_a_dropped_unclosed_checkpointer_lets_go_of_its_key(dirs) -> None:
    """``Checkpointer(...).restore()`` and dropped (no close()): the next one is not refused."""
    local, warm = dirs
    with Checkpointer(local=local, warm=warm, key="run", install_signals=False) as c:
        c.save({"x": 1}, step=1)
    assert (
        Checkpointer(local=local, warm=warm, key="run", install_signals=False).restore().step == 1
    )
    assert (
        Checkpointer(local=local, warm=warm, key="run", install_signals=False).restore().step == 1
    )


def test_a_replica_rank_of_a_one_part_series_takes_no_lease_until_it_saves(
    dirs, monkeypatch
) -> None:
    """Lightning's DDP: every rank builds the one-part series (rank=0, world_size=1) and
    only global rank 0 writes. The others restore freely; one that saves gets the line."""
    local, warm = dirs
    with Checkpointer(local=local, warm=warm, key="run", install_signals=False) as writer:
        writer.save({"x": 1}, step=1)
        writer.wait()
        monkeypatch.setenv("LOCAL_RANK", "1")
        replica = Checkpointer(
            local=local, warm=warm, key="run", rank=0, world_size=1, install_signals=False
        )
        assert replica.restore().step == 1
        with pytest.raises(CkptError, match=f"is being written by pid {os.getpid()}"):
            replica.save({"x": 2}, step=2)
        replica.close()
        writer.save({"x": 2}, step=2)
    assert [s.step for s in PosixTier("pfs", str(warm)).steps(USER, "run")] == [1, 2]
