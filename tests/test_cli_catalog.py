"""``ckpt-slurm list`` / ``verify`` end to end: exit codes, JSON, one-line errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers.cli import ckpt_slurm
from helpers.site import Site

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def site(tmp_path: Path):
    s = Site(tmp_path)
    for step in (1, 2):
        s.write(step, tokens=step * 10, files={"w.bin": os.urandom(1000)})
    s.copy(1)
    return s.cfg_path, s.local, s.pfs


def test_list_json(site) -> None:
    cfg, lt, pt = site
    r = ckpt_slurm("list", "run", "--user", "alice", "--json", config=cfg)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["checkpoints"]
    assert sorted((x["tier"], x["step"], x["tokens"]) for x in rows) == [
        ("local", 1, 10),
        ("local", 2, 20),
        ("pfs", 1, 10),
    ]


def test_verify_exit_codes(site) -> None:
    cfg, lt, pt = site
    assert ckpt_slurm("verify", "run", "--user", "alice", config=cfg).returncode == 0
    with open(lt.step_path("alice", "run", 2) + "/w.bin", "r+b") as fh:
        fh.write(b"\xff")
    r = ckpt_slurm("verify", "run", "--user", "alice", "--json", config=cfg)
    assert r.returncode == 1
    doc = json.loads(r.stdout)
    assert not doc["ok"]
    bad = [c for c in doc["checkpoints"] if not c["ok"]]
    assert [(c["tier"], c["step"], c["state"]) for c in bad] == [("local", 2, "CORRUPT")]
    assert bad[0]["path"] == lt.step_path("alice", "run", 2)
    assert "content hash mismatch" in bad[0]["problems"][0]
    # By path, and restricted to the PFS tier: the PFS copy is fine.
    assert ckpt_slurm("verify", lt.step_path("alice", "run", 1), config=cfg).returncode == 0
    assert ckpt_slurm("verify", lt.step_path("alice", "run", 2), config=cfg).returncode == 1
    assert (
        ckpt_slurm("verify", "run", "--user", "alice", "--tier", "pfs", config=cfg).returncode == 0
    )


@pytest.mark.parametrize(
    "args,code,needle",
    [
        (["verify", "nosuchkey", "--user", "alice"], 1, "no committed checkpoint"),
        (["list", "../etc", "--user", "alice"], 2, "invalid"),
        (["verify", "run", "--user", "bad/user"], 2, "invalid user"),
        (["verify", "/tmp/not-a-step"], 1, "no such file or directory"),
        (["list", "run", "--user", "alice", "--tier", "cold"], 2, "not configured"),
    ],
)
def test_bad_input_one_line(site, args, code, needle) -> None:
    cfg, _, _ = site
    r = ckpt_slurm(*args, config=cfg)
    assert r.returncode == code, (r.stdout, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert needle in r.stderr


def test_missing_config_is_one_line(tmp_path: Path) -> None:
    r = ckpt_slurm("list", "run", config=tmp_path / "absent.toml")
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "absent.toml" in r.stderr
