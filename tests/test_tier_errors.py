"""Bad tiers give one clear line and never harm what is already committed:
a full filesystem (ENOSPC), a missing root, no permission; plus the bandwidth cap and
concurrent copies of the same step."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from conftest import in_child_as

from slurm_ckpt.errors import TierError
from slurm_ckpt.tiers.copy import copy_checkpoint
from slurm_ckpt.tiers.posix import PosixTier


def save(tier: PosixTier, step: int, nbytes: int) -> None:
    with tier.writer("alice", "run", step) as w:
        w.write_buffers({"a.bin": os.urandom(nbytes // 2), "b.bin": os.urandom(nbytes // 2)})
        w.commit()


def one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert "\n" not in msg and msg
    return msg


def test_enospc_on_save_keeps_previous_checkpoint(mounts) -> None:
    root = mounts.tmpfs("4m")
    tier = PosixTier("local", str(root))
    save(tier, 1, 1 << 20)
    with pytest.raises(TierError) as exc:
        save(tier, 2, 8 << 20)
    assert "no space left on device" in one_line(exc.value)
    assert [s.step for s in tier.steps("alice", "run")] == [1]
    assert tier.verify("alice", "run", 1).ok
    assert sorted(os.listdir(root / "alice/run")) == ["step-0000000001"]  # no debris
    save(tier, 2, 1 << 20)  # space is back: the next save works
    assert [s.step for s in tier.steps("alice", "run")] == [1, 2]


def test_enospc_on_copy_discards_partial_and_retry_works(mounts) -> None:
    local = PosixTier("local", str(mounts.tmpfs("32m", "local")))
    pfs_root = mounts.tmpfs("6m", "pfs")
    pfs = PosixTier("pfs", str(pfs_root))
    save(local, 1, 2 << 20)
    save(local, 2, 5 << 20)
    copy_checkpoint(local, pfs, "alice", "run", 1)
    with pytest.raises(TierError) as exc:
        copy_checkpoint(local, pfs, "alice", "run", 2)
    assert "no space left on device" in one_line(exc.value)
    assert [s.step for s in pfs.steps("alice", "run")] == [1]
    assert pfs.verify("alice", "run", 1).ok
    assert sorted(os.listdir(pfs_root / "alice/run")) == ["step-0000000001"]
    assert local.verify("alice", "run", 2).ok  # the source is untouched
    pfs.delete("alice", "run", 1)
    copy_checkpoint(local, pfs, "alice", "run", 2)
    assert pfs.verify("alice", "run", 2).ok


def test_missing_root(tmp_path: Path) -> None:
    tier = PosixTier("pfs", str(tmp_path / "nope"))
    with pytest.raises(TierError) as exc:
        tier.check()
    assert one_line(exc.value).endswith("no such file or directory")
    with pytest.raises(TierError):
        save(tier, 1, 10)
    assert not (tmp_path / "nope").exists()


def test_no_permission(tmp_path: Path) -> None:
    root = tmp_path / "root-owned"
    root.mkdir(mode=0o755)
    os.chmod(tmp_path, 0o755)
    tier = PosixTier("pfs", str(root))
    save(tier, 1, 100)

    def attempt() -> str:
        try:
            save(PosixTier("pfs", str(root)), 2, 100)
        except TierError as exc:
            return one_line(exc)
        return "no error"

    msg = in_child_as(65534, 65534, attempt)
    assert "permission denied" in str(msg)
    assert [s.step for s in tier.steps("alice", "run")] == [1]


def test_other_users_checkpoints_are_private(tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o755)
    tier = PosixTier("pfs", str(tmp_path))
    save(tier, 1, 100)
    path = tier.step_path("alice", "run", 1) + "/a.bin"

    def peek() -> str:
        try:
            with open(path, "rb") as fh:
                return "read " + str(len(fh.read()))
        except PermissionError:
            return "denied"

    assert in_child_as(65534, 65534, peek) == "denied"


def test_bandwidth_cap_limits_copy_rate(mounts) -> None:
    local = PosixTier("local", str(mounts.tmpfs("16m", "local")))
    pfs = PosixTier("pfs", str(mounts.tmpfs("16m", "pfs")), bandwidth=4e6)
    save(local, 1, 6_000_000)
    t0 = time.monotonic()
    res = copy_checkpoint(local, pfs, "alice", "run", 1)
    elapsed = time.monotonic() - t0
    # 6 MB at 4 MB/s with a 0.25 s burst cannot take less than ~1.25 s (a lower bound,
    # so a slow machine cannot make this fail).
    assert res.copied_bytes == 6_000_000
    assert elapsed >= (6_000_000 - 1_000_000) / 4e6
    assert pfs.verify("alice", "run", 1).ok


def test_concurrent_copies_of_one_step(mounts) -> None:
    local = PosixTier("local", str(mounts.tmpfs("32m", "local")))
    pfs = PosixTier("pfs", str(mounts.loopfs(32, "ext4", "pfs")))
    save(local, 1, 8 << 20)
    results, errors = [], []

    def go() -> None:
        try:
            results.append(copy_checkpoint(local, pfs, "alice", "run", 1))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=go) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sum(not r.already_present for r in results) == 1
    assert pfs.verify("alice", "run", 1).ok
