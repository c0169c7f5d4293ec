"""Several ranks (torch.distributed, gloo, on this machine): each saves its own shard, and
every restart puts all ranks back at one and the same step.

Why it matters: a data-parallel job whose ranks resume from different steps trains on
silently inconsistent replicas (or hangs in its first all-reduce). The cases: a
preemption signal that reaches only one rank (all ranks must still save the same step
and stop together), SIGKILL of every rank at a random point (all resume at the newest
step *every* rank committed), and one rank's newest shard corrupt on every tier (all
ranks fall back to the previous step - and the run still ends bitwise equal to an
uninterrupted one).
"""

from __future__ import annotations

import getpass
import json
import random
import re
import signal
import socket
from pathlib import Path
from typing import List, Optional

from test_torch_resume import TrainProc  # one reader of the trainer's output lines

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train_tiny.py"
_RESUMED = re.compile(r"^(?:START fresh|RESUMED step=(\d+) reached=(\d+|None) lost=(\d+|None))")
_DONE = r"^DONE step=(\d+) digest=([0-9a-f]{64})$"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Job:
    """``world`` ranks started together, as srun/torchrun would."""

    def __init__(self, world: int, args: List[str], cwd: Path) -> None:
        port = free_port()
        self.ranks = []
        for r in range(world):
            env = dict(
                RANK=str(r),
                WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                GLOO_SOCKET_IFNAME="lo",
            )
            self.ranks.append(TrainProc(args, cwd, env))

    def resumed(self) -> List[Optional[int]]:
        """Each rank's first line: the step it resumed at (None: fresh start)."""
        out = []
        for r in self.ranks:
            m = r.expect(_RESUMED.pattern)
            out.append(None if m.group(1) is None else int(m.group(1)))
        return out

    def close(self) -> None:
        for r in self.ranks:
            r.close()


def _user() -> str:
    return getpass.getuser()


def corrupt_newest(root: Path, key: str, rank: int, world: int) -> int:
    """Flip one byte of ``rank``'s newest committed shard on a tier; returns its step."""
    kdir = root / _user() / (key if world == 1 else f"{key}.rank{rank:05d}")
    steps = sorted(
        int(d.name[5:])
        for d in kdir.iterdir()
        if d.name.startswith("step-") and (d / "manifest.json").exists()
    )
    sdir = kdir / f"step-{steps[-1]:010d}" / f"rank-{rank:05d}"
    blob = sdir / json.loads((sdir / "index.json").read_text())["blobs"][0]["name"]
    with open(blob, "r+b") as fh:
        fh.seek(64)
        b = fh.read(1)
        fh.seek(64)
        fh.write(bytes([b[0] ^ 0x80]))
    return steps[-1]


def _args(tmp: Path, steps: int, interval: int, extra: List[str]) -> List[str]:
    return [
        "--local", str(tmp / "local"),
        "--pfs", str(tmp / "pfs"),
        "--key", "dp",
        "--steps", str(steps),
        "--interval-steps", str(interval),
        "--sleep-per-step", "0.02",
        "--seed", "5",
        *extra,
    ]  # fmt: skip


