"""Aging as root on the real SeaweedFS: the EBADF of root's copy children, and finding 3
of the second round (forged object-store manifests made root's ``gc`` drop another
user's only PFS copies).

* ``pfs -> object -> cold``: root runs the real ``ckpt-slurm gc``; every copy child
  becomes the owner. Before the fix each one died with ``OSError: [Errno 9] Bad file
  descriptor``, so nothing ever reached the object tier by aging.
* A user with bucket keys PUTs forged (checksum-valid) manifests for steps 1 and 2 under
  the victim's prefix. Aging used to count a step as aged when the next tier merely
  *listed* it, so root's gc dropped the victim's PFS steps 1 and 2. Now a step counts as
  aged only when the next tier's manifest bytes equal the source's and, before the
  source's copy may go, that copy verifies there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from slurm_ckpt.core.layout import step_dirname
from slurm_ckpt.tiers.registry import tiers_from_config

from .conftest import ATTACKER, VICTIM, as_user, forged_manifest, save
from .object_site import ObjectSite, osite_fixture  # noqa: F401 - the fixture

pytestmark = pytest.mark.root


def _cold(osite: ObjectSite) -> Path:
    cold = osite.site.pfs / "cold-root"
    cold.mkdir()
    os.chmod(cold, 0o1777)
    return cold


def _sections(osite: ObjectSite, cold: Optional[Path] = None) -> Dict[str, Any]:
    """PFS (the warm tier), object store and, with ``cold``, a cold tier; every step
    ages on (``every`` 0, or a microsecond for the cold tier); the PFS and the object
    store keep their newest one."""
    out: Dict[str, Any] = {
        "pfs": {"kind": "posix", "root": str(osite.site.pfs / "warm-root")},
        "object": {"every": 0},
        "retention": {"keep_warm": 1, "keep_warm_every": 0},
    }
    (osite.site.pfs / "warm-root").mkdir(exist_ok=True)
    os.chmod(osite.site.pfs / "warm-root", 0o1777)
    if cold is not None:
        out["cold"] = {"kind": "posix", "root": str(cold), "every": 1e-6}
    return out


def _flushed_to_pfs(osite: ObjectSite, conf: Path, steps: List[int]) -> None:
    r = osite.root_cli("flush", "--json", "-w", "n1", config=conf)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(d["step"] for d in json.loads(r.stdout)["flushed"]) == steps, r.stdout


def _steps(cfg: Any, tier: str, user: str = VICTIM, key: str = "run") -> List[int]:
    return [s.step for s in tiers_from_config(cfg)[tier].steps(user, key)]


def test_root_ages_pfs_to_object_to_cold_on_the_real_store(osite: ObjectSite) -> None:
    sections = _sections(osite, _cold(osite))
    cfg, conf = osite.cfg(**sections), osite.config_file(**sections)
    for step in (1, 2, 3):
        save(cfg, VICTIM, "run", step, job="990301")
    _flushed_to_pfs(osite, conf, [1, 2, 3])
    r = osite.root_cli("gc", "--json", config=conf)
    doc = json.loads(r.stdout)
    errors = [e for a in doc["aged"] for e in a["errors"]]
    assert not errors, errors
    assert r.returncode == 0, r.stdout + r.stderr
    aged = {(a["from"], a["to"]): a["copied"] for a in doc["aged"]}
    assert aged == {("pfs", "object"): [1, 2, 3], ("object", "cold"): [1, 2, 3]}, aged
    # Each tier passed on what it owed, verified there, before its retention ran.
    assert _steps(cfg, "cold") == [1, 2, 3]
    assert _steps(cfg, "object") == [3] and _steps(cfg, "pfs") == [3]
    for tier in ("object", "cold"):
        for step in _steps(cfg, tier):
            assert tiers_from_config(cfg)[tier].verify(VICTIM, "run", step).ok
    # The object tier's copies were written by the owner's child, under their prefix.
    objs = osite.objects(f"{osite.prefix}/")
    assert objs and all(k.startswith(f"{osite.prefix}/{VICTIM}/run/") for k in objs), objs


def _forge(s3: Any, bucket: str, prefix: str, steps: List[int]) -> None:
    """As the attacker, with its own bucket keys: checksum-valid manifests of the
    victim's steps under the victim's prefix."""
    c = s3.client()
    for step in steps:
        body = forged_manifest(VICTIM, "run", step, b"forged")
        key = f"{prefix}/{VICTIM}/run/{step_dirname(step)}/manifest.json"
        c.put_object(Bucket=bucket, Key=key, Body=body)


def test_forged_object_manifests_never_make_root_drop_pfs_steps(osite: ObjectSite) -> None:
    sections = _sections(osite)
    cfg, conf = osite.cfg(**sections), osite.config_file(**sections)
    for step in (1, 2, 3):
        save(cfg, VICTIM, "run", step, job="990302")
    _flushed_to_pfs(osite, conf, [1, 2, 3])
    as_user(ATTACKER, _forge, osite.s3, osite.bucket, osite.prefix, [1, 2])
    assert _steps(cfg, "object") == [1, 2]  # what the store lists: the forgeries
    r = osite.root_cli("gc", "--json", config=conf)
    doc = json.loads(r.stdout)
    # The victim's PFS steps 1 and 2 have no real copy anywhere else: kept.
    assert _steps(cfg, "pfs") == [1, 2, 3], r.stdout + r.stderr
    # Step 3 aged for real (identical manifest, verified); 1 and 2 could not be aged
    # over the forgeries, which root says, and which are not the victim's data.
    aged = {(a["from"], a["to"]): a for a in doc["aged"]}
    assert aged[("pfs", "object")]["copied"] == [3]
    assert len(aged[("pfs", "object")]["errors"]) == 2
    pfs = tiers_from_config(cfg)["pfs"]
    obj = tiers_from_config(cfg)["object"]
    assert obj.manifest_bytes(VICTIM, "run", 3) == pfs.manifest_bytes(VICTIM, "run", 3)
