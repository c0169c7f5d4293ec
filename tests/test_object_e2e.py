"""The four tiers end to end, on real parts: node-local tmpfs, an ext4 "PFS", the object
tier on the session's SeaweedFS, and the cold tier on an xfs loop device capped like an
HDD. save -> local -> PFS -> object -> cold, each verified; restore from each tier alone;
a killed upload; a corrupt object; wrong credentials; a full store; the data version."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import numpy as np
import pytest

from slurm_ckpt import Checkpointer
from slurm_ckpt.cli.gc import run_gc
from slurm_ckpt.core.config import Config
from slurm_ckpt.job.dataversion import fingerprint_files
from slurm_ckpt.job.restore import DataVersionMismatch
from slurm_ckpt.ops.restore import restore_to
from slurm_ckpt.tiers import s3_upload
from slurm_ckpt.tiers.copy import copy_checkpoint
from slurm_ckpt.tiers.registry import tiers_from_config

REPO = Path(__file__).resolve().parents[1]
FORK = mp.get_context("fork")
USER, KEY = "alice", "run"
MiB = 2**20


def state(step: int) -> Dict[str, Any]:
    rnd = np.random.default_rng(step)
    return {
        "model": {"w": rnd.standard_normal(12 * MiB // 8)},  # 12 MiB: 3 parts of 5 MiB
        "optimizer": {"m": rnd.standard_normal(MiB // 8), "step": step},
    }


def same(a: Dict[str, Any], b: Dict[str, Any]) -> None:
    assert np.array_equal(a["model"]["w"], b["model"]["w"])
    assert np.array_equal(a["optimizer"]["m"], b["optimizer"]["m"])
    assert a["optimizer"]["step"] == b["optimizer"]["step"]


@pytest.fixture
def site(tmp_path: Path, mounts, s3_server):
    """A site with every tier; ``site(pfs=False, cold=False)`` builds a smaller one."""

    def make(pfs: bool = True, cold: bool = True, **obj: Any) -> Config:
        tiers: Dict[str, Any] = {
            "local": {
                "root": str(mounts.tmpfs("128m", "local")),
                "require_mount": False,
                "min_free": 0,
            },
            "object": s3_server.object_config(
                s3_server.bucket("e2e"),
                s3_server.fresh_prefix(),
                part_size="5MiB",
                concurrency=4,
                **obj,
            ),
        }
        if pfs:
            tiers["pfs"] = {"root": str(mounts.loopfs(128, "ext4", "pfs"))}
        if cold:
            tiers["cold"] = {
                "root": str(mounts.loopfs(320, "xfs", "cold", bps=40 * 10**6)),
                "bandwidth_limit": "40MB/s",
            }
        return Config.from_dict(
            {
                "tiers": tiers,
                "ledger": {"dir": str(tmp_path / "ledger")},
                "copy": {"chunk_size": "1MiB", "streams": 4, "buffer_size": "256KiB"},
                "retention": {"keep_local": 1, "keep_warm": 1, "keep_warm_every": 0},
            }
        )

    return make


def ckpt(cfg: Config, **kw: Any) -> Checkpointer:
    return Checkpointer(config=cfg, key=KEY, user=USER, install_signals=False, **kw)


def steps(cfg: Config) -> Dict[str, list]:
    return {n: [s.step for s in t.steps(USER, KEY)] for n, t in tiers_from_config(cfg).items()}


def test_save_goes_local_pfs_object_cold_each_verified_and_restores_from_each(site) -> None:
    cfg = site()
    with ckpt(cfg) as c:
        c.save(state(1), step=1, data_version="v1")
    report = run_gc(cfg, as_owner=False)
    assert report.ok, report.to_dict()
    assert [(a.src, a.dst, a.copied) for a in report.aged] == [
        ("pfs", "object", [1]),
        ("object", "cold", [1]),
    ]
    tiers = tiers_from_config(cfg)
    assert steps(cfg) == {"local": [1], "pfs": [1], "object": [1], "cold": [1]}
    first = tiers["local"].manifest_bytes(USER, KEY, 1)
    for t in tiers.values():
        assert t.verify(USER, KEY, 1).ok, t.name
        assert t.manifest_bytes(USER, KEY, 1) == first  # the same checkpoint, byte for byte
    # Restore from each tier alone: wipe the faster ones one after the other.
    for name in ("local", "pfs", "object", "cold"):
        got = ckpt(cfg).restore()
        assert got is not None and got.tier == name and got.step == 1
        assert got.data_version == "v1"
        same(got.state, state(1))
        tiers[name].delete(USER, KEY, 1)
    assert ckpt(cfg).restore() is None


def test_no_pfs_the_object_store_is_the_warm_tier(site) -> None:
    cfg = site(pfs=False, cold=False)
    with ckpt(cfg) as c:
        c.save(state(1), step=1)
        c.wait()
        c.save(state(2), step=2)
        c.wait()
        assert c.stats.flushes == 2 and c.stats.flush_failures == 0
    assert steps(cfg) == {"local": [2], "object": [1, 2]}  # keep_local=1: 1 went once flushed
    tiers = tiers_from_config(cfg)
    tiers["local"].delete(USER, KEY, 2)  # the node is gone: resume from the object store
    got = ckpt(cfg).restore()
    assert got.tier == "object" and got.step == 2
    same(got.state, state(2))


def _die_mid_upload(src, dst) -> None:
    """Copy, and SIGKILL this process when the first multipart upload has all its parts
    sent but is not completed yet."""
    s3_upload.ObjectUpload.complete = lambda self: os.kill(os.getpid(), signal.SIGKILL)
    copy_checkpoint(src, dst, USER, KEY, 1)
    os._exit(3)  # not reached


def test_a_killed_upload_leaves_nothing_listed_and_completes_on_retry(site) -> None:
    cfg = site(pfs=False, cold=False)
    tiers = tiers_from_config(cfg)
    local, obj = tiers["local"], tiers["object"]
    with ckpt(cfg, flush_every=10**6) as c:  # save only; no flush in the job
        c.save(state(1), step=1)
        c.wait(flush=False)
    obj.delete(USER, KEY, 1)  # close() flushed the newest: start from nothing on the store
    prefix = obj.step_prefix(USER, KEY, 1)
    p = FORK.Process(target=_die_mid_upload, args=(local, obj))
    p.start()
    p.join(120)
    assert p.exitcode == -9  # SIGKILLed mid-upload
    assert obj.steps(USER, KEY) == []
    assert obj.uploads(prefix)  # an interrupted multipart upload is left...
    res = copy_checkpoint(local, obj, USER, KEY, 1)  # ...and the retry completes
    assert not res.already_present and obj.verify(USER, KEY, 1).ok
    assert obj.uploads(prefix) == []  # the interrupted one was aborted
    assert [s.step for s in obj.steps(USER, KEY)] == [1]


def test_a_corrupt_object_is_detected_and_another_tier_is_used(site, caplog) -> None:
    cfg = site(pfs=False)
    with ckpt(cfg) as c:
        c.save(state(1), step=1)
    run_gc(cfg, as_owner=False)  # object -> cold
    tiers = tiers_from_config(cfg)
    assert steps(cfg) == {"local": [1], "object": [1], "cold": [1]}
    tiers["local"].delete(USER, KEY, 1)
    blob = next(f for f in tiers["object"].manifest(USER, KEY, 1).files if "data-0000" in f.path)
    tiers["object"].corrupt_for_tests(USER, KEY, 1, blob.path, 2 * MiB + 5)
    rep = tiers["object"].verify(USER, KEY, 1)
    assert not rep.ok and "bytes 2097152-3145728" in rep.summary()
    with caplog.at_level(logging.WARNING, logger="slurm_ckpt"):
        got = ckpt(cfg).restore()
    assert got.tier == "cold" and got.step == 1
    same(got.state, state(1))
    assert "content hash mismatch" in caplog.text
    # The CLI brings it back from the cold tier too, verified.
    out = restore_to(
        cfg, KEY, str(Path(cfg.ledger.dir).parent / "back"), user=USER, tier="cold", step=1
    )
    assert out["tier"] == "cold" and os.path.isdir(out["path"])


def test_wrong_credentials_are_one_clear_line(site, tmp_path: Path) -> None:
    cfg = site(pfs=False, cold=False)
    path = tmp_path / "config.toml"
    o = cfg.tiers.object
    path.write_text(
        f'[tiers.local]\nroot = "{cfg.tiers.local.root}"\nrequire_mount = false\n'
        f'[tiers.object]\nendpoint = "{o.endpoint}"\nbucket = "{o.bucket}"\n'
        f'prefix = "{o.prefix}"\n[ledger]\ndir = "{cfg.ledger.dir}"\n'
    )
    env = dict(os.environ, PYTHONPATH=str(REPO), AWS_SECRET_ACCESS_KEY="not-the-secret")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "slurm_ckpt.cli.main",
            "--config",
            str(path),
            "list",
            KEY,
            "--tier",
            "object",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "access denied" in lines[0] and "wrong credentials" in lines[0]


def test_a_full_object_store_leaves_the_pfs_copy_alone(site, s3_server) -> None:
    cfg = site(cold=False)
    with ckpt(cfg) as c:
        c.save(state(1), step=1)
        c.wait()
        c.save(state(2), step=2)
    assert steps(cfg)["pfs"] == [1, 2]
    with s3_server.full_disk():
        report = run_gc(cfg, as_owner=False)
    assert not report.ok
    errors = [e for a in report.aged for e in a.errors]
    assert errors and all("HTTP 500" in e and "\n" not in e for e in errors), errors
    # keep_warm=1, but both are still owed to the object store: neither is dropped.
    assert steps(cfg)["pfs"] == [1, 2] and steps(cfg)["object"] == [], report.to_dict()
    tiers = tiers_from_config(cfg)
    assert all(tiers["pfs"].verify(USER, KEY, s).ok for s in (1, 2))
    # Space is back: the next run copies them on, and only then may the PFS drop one.
    report = run_gc(cfg, as_owner=False)
    assert report.ok, report.to_dict()
    assert report.aged[0].copied == [1, 2]
    # Both arrived (verified there); then retention (keep_warm=1) applies to each tier.
    assert steps(cfg)["pfs"] == [2] and steps(cfg)["object"] == [2]


def test_a_full_store_fails_the_flush_and_keeps_the_local_copy(site, s3_server) -> None:
    cfg = site(pfs=False, cold=False)
    with s3_server.full_disk():
        c = ckpt(cfg)
        c.save(state(1), step=1)
        c.wait()
        stats = c.stats
        c.close()
    assert stats.flush_failures >= 1 and "HTTP 500" in (stats.last_error or "")
    assert steps(cfg) == {"local": [1], "object": []}
    with ckpt(cfg) as c:  # the next run: its own save flushed, and (outside SLURM) the
        c.save(state(2), step=2)  # step the full store refused, owed, flushed at its start
    assert steps(cfg)["object"] == [1, 2]


def test_the_data_version_round_trips_and_a_change_warns_or_refuses(
    site, tmp_path: Path, caplog
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "shard-0.bin").write_bytes(b"x" * 1000)
    version = fingerprint_files([data])
    cfg = site(pfs=False, cold=False)
    with ckpt(cfg) as c:
        c.save(state(1), step=1, data_version=version)
    got = ckpt(cfg).restore(expect_data_version=version)
    assert got.data_version == version and got.meta["data_version"] == version
    # Same data: same fingerprint. A file rewritten: another one.
    assert fingerprint_files([data]) == version
    (data / "shard-0.bin").write_bytes(b"y" * 1001)
    now = fingerprint_files([data])
    assert now != version
    with caplog.at_level(logging.WARNING, logger="slurm_ckpt"):
        got = ckpt(cfg).restore(expect_data_version=now)
    assert got.step == 1 and f"trained on data version {version!r}" in caplog.text
    with pytest.raises(DataVersionMismatch, match="refused"):
        ckpt(cfg).restore(expect_data_version=now, on_data_change="refuse")
    tiers = tiers_from_config(cfg)
    assert tiers["object"].manifest(USER, KEY, 1).meta["data_version"] == version
