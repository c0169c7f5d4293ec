"""Directory checkpoints (``output`` / ``adopt`` / ``restore_path``): any framework's own
files, committed, flushed, verified and restored like a ``save()`` state; and a restore
that never removes a sound copy because it is not a slurm_ckpt state.

Real files on real filesystems (the test's tmp dir, a tmpfs and an XFS loop mount for the
copy and reflink paths); background phases are ordered with events, never with sleeps.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from slurm_ckpt import Checkpointer
from slurm_ckpt.errors import CkptError
from slurm_ckpt.job.output import DIR_FORMAT

WAIT = 60.0


def make(tmp_path: Path, **kw: Any) -> Checkpointer:
    local = kw.pop("local", tmp_path / "local")
    pfs = kw.pop("pfs", tmp_path / "pfs")
    os.makedirs(local, exist_ok=True)
    os.makedirs(pfs, exist_ok=True)
    kw.setdefault("install_signals", False)
    kw.setdefault("end_time_fn", None)
    return Checkpointer(local=local, warm=pfs, key=kw.pop("key", "run"), **kw)


def write_tree(path: Path, seed: int) -> Dict[str, bytes]:
    """A framework-like checkpoint: a torch.save file, a JSON file, a nested file."""
    files = {
        "model.bin": os.urandom(1000) + bytes([seed]),
        "trainer_state.json": b'{"global_step": %d}' % seed,
        "sub/rng_state.pth": bytes(range(256)) * 5,
    }
    for rel, data in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(data)
    torch.save({"w": torch.full((4,), float(seed))}, path / "optim.pt")
    return files


def read_tree(path: Path) -> Dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


def test_output_commits_flushes_and_restores(tmp_path: Path) -> None:
    ckpt = make(tmp_path)
    with ckpt.output(step=10, tokens=1000) as path:
        assert isinstance(path, Path) and path.is_dir()
        assert path.is_relative_to(tmp_path / "local")  # written straight on the local tier
        want = write_tree(path, 10)
        want["optim.pt"] = (path / "optim.pt").read_bytes()
    ckpt.close()
    for tier in (ckpt.local, ckpt.warm):
        (info,) = tier.steps(ckpt.user, ckpt.shard_key)
        assert info.step == 10 and info.manifest.tokens == 1000
        assert info.manifest.meta["state_format"] == DIR_FORMAT
        assert tier.verify(ckpt.user, ckpt.shard_key, 10).ok
    again = make(tmp_path)
    got = again.restore_path()
    assert got is not None and read_tree(got) == want
    assert torch.load(got / "optim.pt", weights_only=True)["w"].tolist() == [10.0] * 4
    assert again.restored is not None and again.restored.tokens == 1000
    assert again.restore() is None  # not a save() state: skipped, and kept
    assert again.warm.verify(again.user, again.shard_key, 10).ok
    again.close()


def test_output_body_that_raises_commits_nothing(tmp_path: Path) -> None:
    ckpt = make(tmp_path)
    with pytest.raises(RuntimeError), ckpt.output(step=3) as path:
        write_tree(path, 3)
        raise RuntimeError("framework failed mid-save")
    ckpt.close()
    assert ckpt.local.steps(ckpt.user, ckpt.shard_key) == []
    assert ckpt.warm.steps(ckpt.user, ckpt.shard_key) == []
    left = os.listdir(tmp_path / "local" / ckpt.user / ckpt.shard_key)
    assert [n for n in left if not n.startswith(".lock-")] == []  # no debris (the lease stays)
    assert make(tmp_path).restore_path() is None


def test_output_refuses_a_symlink(tmp_path: Path) -> None:
    ckpt = make(tmp_path)
    with pytest.raises(CkptError, match="link: not a regular file"), ckpt.output(step=1) as path:
        (path / "a").write_bytes(b"x")
        os.symlink("/etc/passwd", path / "link")
    assert ckpt.local.steps(ckpt.user, ckpt.shard_key) == []
    ckpt.close()


def test_adopt_survives_the_frameworks_rotation(tmp_path: Path) -> None:
    """Hard links on one filesystem: the framework deletes its directory right after
    adopt() returns (its rotation) and the checkpoint is still committed whole; the
    committed files have one link each (root's verify refuses shared inodes)."""
    ckpt = make(tmp_path)
    src = tmp_path / "out" / "checkpoint-500"
    want = write_tree(src, 5)
    want["optim.pt"] = (src / "optim.pt").read_bytes()
    ckpt.adopt(500, src, tokens=5)
    for p in sorted(src.rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    src.rmdir()
    ckpt.close()
    assert ckpt.warm.verify(ckpt.user, ckpt.shard_key, 500).ok
    step_dir = Path(ckpt.local.location(ckpt.user, ckpt.shard_key, 500))
    assert all(p.stat().st_nlink == 1 for p in step_dir.rglob("*") if p.is_file())
    got = make(tmp_path).restore_path()
    assert got is not None and read_tree(got) == want


def test_adopt_copies_apart_while_the_framework_keeps_its_files(tmp_path: Path) -> None:
    ckpt = make(tmp_path)
    src = tmp_path / "checkpoint-7"
    want = write_tree(src, 7)
    ckpt.adopt(7, src)
    ckpt.close()
    assert read_tree(src)["model.bin"] == want["model.bin"]  # the framework's copy untouched
    assert all(p.stat().st_nlink == 1 for p in src.rglob("*") if p.is_file())
    assert ckpt.local.verify(ckpt.user, ckpt.shard_key, 7).ok
    assert ckpt.warm.verify(ckpt.user, ckpt.shard_key, 7).ok


def test_adopt_fails_when_the_framework_rewrites_a_file_in_place(tmp_path: Path) -> None:
    """A file rewritten in place (same inode) before the background writer copied it
    apart must fail the save, not commit a torn file."""
    gate = threading.Event()
    started = threading.Event()

    def on_event(name: str, info: Dict[str, Any]) -> None:
        if name == "local_start":
            started.set()
            assert gate.wait(WAIT)

    ckpt = make(tmp_path, on_event=on_event)
    src = tmp_path / "checkpoint-9"
    write_tree(src, 9)
    ckpt.adopt(9, src)
    assert started.wait(WAIT)
    with open(src / "model.bin", "r+b") as f:  # same inode, new bytes and a new mtime
        f.write(b"rewritten")
    os.utime(src / "model.bin", ns=(1, 1))
    gate.set()
    ckpt.wait()
    assert ckpt.stats.failures == 1 and "changed while being adopted" in ckpt.stats.last_error
    assert ckpt.local.steps(ckpt.user, ckpt.shard_key) == []
    ckpt.close()


def test_adopt_from_another_filesystem_copies(tmp_path: Path, mounts: Any) -> None:
    other = mounts.tmpfs("8m", "fw-src")
    src = other / "checkpoint-2"
    want = write_tree(src, 2)
    ckpt = make(tmp_path)
    ckpt.adopt(2, src)
    (src / "model.bin").unlink()  # rotation right away: our copy is already made
    ckpt.close()
    got = make(tmp_path).restore_path()
    assert got is not None and read_tree(got)["model.bin"] == want["model.bin"]


def test_adopt_reflinks_on_xfs(tmp_path: Path, mounts: Any) -> None:
    """On a filesystem with reflinks the snapshot is a clone: a file of its own (another
    inode, one link) the moment adopt() returns, before the background writer runs."""
    mnt = mounts.loopfs(300, "xfs", "fw-xfs")
    (mnt / "local").mkdir()
    src = mnt / "checkpoint-4"
    want = write_tree(src, 4)
    gate, started = threading.Event(), threading.Event()

    def on_event(name: str, info: Dict[str, Any]) -> None:
        if name == "local_start":
            started.set()
            assert gate.wait(WAIT)

    ckpt = make(tmp_path, local=mnt / "local", on_event=on_event)
    ckpt.adopt(4, src)
    assert started.wait(WAIT)  # the background writer is held before it touches a file
    (work,) = (mnt / "local" / ckpt.user / ckpt.shard_key).glob(".tmp-step-*")
    clone = work / "rank-00000" / "model.bin"
    assert clone.stat().st_ino != (src / "model.bin").stat().st_ino
    assert clone.stat().st_nlink == 1 and clone.read_bytes() == want["model.bin"]
    gate.set()
    ckpt.close()
    got = make(tmp_path, local=mnt / "local").restore_path()
    assert got is not None and read_tree(got)["model.bin"] == want["model.bin"]


def test_restore_path_fetches_from_the_pfs_and_skips_a_corrupt_local_copy(
    tmp_path: Path,
) -> None:
    ckpt = make(tmp_path)
    for step in (1, 2):
        with ckpt.output(step=step) as path:
            write_tree(path, step)
    ckpt.close()
    user, key = ckpt.user, ckpt.shard_key
    local2 = Path(ckpt.local.location(user, key, 2)) / "rank-00000" / "model.bin"
    data = bytearray(local2.read_bytes())
    data[3] ^= 0xFF
    local2.write_bytes(bytes(data))
    r = make(tmp_path)
    got = r.restore_path()
    assert got is not None and r.restored is not None
    assert r.restored.step == 2 and r.restored.tier == "pfs"
    assert got == Path(r.local.location(user, key, 2)) / "rank-00000"
    assert r.local.verify(user, key, 2).ok  # the bad local copy was replaced by a good one
    r.close()
    # Nothing local at all: fetched from the PFS, verified on the way.
    r.local.delete(user, key, 2)
    r.local.delete(user, key, 1)
    r2 = make(tmp_path)
    got = r2.restore_path()
    assert got is not None and (got / "trainer_state.json").read_bytes() == b'{"global_step": 2}'
    r2.close()


def test_restore_path_counts_a_step_only_when_every_rank_committed(tmp_path: Path) -> None:
    ranks = [make(tmp_path, rank=r, world_size=2) for r in (0, 1)]
    for step in (1, 2):
        for r, ck in enumerate(ranks):
            if step == 2 and r == 1:
                continue  # rank 1 was killed before its part of step 2
            with ck.output(step=step) as path:
                (path / "part.bin").write_bytes(b"%d-%d" % (step, r))
    for ck in ranks:
        ck.close()
    for r in (0, 1):
        ck = make(tmp_path, rank=r, world_size=2)
        got = ck.restore_path()
        assert got is not None and (got / "part.bin").read_bytes() == b"1-%d" % r
        ck.close()


def test_restore_keeps_a_verified_copy_that_is_not_a_state(tmp_path: Path) -> None:
    """The bug of issue 20: restore() removed a verified PFS copy of a committed
    ``torch.save`` file as "corrupt", and no flush ever put it back."""
    ckpt = make(tmp_path)
    user, key = ckpt.user, ckpt.shard_key
    w = ckpt.warm.writer(user, key, 5, meta={"rank": 0, "world_size": 1})
    with w, w.open_stream("model.pt") as f:
        torch.save({"w": torch.arange(8)}, f)
    ckpt.close()
    r = make(tmp_path)
    assert r.restore() is None
    steps: List[int] = [i.step for i in r.warm.steps(user, key)]
    assert steps == [5] and r.warm.verify(user, key, 5).ok
    r.close()


def test_restore_takes_the_newest_state_and_restore_path_the_newest_directory(
    tmp_path: Path,
) -> None:
    ckpt = make(tmp_path)
    ckpt.save({"model": {"w": torch.ones(3)}}, step=1)
    with ckpt.output(step=2) as path:
        (path / "x").write_bytes(b"dir")
    ckpt.close()
    r = make(tmp_path)
    got = r.restore()
    assert got is not None and got.step == 1 and torch.equal(got.state["model"]["w"], torch.ones(3))
    p = r.restore_path()
    assert p is not None and (p / "x").read_bytes() == b"dir"
    for tier in (r.local, r.warm):
        assert [i.step for i in tier.steps(r.user, r.shard_key)] == [1, 2]
    r.close()


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    ckpt = make(tmp_path)
    with pytest.raises(CkptError, match="step must be"):
        ckpt.output(step=-1).__enter__()
    with pytest.raises(CkptError, match="no-such"):
        ckpt.adopt(1, tmp_path / "no-such")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CkptError, match="no files"):
        ckpt.adopt(1, tmp_path / "empty")
    ckpt.close()


def test_preemption_pending_until_the_directory_save_is_taken(tmp_path: Path) -> None:
    import signal

    ckpt = make(tmp_path, install_signals=True)
    try:
        assert not ckpt.preemption_pending
        os.kill(os.getpid(), signal.SIGTERM)  # delivered to this (main) thread at once
        assert ckpt.preemption_pending and ckpt.signal_received == signal.SIGTERM
        with ckpt.output(step=4) as path:
            (path / "x").write_bytes(b"x")
        assert not ckpt.preemption_pending and ckpt.preempted
    finally:
        ckpt.close()
    assert ckpt.warm.verify(ckpt.user, ckpt.shard_key, 4).ok  # the preemption save: flushed


def test_restore_path_from_the_pfs_only_keeps_a_sound_local_copy(tmp_path: Path) -> None:
    ckpt = make(tmp_path)
    with ckpt.output(step=6) as path:
        (path / "w.bin").write_bytes(b"w" * 5000)
    ckpt.close()
    user, key = ckpt.user, ckpt.shard_key
    local_file = Path(ckpt.local.location(user, key, 6)) / "rank-00000" / "w.bin"
    ino = local_file.stat().st_ino
    r = make(tmp_path)
    got = r.restore_path(tiers=["pfs"])
    assert got == local_file.parent and local_file.stat().st_ino == ino  # kept, not copied
    local_file.write_bytes(b"x" * 5000)  # rots
    got = r.restore_path(tiers=["pfs"])
    assert got is not None and (got / "w.bin").read_bytes() == b"w" * 5000  # fetched anew
    assert r.local.verify(user, key, 6).ok
    r.close()


def test_list_and_verify_see_a_directory_checkpoint(tmp_path: Path) -> None:
    """The operator CLI treats a directory checkpoint as any other: listed on both
    tiers, verified, and a flipped byte on the PFS copy is caught (exit status 1)."""
    import json

    from helpers.cli import ckpt_slurm
    from helpers.site import Site

    site = Site(tmp_path, extra=f'[ledger]\ndir = "{tmp_path / "ledger"}"\n')
    ckpt = Checkpointer(
        config=site.load(), key="run", user="alice", install_signals=False, end_time_fn=None
    )
    with ckpt.output(step=3, tokens=30) as path:
        write_tree(path, 3)
    ckpt.close()
    r = ckpt_slurm("list", "run", "--user", "alice", "--json", config=site.cfg_path)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["checkpoints"]
    assert sorted((x["tier"], x["step"], x["tokens"]) for x in rows) == [
        ("local", 3, 30),
        ("pfs", 3, 30),
    ]
    assert ckpt_slurm("verify", "run", "--user", "alice", config=site.cfg_path).returncode == 0
    bad = site.step_dir(3, tier="pfs") / "rank-00000" / "model.bin"
    data = bytearray(bad.read_bytes())
    data[0] ^= 1
    bad.write_bytes(bytes(data))
    r = ckpt_slurm("verify", "run", "--user", "alice", "--tier", "pfs", config=site.cfg_path)
    assert r.returncode == 1, r.stdout + r.stderr


CRASH_SCRIPT = """
import sys
from pathlib import Path
from slurm_ckpt import Checkpointer

local, pfs, src = sys.argv[1:4]
# No ledger (a supported mode): its own crash points are proven elsewhere, and these
# runs enumerate the checkpoint's.
c = Checkpointer(
    local=local, warm=pfs, key="run", install_signals=False, end_time_fn=None,
    ledger_dir="/dev/null/no-ledger",
)
with c.output(step=1) as p:  # written in place
    (p / "a.bin").write_bytes(bytes([1]) * 3000)
    (p / "sub").mkdir()
    (p / "sub" / "b.txt").write_text("step 1")
c.wait()
s = Path(src)
(s / "sub").mkdir(parents=True, exist_ok=True)
(s / "a.bin").write_bytes(bytes([2]) * 3000)
(s / "sub" / "b.txt").write_text("step 2")
c.adopt(2, s)  # hard links, copied apart in the background
c.close()
"""


def test_a_kill_at_any_point_of_output_or_adopt_commits_whole_or_nothing(
    tmp_path: Path,
) -> None:
    """SIGKILL at every crash point in turn (the local write, the copy-apart of linked
    files, the flush): afterwards each tier lists only whole checkpoints, and
    restore_path() hands out step 2 or 1 with exactly the bytes written, or nothing."""
    import subprocess
    import sys

    from slurm_ckpt.tiers.posix import PosixTier

    repo = Path(__file__).resolve().parents[1]
    n, seen = 0, set()
    while True:
        n += 1
        assert n < 200, "the crash points never ran out"
        base = tmp_path / f"crash-{n}"
        local, pfs, src = base / "local", base / "pfs", base / "src"
        for d in (local, pfs, src):
            d.mkdir(parents=True)
        env = dict(os.environ, PYTHONPATH=str(repo), SLURM_CKPT_CRASH_AT=str(n))
        env["SLURM_CKPT_CRASH_LOG"] = str(base / "crash.log")
        p = subprocess.run(
            [sys.executable, "-c", CRASH_SCRIPT, str(local), str(pfs), str(src)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if p.returncode == 0:
            break
        assert p.returncode == -9, p.stderr[-2000:]
        seen.add((base / "crash.log").read_text().split()[1])
        for root, name in ((local, "local"), (pfs, "pfs")):
            tier = PosixTier(name, str(root))
            for info in tier.steps("root" if os.geteuid() == 0 else os.environ["USER"], "run"):
                assert tier.verify(info.manifest.user, "run", info.step).ok
        ck = make(base, local=local, pfs=pfs)
        got = ck.restore_path()
        if got is not None:
            s = ck.restored.step  # type: ignore[union-attr]
            assert read_tree(got) == {"a.bin": bytes([s]) * 3000, "sub/b.txt": b"step %d" % s}
        ck.close()
    assert {"output:file-hashed", "output:copied-apart", "commit:manifest"} <= seen


def test_restore_path_from_a_tier_that_does_not_exist_raises(tmp_path: Path) -> None:
    """As restore(tiers=["nvme"]): a tier name that is not configured is a one-line error,
    never a silent None (which reads as "no checkpoint")."""
    ck = Checkpointer(local=tmp_path / "l", warm=tmp_path / "p", key="run", install_signals=False)
    try:
        with pytest.raises(CkptError, match="nvme"):
            ck.restore_path(tiers=["nvme"])
    finally:
        ck.close()


def test_wrong_arguments_and_an_empty_block_are_one_line_errors(tmp_path: Path) -> None:
    """Mix-ups get one CkptError naming the argument (they raised TypeError or
    AttributeError from deep inside, or nothing): an empty output() block, swapped
    adopt() arguments, local=5, and a Checkpointer given no file to write; ``local="~/x"``
    is the home directory's x, not a literal ``./~/x``."""
    import numpy as np

    from slurm_ckpt.torch import TorchCheckpointer

    with pytest.raises(CkptError, match="local= must be a directory path"):
        Checkpointer(local=5, key="run")  # type: ignore[arg-type]
    ckpt = Checkpointer(local=str(tmp_path / "l"), key="run")
    try:
        with pytest.raises(CkptError, match="wrote no file"), ckpt.output(step=1):
            pass
        with pytest.raises(CkptError, match=r"adopt\(step, directory\)"):
            ckpt.adopt(str(tmp_path), 2)  # type: ignore[arg-type]
        model = torch.nn.Linear(2, 2)
        with pytest.raises(CkptError, match="first argument is the Checkpointer"):
            TorchCheckpointer(model, ckpt)  # type: ignore[arg-type]
        with pytest.raises(CkptError, match="optimizer= must be a torch.optim.Optimizer"):
            TorchCheckpointer(ckpt, model, model)  # type: ignore[arg-type]
        ckpt.save({"w": np.zeros(4, dtype=np.float32)}, step=3)
    finally:
        ckpt.close()
    home = tmp_path / "home"
    home.mkdir()
    old = os.environ.get("HOME")
    os.environ["HOME"] = str(home)
    try:
        c = Checkpointer(local="~/ckpt", key="run")
        c.close()
    finally:
        if old is None:
            del os.environ["HOME"]
        else:
            os.environ["HOME"] = old
    assert (home / "ckpt").is_dir() and not (Path.cwd() / "~").exists()
