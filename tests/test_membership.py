"""The membership protocol of in-job recovery (core/membership.py): the files, their
strict parsing, the coordinator's choices, and the refusals of an unsafe directory."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from slurm_ckpt.core.membership import (
    Coordinator,
    Epoch,
    Member,
    MembershipError,
    RecoveryDir,
    Spare,
    task_from_env,
)


def _dir(tmp_path: Path) -> RecoveryDir:
    d = tmp_path / "recovery"
    return RecoveryDir(str(d), create=True)


def _members(n: int) -> dict:
    return {r: Member("127.0.0.1", r) for r in range(n)}


def test_launch_then_a_loss_puts_a_ready_spare_in_the_lost_rank(tmp_path: Path) -> None:
    rd = _dir(tmp_path)
    co = Coordinator(rd)
    e0 = co.launch(_members(3), port=29500)
    assert rd.newest_epoch() == e0 and e0.port == 29500 and e0.lost == ()
    assert co.declare_lost([1]) is None  # no spare ready: the caller relaunches
    assert rd.newest_epoch() == e0
    rd.write_spare(Spare(task=7, host="127.0.0.1", pid=os.getpid()))
    rd.write_spare(Spare(task=8, host="127.0.0.1", pid=os.getpid()))
    e1 = co.declare_lost([1])
    assert e1 is not None and e1.epoch == 1 and e1.lost == (1,)
    assert e1.members[1] == Member("127.0.0.1", 7)
    assert e1.members[0] == e0.members[0] and e1.members[2] == e0.members[2]
    assert e1.has(0, 0) and e1.has(1, 7) and not e1.has(1, 1) and e1.rank_of(7) == 1
    assert [s.task for s in rd.spares()] == [8]  # a spare is used once
    assert rd.newest_epoch() == e1
    # a fresh coordinator (ckpt-srun restarted) continues from the newest epoch
    co2 = Coordinator(rd)
    e2 = co2.declare_lost([2])
    assert e2 is not None and e2.epoch == 2 and e2.members[2].task == 8 and e2.members[1].task == 7
    assert co2.declare_lost([0]) is None
    assert not rd.ended()
    co2.end()
    assert rd.ended()
    rd.mark_done(2)
    assert rd.done_ranks() == [2]


def test_two_losses_need_two_spares(tmp_path: Path) -> None:
    rd = _dir(tmp_path)
    co = Coordinator(rd)
    co.launch(_members(4))
    rd.write_spare(Spare(10, "127.0.0.1", 1))
    assert co.declare_lost([0, 3]) is None
    rd.write_spare(Spare(12, "127.0.0.1", 1))
    co.forget_spare(12)  # a spare known dead is not offered
    assert co.declare_lost([0, 3]) is None
    rd.write_spare(Spare(11, "127.0.0.1", 1))
    e = co.declare_lost([3, 0])
    assert e is not None and e.lost == (0, 3) and {e.members[0].task, e.members[3].task} == {10, 11}
    with pytest.raises(MembershipError):
        co.declare_lost([9])


def test_the_format_round_trips_and_anything_else_is_ignored(tmp_path: Path) -> None:
    rd = _dir(tmp_path)
    e = Epoch(3, 2, _members(2), "node1", 29501, (1,), 5.0)
    assert Epoch.from_bytes(e.to_bytes()) == e
    obj = json.loads(e.to_bytes())
    assert obj == {
        "epoch": 3,
        "world_size": 2,
        "created": 5.0,
        "lost": [1],
        "members": {"0": {"host": "127.0.0.1", "task": 0}, "1": {"host": "127.0.0.1", "task": 1}},
        "rendezvous": {"host": "node1", "port": 29501},
    }
    bad = [
        dict(obj, world_size=3),
        dict(obj, members={"0": {"host": "a", "task": 0}, "1": {"host": "b", "task": 0}}),
        dict(obj, members={"0": {"host": "a", "task": 0}, "01": {"host": "b", "task": 1}}),
        dict(obj, rendezvous={"host": "x y", "port": 1}),
        dict(obj, rendezvous={"host": "x", "port": 70000}),
        dict(obj, lost=[5]),
        dict(obj, epoch=True),
        dict(obj, created=float("nan")),
    ]
    for b in bad:
        assert Epoch.from_bytes(json.dumps(b).encode()) is None, b
    assert Epoch.from_bytes(b"\xff") is None and Epoch.from_bytes(b"[]") is None
    rd.write_epoch(e)
    # a newer but broken file, a symlink and a FIFO are passed over, never followed or read
    (Path(rd.path) / "epoch-9.json").write_text("{")
    (Path(rd.path) / "epoch-8.json").symlink_to(Path(rd.path) / "epoch-3.json")
    os.mkfifo(Path(rd.path) / "epoch-7.json")
    (Path(rd.path) / "spare-4.json").write_text(json.dumps({"task": 5, "host": "h", "pid": 1}))
    assert rd.newest_epoch() == e
    assert rd.spares() == []


def test_an_unsafe_or_missing_directory_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(MembershipError, match="absolute"):
        RecoveryDir("relative")
    with pytest.raises(MembershipError, match="recovery directory"):
        RecoveryDir(str(tmp_path / "missing"))
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o700)
    os.chmod(open_dir, 0o777)
    with pytest.raises(MembershipError, match="writable by nobody else"):
        RecoveryDir(str(open_dir))
    (tmp_path / "link").symlink_to(open_dir)
    with pytest.raises(MembershipError):
        RecoveryDir(str(tmp_path / "link"))


def test_task_from_env() -> None:
    assert task_from_env({"SLURM_CKPT_TASK": "4", "SLURM_PROCID": "2"}) == 4
    assert task_from_env({"SLURM_PROCID": "2"}) == 2
    assert task_from_env({"SLURM_PROCID": "x"}) is None
