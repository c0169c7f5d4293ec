"""A site without a PFS: ``[tiers.local]`` + ``[tiers.object]`` on the session's real
SeaweedFS. The root flushers (epilog, prolog staging, stager, root flush) copy to the
object store as each checkpoint's owner, under that owner's prefix, with root's
credentials (which the user cannot read); ckpt-srun's and a user's own flush go there
too; node statuses are signed objects in the bucket (a forged one is ignored); status,
list, verify and drill know the object tier and show the data version."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Iterator

import pytest
from conftest import Mounts, need_root
from helpers.cli import ckpt_slurm
from helpers.site import HookSite

from slurm_ckpt.core.config import Config
from slurm_ckpt.core.names import UserIds, user_ids
from slurm_ckpt.errors import ConfigError
from slurm_ckpt.hooks.epilog import run_epilog
from slurm_ckpt.hooks.prolog import ensure_user_dir, run_prolog
from slurm_ckpt.hooks.stager import stager_pass
from slurm_ckpt.ledger import Ledger, State
from slurm_ckpt.ledger.status_store import ObjectStatusStore, sign, status_store
from slurm_ckpt.node import warm
from slurm_ckpt.node.asuser import run_as_user
from slurm_ckpt.ops.flush_cmd import flush_node, flush_own, flush_series
from slurm_ckpt.ops.maint import guard
from slurm_ckpt.ops.status import collect_status, no_slurm
from slurm_ckpt.tiers.registry import tiers_from_config

pytestmark = pytest.mark.root
USERS = ("ckptuser1", "ckptuser2")
REPO = Path(__file__).resolve().parents[1]


def ids(user: str) -> UserIds:
    return user_ids(user)


class Site(HookSite):
    """A tmpfs local tier and a fresh prefix in the test bucket; no PFS."""

    defaults = {
        "copy": {"chunk_size": "1MiB", "streams": 2},
        "hooks": {"budget": 60},
        "retention": {"keep_local": 1},
    }

    def __init__(self, base: Path, mounts: Mounts, s3: Any) -> None:
        super().__init__(base, mounts.tmpfs("64m", "local"))
        self.s3 = s3
        self.bucket = s3.bucket("warm")
        self.prefix = s3.fresh_prefix("warm")

    def warm_tiers(self) -> Dict[str, Dict[str, Any]]:
        return {"object": self.s3.object_config(self.bucket, self.prefix, part_size="5MiB")}

    def write_config(self, cfg_text_extra: str = "") -> Path:
        path = self.base / "site.toml"
        o = self.s3.object_config(self.bucket, self.prefix)
        path.write_text(
            f'[tiers.local]\nroot = "{self.local}"\nmin_free = 0\nrequire_mount = false\n'
            f'[tiers.object]\nendpoint = "{o["endpoint"]}"\nbucket = "{o["bucket"]}"\n'
            f'prefix = "{o["prefix"]}"\n[copy]\nchunk_size = "1MiB"\n' + cfg_text_extra
        )
        os.chmod(path, 0o644)
        return path


@pytest.fixture
def site(s3_server) -> Iterator[Site]:
    need_root()
    for u in USERS:
        try:
            pwd.getpwnam(u)
        except KeyError:
            subprocess.run(["useradd", "--create-home", u], check=True)
    base = Path(tempfile.mkdtemp(prefix="sckpt-objwarm-", dir="/var/tmp"))
    os.chmod(base, 0o755)
    m = Mounts(base)
    try:
        yield Site(base, m, s3_server)
    finally:
        m.close()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def root_only_credentials(monkeypatch, s3_server, tmp_path: Path) -> Path:
    """Root's S3 keys only in a root-only credentials file (no AWS variables): a child
    that has become the user cannot read them, so a root flush works only with the keys
    root lends it before the fork."""
    creds = tmp_path / "root-credentials"
    creds.write_text(
        f"[default]\naws_access_key_id = {s3_server.key_id}\n"
        f"aws_secret_access_key = {s3_server.secret}\n"
    )
    os.chmod(tmp_path, 0o700)
    os.chmod(creds, 0o600)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setattr(warm, "_LENT", None)
    monkeypatch.setattr(warm, "_LENT_SET", False)
    return creds


def save(cfg: Config, user: str, key: str, step: int, job: str = "100", dv: str = "") -> None:
    """Write a checkpoint as ``user`` on the local tier (its directory made as the prolog
    would)."""
    ensure_user_dir(str(cfg.tiers.local.root), ids(user))

    def write() -> int:
        w = tiers_from_config(cfg)["local"].writer(
            user, key, step, job=job, meta={"data_version": dv} if dv else {}
        )
        w.write_buffers({"model.bin": os.urandom(3 * 2**20), "opt.bin": b"o" * 100})
        w.commit()
        return step

    run_as_user(user, write)


def object_steps(cfg: Config, user: str, key: str) -> list:
    return [s.step for s in tiers_from_config(cfg)["object"].steps(user, key)]


def keys_in_bucket(site: Site) -> list:
    c = site.s3.client()
    out = []
    for page in c.get_paginator("list_objects_v2").paginate(
        Bucket=site.bucket, Prefix=site.prefix + "/"
    ):
        out += [o["Key"][len(site.prefix) + 1 :] for o in page.get("Contents", [])]
    return out


# --------------------------------------------------------------------------- root flushers


def test_epilog_flushes_to_the_object_store_as_each_owner_with_roots_credentials(
    site: Site, root_only_credentials: Path
) -> None:
    cfg = site.cfg()
    save(cfg, "ckptuser1", "run", 1)
    save(cfg, "ckptuser1", "run", 2)
    save(cfg, "ckptuser2", "other", 7, job="101")
    report = run_epilog(cfg, site.env("ckptuser1"))
    assert not report.flush.failed, report.flush.failed
    assert sorted(report.flush.flushed) == [
        ("ckptuser1", "run", 1),
        ("ckptuser1", "run", 2),
        ("ckptuser2", "other", 7),
    ]
    # Each owner's data under that owner's prefix only.
    names = keys_in_bucket(site)
    assert {n.split("/")[0] for n in names} == {"ckptuser1", "ckptuser2", ".slurm_ckpt"}
    assert all(n.startswith("ckptuser2/other/") for n in names if "ckptuser2" in n)
    assert object_steps(cfg, "ckptuser1", "run") == [1, 2]
    assert object_steps(cfg, "ckptuser2", "other") == [7]
    # The ledger's warm-tier slot says VERIFIED; local retention (keep_local 1) dropped
    # step 1 only after finding the identical committed copy in the object store.
    ledger = Ledger(cfg.ledger.dir, "n1")
    rec = {r.ident: r for r in ledger.records()}
    assert rec[("ckptuser1", "run", 2)].state("pfs") is State.VERIFIED
    local = tiers_from_config(cfg)["local"]
    assert [s.step for s in local.steps("ckptuser1", "run")] == [2]


def test_roots_credentials_file_is_lent_to_the_owner_children_only(
    site: Site, root_only_credentials: Path, monkeypatch
) -> None:
    """``tiers.object.credentials_file``: root's keys in a root-only file named by the
    config. The epilog's owner children flush with them; the user's own process cannot
    read them (and has no others here), so its flush fails with one line."""
    monkeypatch.delenv("AWS_SHARED_CREDENTIALS_FILE")
    obj = site.s3.object_config(
        site.bucket, site.prefix, part_size="5MiB", credentials_file=str(root_only_credentials)
    )
    cfg = Config.from_dict(
        {**site.cfg().to_dict(), "tiers": {**site.cfg().to_dict()["tiers"], "object": obj}}
    )
    save(cfg, "ckptuser1", "run", 1)
    lines = run_as_user("ckptuser1", lambda: flush_series(cfg, "ckptuser1", "run", 60))
    assert len(lines) == 1 and "flush failed" in lines[0] and "credentials" in lines[0], lines
    report = run_epilog(cfg, site.env("ckptuser1"))
    assert report.flush.flushed == [("ckptuser1", "run", 1)], report.flush.failed
    assert object_steps(cfg, "ckptuser1", "run") == [1]


def test_a_user_cannot_make_roots_child_write_under_another_prefix(site: Site) -> None:
    cfg = site.cfg()
    tier = tiers_from_config(cfg)["object"]
    u1, u2 = ids("ckptuser1"), ids("ckptuser2")

    def as_user1() -> str:
        try:
            tier.guard_user("ckptuser2", u2.uid)
        except Exception as exc:  # noqa: BLE001 - the message is the result
            return str(exc)
        return "allowed"

    got = run_as_user("ckptuser1", as_user1)
    assert "is not ckptuser2" in got and "refusing" in got
    assert run_as_user("ckptuser1", lambda: tier.guard_user("ckptuser1", u1.uid)) is None


def test_stager_and_root_flush_finish_hand_offs_into_the_object_store(site: Site) -> None:
    slow = site.cfg(object={"bandwidth_limit": "2MB/s"}, hooks={"budget": 1.5})
    save(slow, "ckptuser1", "run", 5)
    save(slow, "ckptuser1", "run", 6)
    report = run_epilog(slow, site.env("ckptuser1"))  # 6 MiB at 2 MB/s in 1.5 s: no
    assert report.flush.handed and report.backlog[0] >= 1, report
    stager_pass(site.cfg(), "n1", client=None)
    assert object_steps(slow, "ckptuser1", "run") == [5, 6]
    cfg = site.cfg()
    save(cfg, "ckptuser2", "other", 3, job="102")
    summary = flush_node(cfg, "n1")
    assert [f[0] for f in summary.flushed] == [("ckptuser2", "other", 3)], summary.to_dict()
    assert object_steps(cfg, "ckptuser2", "other") == [3]


def test_prolog_stages_the_newest_object_checkpoint_on_requeue(site: Site) -> None:
    cfg = site.cfg(hooks={"stage_on_requeue": True})
    save(cfg, "ckptuser1", "run", 3, job="200")
    run_epilog(cfg, site.env("ckptuser1", job="200"))
    local = tiers_from_config(cfg)["local"]
    run_as_user("ckptuser1", lambda: local.delete("ckptuser1", "run", 3))
    report = run_prolog(cfg, site.env("ckptuser1", job="200", restart=1))
    assert report.staged == "run step 3"
    assert [s.step for s in local.steps("ckptuser1", "run")] == [3]


def test_ckpt_srun_and_a_users_own_flush_go_to_the_object_store(site: Site) -> None:
    cfg = site.cfg()
    save(cfg, "ckptuser1", "run", 1)
    save(cfg, "ckptuser1", "run", 2)
    lines = run_as_user("ckptuser1", lambda: flush_series(cfg, "ckptuser1", "run", 60))
    assert lines == ["step 2: " + lines[0].split(": ", 1)[1], lines[1]]
    assert all("flushed in" in ln for ln in lines), lines
    assert object_steps(cfg, "ckptuser1", "run") == [1, 2]
    again = run_as_user("ckptuser1", lambda: flush_series(cfg, "ckptuser1", "run", 60))
    assert again == ["step 2: already on the object tier", "step 1: already on the object tier"]
    # A user's own `ckpt-slurm flush` (no ledger on this node: every local step).
    save(cfg, "ckptuser1", "run", 3)
    summary = run_as_user("ckptuser1", lambda: flush_own(cfg, "ckptuser1", "n1").to_dict())
    assert [(f["step"], f["bytes"] > 0) for f in summary["flushed"]] == [(3, True)], summary
    assert object_steps(cfg, "ckptuser1", "run") == [1, 2, 3]


# --------------------------------------------------------------------------- node statuses


def test_node_statuses_are_signed_objects_and_a_forged_one_is_ignored(site: Site) -> None:
    cfg = site.cfg()
    slow = site.cfg(object={"bandwidth_limit": "2MB/s"}, hooks={"budget": 1.5})
    save(cfg, "ckptuser1", "run", 4, job="300")
    save(cfg, "ckptuser1", "run", 5, job="300")
    report = run_epilog(slow, site.env("ckptuser1", job="300"))  # leaves one pending
    owed = report.backlog[0]
    assert owed >= 1, report
    store = status_store(cfg)
    assert isinstance(store, ObjectStatusStore)
    assert store.where == f"s3://{site.bucket}/{site.prefix}/.slurm_ckpt/nodes/"
    (doc,) = store.read()
    assert doc["node"] == "n1" and doc["pending"]["count"] == owed
    # A user holding keys of their own to the bucket forges "n2 owes nothing" (and tampers
    # with n1's): neither counts.
    c = site.s3.client()
    fake = json.dumps({"node": "n2", "pending": {"count": 0, "bytes": 0}}).encode()
    base = f"{site.prefix}/.slurm_ckpt/nodes/"
    c.put_object(Bucket=site.bucket, Key=base + "n2.json", Body=fake)
    c.put_object(
        Bucket=site.bucket,
        Key=base + "n3.json",
        Body=fake.replace(b"n2", b"n3"),
        Metadata={"slurm-ckpt-sig": sign("another-users-secret", fake.replace(b"n2", b"n3"))},
    )
    notes: list = []
    docs = store.read(notes)
    assert [d["node"] for d in docs] == ["n1"]
    assert len(notes) == 2 and all("not signed by root's credentials" in n for n in notes)
    # guard without a ledger on this host reads the node status: n1 still owes its step.
    other = Config.from_dict(
        {**cfg.to_dict(), "ledger": {"dir": str(site.base / "no-ledger-here")}}
    )
    # It takes only a status published after the moment it starts (a replay of an older
    # one, even root's, must not decide a reboot): n1's last one is older.
    with pytest.raises(Exception, match="no node status newer than"):
        guard(other, "n1", 0.0, 0.1)
    with pytest.raises(Exception, match="not yet flushed to the object store"):
        guard(other, "n1", 0.0, 0.1, since=doc["time"] - 1)  # started before it
    since = time.time()
    stager_pass(cfg, "n1", client=None)
    assert "nothing waiting for a flush" in guard(other, "n1", 0.0, 0.1, since=since)


def test_admission_without_a_pfs_needs_a_shared_directory(site: Site, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"admission.dir: a site without a PFS"):
        site.cfg(admission={"max_nodes": 2})
    cfg = site.cfg(admission={"max_nodes": 2, "dir": str(tmp_path / "slots")})
    save(cfg, "ckptuser1", "run", 1)
    report = run_epilog(cfg, site.env("ckptuser1"))
    assert report.flush.flushed == [("ckptuser1", "run", 1)]
    assert (tmp_path / "slots" / "state.json").is_file()


# --------------------------------------------------------------------------- operator views


def cli(*args: str, config: Path) -> subprocess.CompletedProcess:
    return ckpt_slurm(*args, config=config, timeout=180)


def test_status_list_verify_and_drill_know_the_object_tier(site: Site) -> None:
    path = site.write_config()
    cfg = Config.load(path)
    save(cfg, "ckptuser1", "run", 1, job="400", dv="imagenet@2024-05")
    save(cfg, "ckptuser1", "run", 2, job="400", dv="imagenet@2024-06")
    run_epilog(cfg, site.env("ckptuser1", job="400"))

    doc = collect_status(cfg, query=lambda: no_slurm("test")).to_json()
    assert doc["warm_tier"] == "object" and doc["pfs_root"] is None
    assert doc["node_statuses"].startswith("s3://")
    (job,) = [j for j in doc["jobs"] if j["user"] == "ckptuser1"]
    assert set(job["tiers"]) == {"local", "object"}
    assert job["tiers"]["object"]["step"] == 2
    assert job["data_version"] == "imagenet@2024-06"
    assert job["steps_at_risk"] == 0 and job["checkpoints_at_risk"] == 0

    r = cli("status", "--no-slurm", "--parsable", config=path)
    assert r.returncode == 0, r.stderr
    header, *rows = r.stdout.splitlines()
    assert "object_step" in header.split("|") and "data_version" in header.split("|")
    row = dict(zip(header.split("|"), rows[0].split("|")))
    assert row["object_step"] == "2" and row["data_version"] == "imagenet@2024-06"

    r = cli("list", "run", "-u", "ckptuser1", "--json", config=path)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["checkpoints"]
    assert [(x["tier"], x["step"], x["data_version"]) for x in rows] == [
        ("local", 1, "imagenet@2024-05"),
        ("local", 2, "imagenet@2024-06"),
        ("object", 1, "imagenet@2024-05"),
        ("object", 2, "imagenet@2024-06"),
    ]
    r = cli("verify", "run", "-u", "ckptuser1", "--tier", "object", "--json", config=path)
    assert r.returncode == 0, r.stderr
    assert [(x["tier"], x["state"]) for x in json.loads(r.stdout)["checkpoints"]] == [
        ("object", "OK"),
        ("object", "OK"),
    ]
    # The drill picks what a restart would: the local copy first, the object store once
    # the local one is gone.
    r = cli("drill", "run", "-u", "ckptuser1", "--json", config=path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tier"] == "local"
    local = tiers_from_config(cfg)["local"]
    run_as_user("ckptuser1", lambda: local.delete("ckptuser1", "run", 2))
    r = cli("drill", "run", "-u", "ckptuser1", "--json", config=path)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["ok"] and got["tier"] == "object" and got["step"] == 2
    assert got["path"].startswith(f"s3://{site.bucket}/")


@pytest.mark.parametrize("chunk_mib", [5, 10])
def test_parts_within_one_chunk_carry_a_crc_computed_on_the_way_in(
    site: Site, chunk_mib: int
) -> None:
    """A part of one hash chunk (5 MiB), or a whole fraction of one (10 MiB chunks in
    5 MiB parts), is filled front to back by one thread: its CRC32 is computed as the
    bytes are read (straight into the part buffer), not in a second pass. The store
    checks every part's CRC32 (a wrong one is refused), and the copy verifies."""
    from slurm_ckpt.tiers.copy import copy_checkpoint
    from slurm_ckpt.tiers.posix import PosixTier
    from slurm_ckpt.tiers.s3 import S3Tier

    chunk = chunk_mib * 2**20
    # 3 MiB pieces: they do not divide a part, so reads stop at part ends.
    local = PosixTier("local", str(site.local), chunk_size=chunk, buffer_size=3 * 2**20)
    obj = S3Tier(
        "object",
        endpoint=site.s3.endpoint,
        bucket=site.bucket,
        prefix=site.prefix,
        part_size=5 * 2**20,
        chunk_size=chunk,
        concurrency=3,
    )
    assert obj.part_len(chunk, split=True) == 5 * 2**20
    data = os.urandom(2 * chunk + 12345)  # full parts and a short last one
    with local.writer("u", "k", 1) as w:
        w.write_buffers({"a.bin": data, "b.bin": data[:100]})
    res = copy_checkpoint(local, obj, "u", "k", 1)
    assert res.copied_bytes == len(data) + 100
    assert obj.verify("u", "k", 1).ok
    head = site.s3.client().head_object(
        Bucket=site.bucket, Key=f"{site.prefix}/u/k/step-0000000001/a.bin", ChecksumMode="ENABLED"
    )
    assert head["ContentLength"] == len(data)
