"""The fence of a partitioned node: its own disk still names it, the warm tier does not.

A rank's node is cut off (here: its process stopped); the job gives its rank to a spare
on another node, which takes the series' lease with the next generation, on *its* local
tier and on the warm tier. The old node's local tier still holds the old record, naming
the old writer. When the old writer runs again, a local commit that checked only its
own node's record would pass: a second writer of one rank's series. The local commit
checks the warm tier's record too (slurm_ckpt/job/lease.py), so it is refused, and
nothing is committed on either node. (tests/test_cluster_fencing.py does the same on the
real dev cluster, partitioning a whole node under ckpt-srun --spares.)
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from test_lease import USER, Worker, record

from slurm_ckpt import Checkpointer
from slurm_ckpt.tiers.posix import PosixTier


def test_a_partitioned_writer_cannot_commit_on_its_own_node(tmp_path: Path) -> None:
    old_node, spare_node, warm = tmp_path / "n2", tmp_path / "n4", tmp_path / "warm"
    a = Worker(old_node, warm)
    try:
        for step in (1, 2):
            a.ask(f"save {step}")
        os.kill(a.pid, signal.SIGSTOP)  # partitioned: alive, holding its lease
        b = Checkpointer(
            local=spare_node, warm=warm, key="run", takeover=True, install_signals=False
        )
        assert b.restore().step == 2  # from the warm tier: the spare's disk is empty
        b.save({"x": 3}, step=3)
        b.wait()
        assert record(warm).generation == record(old_node).generation + 1
        os.kill(a.pid, signal.SIGCONT)
        woke = a.ask("save 4")
        assert "taken over" in str(woke["error"]) and woke["committed"] == 2, woke
        old = [s.step for s in PosixTier("t", str(old_node)).steps(USER, "run")]
        assert 4 not in old, old  # nothing committed on its own node
        assert [s.step for s in PosixTier("t", str(warm)).steps(USER, "run")][-1] == 3
        b.close()
    finally:
        if a.proc.poll() is None:
            os.kill(a.pid, signal.SIGCONT)
        a.finish()
