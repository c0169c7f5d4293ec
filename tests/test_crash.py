"""SIGKILL a writer and a copier at every crash point: nothing partial is ever listed,
nothing verified is ever lost, and the next run completes the work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import List

from slurm_ckpt.tiers.posix import PosixTier

REPO = Path(__file__).resolve().parents[1]
WORKER = str(Path(__file__).with_name("crash_worker.py"))
MAX_POINTS = 300


def worker(args: List[str], crash_at: int = 0) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), SLURM_CKPT_CRASH_AT=str(crash_at))
    return subprocess.run(
        [sys.executable, WORKER, *args], env=env, capture_output=True, text=True, timeout=60
    )


def listed(tier: PosixTier) -> List[int]:
    return [s.step for s in tier.steps("alice", "run")]


def assert_all_listed_verify(tier: PosixTier) -> None:
    for s in listed(tier):
        rep = tier.verify("alice", "run", s)
        assert rep.ok, rep.summary()


def test_sigkill_at_every_point_of_a_save(mounts) -> None:
    root = mounts.tmpfs("16m")
    tier = PosixTier("local", str(root))
    assert worker(["save", str(root), "1"]).returncode == 0
    crashes = 0
    for n in range(1, MAX_POINTS):
        r = worker(["save", str(root), "2"], crash_at=n)
        if r.returncode == 0:
            break
        assert r.returncode == -signal.SIGKILL, r.stderr
        crashes += 1
        steps = listed(tier)
        assert steps in ([1], [1, 2]), f"crash point {n}: listing {steps}"
        assert_all_listed_verify(tier)
        # The next run completes the save (or finds it committed), and it verifies.
        assert worker(["save", str(root), "2"]).returncode == 0
        assert listed(tier) == [1, 2]
        assert_all_listed_verify(tier)
        tier.sweep("alice", "run")
        debris = [
            x for x in os.listdir(root / "alice/run") if not x.startswith(("step-", ".lock-"))
        ]
        assert debris == [], f"crash point {n}: debris left {debris}"
        tier.delete("alice", "run", 2)
    else:
        raise AssertionError("save never completed: crash points do not end")
    assert crashes >= 10, "expected many distinct crash points in a save"


def test_sigkill_at_every_point_of_a_copy(mounts) -> None:
    local_root = mounts.tmpfs("16m", "local")
    pfs_root = mounts.loopfs(16, "ext4", "pfs")
    local = PosixTier("local", str(local_root))
    pfs = PosixTier("pfs", str(pfs_root))
    for step in (1, 2):
        assert worker(["save", str(local_root), str(step)]).returncode == 0
    assert worker(["copy", str(local_root), str(pfs_root), "1"]).returncode == 0
    crashes = resumed = 0
    for n in range(1, MAX_POINTS):
        r = worker(["copy", str(local_root), str(pfs_root), "2"], crash_at=n)
        if r.returncode == 0:
            break
        assert r.returncode == -signal.SIGKILL, r.stderr
        crashes += 1
        steps = listed(pfs)
        assert steps in ([1], [1, 2]), f"crash point {n}: PFS listing {steps}"
        assert_all_listed_verify(pfs)
        assert listed(local) == [1, 2]
        assert_all_listed_verify(local)
        # The interrupted copy completes on the next run.
        r2 = worker(["copy", str(local_root), str(pfs_root), "2"])
        assert r2.returncode == 0, r2.stderr
        resumed += json.loads(r2.stdout)["resumed"]
        assert listed(pfs) == [1, 2]
        assert_all_listed_verify(pfs)
        left = [x for x in os.listdir(pfs_root / "alice/run") if not x.startswith("step-")]
        assert left == [], f"crash point {n}: left {left}"
        pfs.delete("alice", "run", 2)
    else:
        raise AssertionError("copy never completed")
    assert crashes >= 10
    assert resumed > 0, "no crash left a file that the next run could keep"