def test_two_ranks_resume_together_after_term_kill_and_corruption(tmp_path: Path) -> None:
    world, steps, interval = 2, 90, 10
    (tmp_path / "local").mkdir()
    (tmp_path / "pfs").mkdir()
    rng = random.Random(4242)
    ref = Job(world, ["--no-ckpt", "--steps", str(steps), "--seed", "5", "--quiet-steps"], tmp_path)
    args = _args(tmp_path, steps, interval, [])
    jobs: List[Job] = [ref]
    try:
        # 1. SIGTERM reaches rank 1 only: both ranks save the same step and exit 0.
        job = Job(world, args, tmp_path)
        jobs.append(job)
        assert job.resumed() == [None, None]
        target = rng.randint(12, 28)
        job.ranks[1].expect(rf"^STEP {target} ")
        job.ranks[1].proc.send_signal(signal.SIGTERM)
        pre = [int(r.expect(r"^PREEMPTED step=(\d+)$").group(1)) for r in job.ranks]
        assert [r.finish() for r in job.ranks] == [0, 0]
        assert pre[0] == pre[1] >= target
        term_step = pre[0]

        # 2. both resume there, nothing lost; then SIGKILL both at a random point.
        job = Job(world, args, tmp_path)
        jobs.append(job)
        assert job.resumed() == [term_step, term_step]
        assert all("lost=0" in r.lines[0] for r in job.ranks), [r.lines[0] for r in job.ranks]
        target = term_step + rng.randint(interval + 2, 2 * interval + 5)
        job.ranks[0].expect(rf"^STEP {target} ")
        for r in job.ranks:
            r.proc.send_signal(signal.SIGKILL)
        assert [r.finish() for r in job.ranks] == [-signal.SIGKILL] * world
        committed = [set(r.values("COMMITTED")) | {term_step} for r in job.ranks]

        # 3. all resume at one step that every rank committed (the newest such).
        job = Job(world, args, tmp_path)
        jobs.append(job)
        got = job.resumed()
        assert got[0] == got[1], got
        common = set.intersection(*committed)
        assert got[0] in common or got[0] >= max(common), (got, committed)
        assert got[0] >= term_step
        # run on until a newer checkpoint than the resumed one is committed and flushed
        # by both ranks, then preempt (SIGTERM to rank 0 only this time)
        for r in job.ranks:
            r.expect(rf"^FLUSHED step={(got[0] // interval + 1) * interval}$")
        job.ranks[0].proc.send_signal(signal.SIGTERM)
        pre = [int(r.expect(r"^PREEMPTED step=(\d+)$").group(1)) for r in job.ranks]
        assert [r.finish() for r in job.ranks] == [0, 0]
        assert pre[0] == pre[1]
        newest = pre[0]
        previous = max(s for s in job.ranks[0].values("COMMITTED") if s < newest)

        # 4. rank 1's newest shard is corrupt on both tiers: every rank falls back.
        assert corrupt_newest(tmp_path / "local", "dp", 1, world) == newest
        assert corrupt_newest(tmp_path / "pfs", "dp", 1, world) == newest
        job = Job(world, args, tmp_path)
        jobs.append(job)
        assert job.resumed() == [previous, previous]
        assert f"lost={newest - previous}" in job.ranks[0].lines[0]

        # 5. and the run still ends bitwise equal to an uninterrupted one.
        done = [r.expect(_DONE) for r in job.ranks]
        assert [r.finish() for r in job.ranks] == [0, 0]
        ref_done = [r.expect(_DONE) for r in ref.ranks]
        assert [r.finish() for r in ref.ranks] == [0, 0]
        digests = {m.group(2) for m in done + ref_done}
        assert len(digests) == 1, "ranks or runs ended with different weights"
    finally:
        for j in jobs:
            j.close()


def test_three_ranks_one_signalled_one_corrupt(tmp_path: Path) -> None:
    world, interval = 3, 5
    (tmp_path / "local").mkdir()
    (tmp_path / "pfs").mkdir()
    args = _args(tmp_path, 40, interval, ["--quiet-steps"])
    job = Job(world, args, tmp_path)
    try:
        assert job.resumed() == [None] * world
        # wait for two committed checkpoints on every rank, then signal only rank 2
        for r in job.ranks:
            r.expect(rf"^COMMITTED step={2 * interval}$")
        job.ranks[2].proc.send_signal(signal.SIGUSR1)
        pre = [int(r.expect(r"^PREEMPTED step=(\d+)$").group(1)) for r in job.ranks]
        assert [r.finish() for r in job.ranks] == [0] * world
        assert len(set(pre)) == 1, pre
        newest = pre[0]
        previous = max(s for s in job.ranks[0].values("COMMITTED") if s < newest)
        # rank 0's newest shard corrupt on both tiers
        for tier in ("local", "pfs"):
            assert corrupt_newest(tmp_path / tier, "dp", 0, world) == newest
    finally:
        job.close()
    args = _args(tmp_path, previous + 2, interval, ["--quiet-steps"])
    job = Job(world, args, tmp_path)
    try:
        assert job.resumed() == [previous] * world
        done = [r.expect(_DONE) for r in job.ranks]
        assert [r.finish() for r in job.ranks] == [0] * world
        assert len({m.group(2) for m in done}) == 1
    finally:
        job.close()
