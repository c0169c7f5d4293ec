"""Attack 5 (and the manifest part of 10): one user's manifest must not stop root's
work for everyone. A path ``../../x`` in a manifest, a ``wall_time`` of NaN or
Infinity, a ``job`` with a newline and another user's job id: ``gc`` still reclaims
everyone's old checkpoints, ``status`` and ``list`` still list, and nothing the
attacker wrote lands in another user's row or as a line of its own.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from slurm_ckpt.core.manifest import Manifest, manifest_facts
from slurm_ckpt.errors import VerifyError
from slurm_ckpt.tiers.copy import copy_checkpoint
from slurm_ckpt.tiers.registry import tiers_from_config

from .conftest import (
    ATTACKER,
    VICTIM,
    Site,
    as_user,
    cli,
    forged_manifest,
    plant_checkpoint,
    save,
    steps,
)

DATA = b"y" * 64
#: A step old enough for retention (wall_time 2020) next to the newer ones.
OLD = 1.6e9

BAD = {
    "traversal": {"files": [{"path": "../../x", "size": 64, "hash": "0" * 32, "chunks": []}]},
    "nan": {"wall_time": float("nan")},
    "infinity": {"wall_time": float("inf")},
    "overflow": {"wall_time": "__1e400__"},
    "job_newline": {"job": "7\nfake 1 job line"},
    "node_escape": {"node": "n1\x1b[31m"},
    "meta_key": {"meta": {"a\nb": 1}},
}


def _forge(kind: str, step: int) -> bytes:
    fields = dict(BAD[kind])
    man = forged_manifest(ATTACKER, kind.replace("_", "-"), step, DATA, **fields)
    return man.replace(b'"__1e400__"', b"1e400")


def _plant_all(pfs: str) -> None:
    for kind in BAD:
        plant_checkpoint(pfs, ATTACKER, kind.replace("_", "-"), 1, DATA, _forge(kind, 1))


@pytest.mark.parametrize("kind", sorted(BAD))
def test_hostile_manifests_are_refused_by_validation(kind: str) -> None:
    data = _forge(kind, 1)
    with pytest.raises(VerifyError):
        Manifest.from_bytes(data)
    with pytest.raises(VerifyError):
        manifest_facts(data)


def _victim_series(cfg: Any) -> None:
    def write(step: int, wall: float) -> None:
        t = tiers_from_config(cfg)
        copy_checkpoint(t["local"], t["pfs"], VICTIM, "run", step)

    for step in (1, 2, 3):
        save(cfg, VICTIM, "run", step, job="7")
        as_user(VICTIM, write, step, 0.0)


def test_gc_status_list_go_on_for_everyone(site: Site) -> None:
    cfg = site.cfg(retention={"keep_warm": 1, "keep_warm_every": 0})
    conf = site.config_file(retention={"keep_warm": 1, "keep_warm_every": 0})
    _victim_series(cfg)
    # The attacker also claims the victim's job id in a well-formed manifest.
    as_user(ATTACKER, _plant_all, str(site.pfs))
    as_user(
        ATTACKER,
        plant_checkpoint,
        str(site.pfs),
        ATTACKER,
        "claim",
        1,
        DATA,
        forged_manifest(ATTACKER, "claim", 1, DATA, job="7"),
    )
    r = cli("gc", "--json", config=conf, timeout=120)
    assert r.returncode in (0, 1) and "Traceback" not in r.stderr, r.stderr
    doc = json.loads(r.stdout)
    mine = [s for s in doc["series"] if s["user"] == VICTIM]
    assert mine[0]["deleted"] == [1, 2]  # everyone's old checkpoints still reclaimed
    assert steps(cfg, "pfs", VICTIM, "run") == [3]
    bad = {s["key"] for s in doc["series"] if s["user"] == ATTACKER and s["damaged"]}
    assert {k.replace("_", "-") for k in BAD} <= bad  # reported, not fatal
    r = cli("status", "--no-slurm", config=conf, timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "fake 1 job line" not in r.stdout and "\x1b[31m" not in r.stdout
    r = cli("status", "--json", "--no-slurm", config=conf, timeout=120)
    jobs = json.loads(r.stdout)["jobs"]
    seven = [j for j in jobs if j["job"] == "7"]
    # The victim's job row holds only the victim's series; the claim is the attacker's.
    assert {(j["user"], tuple(j["keys"])) for j in seven} == {
        (VICTIM, ("run",)),
        (ATTACKER, ("claim",)),
    }
    r = cli("list", "--json", config=conf, timeout=120)
    assert "Traceback" not in r.stderr and VICTIM in r.stdout


def test_retention_survives_nan_wall_time_in_the_ledger_path(site: Site) -> None:
    """gc in-process, one user's NaN next to another's series: the victim is planned."""
    from slurm_ckpt.ops.gc import run_gc

    cfg = site.cfg(retention={"keep_warm": 1, "keep_warm_every": "1h"})
    _victim_series(cfg)
    as_user(ATTACKER, _plant_all, str(site.pfs))
    report = run_gc(cfg)
    mine = [s for s in report.series if s.user == VICTIM]
    assert mine and mine[0].deleted and not mine[0].errors
