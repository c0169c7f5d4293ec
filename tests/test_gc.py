"""``ckpt-slurm gc``: retention on the shared tiers, deciding on checks made *now*.

Checkpoints are real committed directories (the real writer; where the test needs chosen
commit times, the manifest is rewritten with the ``Manifest`` class, so it stays valid).
Corruption is a flipped byte in a real file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Dict, Iterable, List, Optional

import pytest
from helpers import site as helper_site
from helpers.cli import ckpt_slurm

from slurm_ckpt.core.layout import partial_dirname, step_dirname
from slurm_ckpt.core.retention import CkptInfo, RetentionPolicy
from slurm_ckpt.ops.gc import gc_series, pin_name, plan_series, policy_from_config, run_gc
from slurm_ckpt.tiers.copy import copy_checkpoint
from slurm_ckpt.tiers.posix import PosixTier

REPO = Path(__file__).resolve().parents[1]


class Site(helper_site.Site):
    def __init__(self, tmp: Path, keep_warm: int = 2, every: str = "0", cold: bool = False):
        super().__init__(
            tmp,
            tiers=("local", "pfs", "cold") if cold else ("local", "pfs"),
            extra=f'[retention]\nkeep_warm = {keep_warm}\nkeep_warm_every = "{every}"\n',
        )
        self.tmp = tmp
        (tmp / "cold").mkdir(exist_ok=True)
        self.roots.setdefault("cold", tmp / "cold")
        self.cfg = self.load()

    def save(
        self,
        steps: Iterable[int],
        user: str = "alice",
        key: str = "run",
        tier: Optional[PosixTier] = None,
        wall: Optional[Dict[int, float]] = None,
        meta: Optional[Dict[int, dict]] = None,
    ) -> None:
        t = tier or self.pfs
        for step in steps:
            with t.writer(user, key, step, meta=(meta or {}).get(step)) as w:
                w.write_buffers({"model.bin": os.urandom(2000), "opt.bin": os.urandom(500)})
                w.commit()
            if wall and step in wall:
                m = t.manifest(user, key, step)
                path = Path(t.step_path(user, key, step)) / "manifest.json"
                path.write_bytes(dataclasses.replace(m, wall_time=wall[step]).to_bytes())
                assert t.manifest(user, key, step).wall_time == wall[step]

    def corrupt(self, step: int, user: str = "alice", key: str = "run", name: str = "model.bin"):
        path = Path(self.pfs.step_path(user, key, step)) / name
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))

    def on_disk(self, user: str = "alice", key: str = "run", tier: Optional[PosixTier] = None):
        return [s.step for s in (tier or self.pfs).steps(user, key)]


def test_keeps_newest_verified_and_verifies_only_what_it_relies_on(tmp_path: Path) -> None:
    site = Site(tmp_path, keep_warm=2)
    site.save(range(1, 6))
    site.corrupt(1)  # an old, doomed copy: not worth re-hashing, and not re-hashed
    (res,) = run_gc(site.cfg).series
    assert (res.keep, res.delete, res.deleted) == ([4, 5], [1, 2, 3], [1, 2, 3])
    assert res.verified == [4, 5] and res.corrupt == []
    assert res.bytes == 3 * 2500 and res.errors == []
    assert site.on_disk() == [4, 5]
    assert not Path(site.pfs.step_path("alice", "run", 1)).exists()


def test_dry_run_deletes_nothing(tmp_path: Path) -> None:
    site = Site(tmp_path, keep_warm=2)
    site.save(range(1, 6))
    report = run_gc(site.cfg, dry_run=True)
    (res,) = report.series
    assert res.delete == [1, 2, 3] and res.deleted == [] and res.bytes == 3 * 2500
    assert site.on_disk() == [1, 2, 3, 4, 5]
    doc = report.to_dict()
    assert doc["dry_run"] and doc["totals"]["delete"] == 3 and doc["totals"]["deleted"] == 0


def test_corrupt_newest_does_not_count_as_verified(tmp_path: Path) -> None:
    site = Site(tmp_path, keep_warm=2)
    site.save(range(1, 6))
    site.corrupt(5)
    (res,) = run_gc(site.cfg).series
    # 5 is kept (an unverified newer copy is never deleted) but does not count: the two
    # newest that verify now are 4 and 3.
    assert res.keep == [3, 4, 5] and res.deleted == [1, 2]
    assert res.corrupt == [5] and res.verified == [3, 4]
    assert any("model.bin" in p for p in res.problems)
    assert site.on_disk() == [3, 4, 5]


def test_damaged_newest_manifest_does_not_count(tmp_path: Path) -> None:
    site = Site(tmp_path, keep_warm=2)
    site.save(range(1, 6))
    mpath = Path(site.pfs.step_path("alice", "run", 5)) / "manifest.json"
    mpath.write_bytes(mpath.read_bytes().replace(b'"size": 2000', b'"size": 2001'))
    (res,) = run_gc(site.cfg).series
    assert res.steps == [1, 2, 3, 4]  # step 5 is not a committed checkpoint any more
    assert res.keep == [3, 4] and res.deleted == [1, 2]
    assert mpath.exists()  # gc deletes by policy only; debris is the sweeper's


def test_never_deletes_the_only_verified_copy(tmp_path: Path) -> None:
    site = Site(tmp_path, keep_warm=1)
    site.save(range(1, 6))
    for step in (2, 3, 4, 5):
        site.corrupt(step)
    (res,) = run_gc(site.cfg).series
    assert res.deleted == [] and res.keep == [1, 2, 3, 4, 5]
    assert res.verified == [1] and res.corrupt == [2, 3, 4, 5]
    assert site.on_disk() == [1, 2, 3, 4, 5]


def test_nothing_verifies_nothing_deleted(tmp_path: Path) -> None:
    site = Site(tmp_path, keep_warm=1)
    site.save(range(1, 4))
    for step in (1, 2, 3):
        site.corrupt(step, name="opt.bin")
    (res,) = run_gc(site.cfg).series
    assert res.deleted == [] and res.corrupt == [1, 2, 3]


def test_pins_are_honoured(tmp_path: Path) -> None:
    site = Site(tmp_path, keep_warm=1)
    site.save(range(1, 6), meta={2: {"pinned": True}})
    (tmp_path / "pfs/alice/run" / pin_name(1)).touch()
    (res,) = run_gc(site.cfg).series
    assert res.pinned == [1, 2] and res.keep == [1, 2, 5] and res.deleted == [3, 4]


def test_window_keepers_verified_when_they_shield_a_deletion(tmp_path: Path) -> None:
    site = Site(tmp_path, keep_warm=1, every="100s")
    wall = {1: 10.0, 2: 20.0, 3: 110.0, 4: 120.0, 5: 210.0, 6: 220.0}
    site.save(range(1, 7), wall=wall)
    policy = policy_from_config(site.cfg)
    res = gc_series(site.pfs, "alice", "run", policy, now=1000.0, dry_run=True)
    # Newest 6; the oldest of each 100 s window: 1, 3, 5. Window keeper 5 shields nothing
    # (6 is kept anyway), so only 1, 3 and 6 need a verification.
    assert res.keep == [1, 3, 5, 6] and res.delete == [2, 4]
    assert res.verified == [1, 3, 6]
    site.corrupt(1)
    res = gc_series(site.pfs, "alice", "run", policy, now=1000.0)
    # 1 does not verify: window 0 is kept by 2 instead (verified), and 1 may go.
    assert res.corrupt == [1] and res.verified == [2, 3, 6]
    assert res.keep == [2, 3, 5, 6] and res.deleted == [1, 4]
    assert site.on_disk() == [2, 3, 5, 6]


def test_cold_tier_and_archiving_in_progress(tmp_path: Path) -> None:
    site = Site(tmp_path, keep_warm=1, cold=True)
    site.save(range(1, 5))
    for step in range(1, 4):  # real copies on the cold tier: identical manifests
        copy_checkpoint(site.pfs, site.cold, "alice", "run", step)
    # Step 4 is being archived to the cold tier right now: keep its PFS copy.
    (tmp_path / "cold/alice/run" / partial_dirname(4)).mkdir()
    site.save([5])
    report = run_gc(site.cfg, as_owner=False)
    res = {r.tier: r for r in report.series}
    assert res["pfs"].keep == [4, 5] and res["pfs"].deleted == [1, 2, 3]
    # The cold tier keeps everything younger than tiers.cold.keep_for (30 days).
    assert res["cold"].keep == [1, 2, 3] and res["cold"].deleted == []
    # A month later: 4 (the first of its day on the PFS) has aged into the cold tier,
    # verified there; the cold tier drops what is older than keep_for but its newest.
    report = run_gc(site.cfg, now=time.time() + 31 * 86400, as_owner=False)
    assert [(a.src, a.dst, a.copied) for a in report.aged] == [("pfs", "cold", [4])]
    res = {r.tier: r for r in report.series}
    assert res["cold"].deleted == [1, 2, 3] and site.on_disk(tier=site.cold) == [4]


def test_a_next_tier_copy_counts_only_when_identical_and_verifying(tmp_path: Path) -> None:
    """What the cold tier merely lists is no reason to drop the PFS copy: a step written
    there independently (other manifest bytes) is still owed, and so is an identical
    copy that no longer verifies; the PFS keeps both."""
    site = Site(tmp_path, keep_warm=1, cold=True)
    site.save([1], wall={1: 1000.0})
    site.save([2], wall={2: 90000.0})
    site.save([3])
    site.save([1], tier=site.cold, wall={1: 1000.0})  # same step, other bytes
    copy_checkpoint(site.pfs, site.cold, "alice", "run", 2)
    path = Path(site.cold.step_path("alice", "run", 2)) / "model.bin"
    data = bytearray(path.read_bytes())
    data[7] ^= 0xFF
    path.write_bytes(bytes(data))
    report = run_gc(site.cfg, as_owner=False)
    res = {r.tier: r for r in report.series}
    assert res["pfs"].keep == [1, 2, 3] and res["pfs"].deleted == []
    aged = {(a.src, a.dst): a for a in report.aged}[("pfs", "cold")]
    assert 1 in aged.planned and 1 not in aged.copied and aged.errors
    assert site.on_disk() == [1, 2, 3]


def test_user_and_key_filters(tmp_path: Path) -> None:
    site = Site(tmp_path, keep_warm=1)
    site.save(range(1, 4))
    site.save(range(1, 4), key="other")
    site.save(range(1, 4), user="bob")
    report = run_gc(site.cfg, user="alice", key="other")
    assert [(r.user, r.key, r.deleted) for r in report.series] == [("alice", "other", [1, 2])]
    assert site.on_disk() == [1, 2, 3] and site.on_disk(user="bob") == [1, 2, 3]
    report = run_gc(site.cfg, user="bob")
    assert [(r.user, r.key, r.deleted) for r in report.series] == [("bob", "run", [1, 2])]


def test_plan_series_replans_after_each_failure() -> None:
    infos = [CkptInfo(step=s, wall_time=float(s)) for s in range(1, 8)]
    bad = {7, 6, 4}
    asked: List[int] = []

    def verify(step: int) -> bool:
        asked.append(step)
        return step not in bad

    deletions, results = plan_series(
        infos, 100.0, RetentionPolicy(keep_warm=2, keep_warm_every_s=0), verify
    )
    # The two newest that verify are 5 and 3. 7 and 6 fail but are newer than 5, so the
    # policy keeps them; 4 fails and is older than 5, so it may go.
    assert sorted(s for s, ok in results.items() if ok) == [3, 5]
    assert deletions == [1, 2, 4]
    assert asked == [7, 6, 5, 4, 3]  # newest first, each once


def test_cli_dry_run_json_then_text(tmp_path: Path) -> None:
    site = Site(tmp_path, keep_warm=2)
    site.save(range(1, 5))
    r = ckpt_slurm("gc", "--dry-run", "--json", config=site.cfg_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    (s,) = doc["series"]
    assert doc["dry_run"] and s["delete"] == [1, 2] and s["deleted"] == []
    assert set(s) >= {"tier", "user", "key", "keep", "delete", "deleted", "verified", "corrupt"}
    assert site.on_disk() == [1, 2, 3, 4]
    r = ckpt_slurm("gc", config=site.cfg_path)
    assert r.returncode == 0, r.stderr
    assert "alice/run" in r.stdout and "deleted 2" in r.stdout
    assert site.on_disk() == [3, 4]
    r = ckpt_slurm("gc", "--key", "../x", config=site.cfg_path)
    assert r.returncode == 2 and r.stderr.startswith("ckpt-slurm: error: invalid key")


@pytest.mark.root
def test_failed_deletion_is_reported_with_exit_1(tmp_path: Path) -> None:
    site = Site(tmp_path, keep_warm=1)
    site.save(range(1, 4))
    stuck = Path(site.pfs.step_path("alice", "run", 1))
    subprocess.run(["chattr", "+i", str(stuck)], check=True)  # even root cannot unlink in it
    try:
        r = ckpt_slurm("gc", "--json", config=site.cfg_path)
        assert r.returncode == 1
        (s,) = json.loads(r.stdout)["series"]
        assert s["deleted"] == [2] and len(s["errors"]) == 1 and "step-0000000001" in s["errors"][0]
    finally:
        subprocess.run(["chattr", "-i", str(stuck)], check=True)
    assert site.on_disk() == [1, 3]  # the manifest goes first: its unlink failed
    assert step_dirname(2) not in os.listdir(tmp_path / "pfs/alice/run")
