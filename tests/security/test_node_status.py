"""Attack 1: forged and symlinked node status must not let ``maint`` reboot a node that
holds unflushed checkpoints, nor make ``status`` or ``guard`` lie.

The attacker gets to ``<pfs>/.slurm_ckpt/nodes/`` first, or plants a symlink at
``<pfs>/.slurm_ckpt``, and writes a node status that says ``pending: 0`` (fresh time,
the right node name). Root's hooks must move such a directory aside, write their own,
and every reader must trust only root's files.
"""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from slurm_ckpt.errors import NotReady
from slurm_ckpt.hooks.stager import stager_pass
from slurm_ckpt.job.bookkeeping import Bookkeeper
from slurm_ckpt.ledger.node_status import read_node_statuses
from slurm_ckpt.ops import maint as maint_mod

from .conftest import ATTACKER, NODE, VICTIM, Recorder, Site, as_user, cli, ids, save

FORGED = {
    "format": "slurm_ckpt.node_status",
    "version": 1,
    "node": NODE,
    "time": time.time() + 3600,
    "pending": {"count": 0, "bytes": 0},
    "jobs": {},
}


def _forge_nodes_dir(pfs: str) -> None:
    """As the attacker: make <pfs>/.slurm_ckpt/nodes first and put a lie in it."""
    nodes = os.path.join(pfs, ".slurm_ckpt", "nodes")
    os.makedirs(nodes, mode=0o777)
    os.chmod(os.path.join(pfs, ".slurm_ckpt"), 0o777)
    os.chmod(nodes, 0o777)
    with open(os.path.join(nodes, f"{NODE}.json"), "w") as fh:
        json.dump(FORGED, fh)


def _owed_checkpoint(site: Site) -> Any:
    """The victim's checkpoint, still owed to the PFS: its job runs on, so the stager
    leaves it to the job, and publishes that the node owes it."""
    cfg = site.cfg()
    save(cfg, VICTIM, "run", 1)
    slurm = Recorder(jobs=[("100", VICTIM)])
    rep = stager_pass(cfg, NODE, slurm)
    assert rep.backlog == 0 and not rep.flush.results  # left to its running job
    return cfg


class _Slurm(Recorder):
    """maint's view of SLURM: no job left on the node (the attacker ended theirs)."""

    def __init__(self) -> None:
        super().__init__()
        self.cli = self
        self.ran: list = []

    def run(self, argv: list) -> str:  # the reboot maint would run
        self.ran.append(argv)
        return ""

    def signal(self, *a: Any, **k: Any) -> None:
        pass


def test_forged_status_directory_is_moved_aside_and_maint_refuses(
    site: Site, monkeypatch: pytest.MonkeyPatch
) -> None:
    as_user(ATTACKER, _forge_nodes_dir, str(site.pfs))
    cfg = _owed_checkpoint(site)
    # Root's publication moved the attacker's directory aside, never wrote into it.
    meta = site.pfs / ".slurm_ckpt"
    st = os.lstat(meta)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o755
    aside = [n for n in os.listdir(site.pfs) if n.startswith(".slurm_ckpt.untrusted-")]
    assert len(aside) == 1
    forged = site.pfs / aside[0] / "nodes" / f"{NODE}.json"
    assert json.loads(forged.read_text())["pending"]["count"] == 0  # untouched, unused
    assert forged.stat().st_uid == ids(ATTACKER).uid
    docs = read_node_statuses(site.pfs)
    assert [d["node"] for d in docs] == [NODE] and docs[0]["pending"]["count"] == 1
    # maint: no job left, but the node still owes a checkpoint: no reboot.
    slurm = _Slurm()
    monkeypatch.setattr(maint_mod, "client_factory", lambda: slurm)
    with pytest.raises(NotReady, match="1 checkpoint"):
        maint_mod.run_maint(
            cfg,
            [NODE],
            "firmware",
            ("slurm", ["scontrol", "reboot", NODE]),
            signal_jobs=False,
            timeout=1.0,
            poll=0.2,
            say=lambda _s: None,
        )
    assert slurm.ran == []
    # guard on the node: the node's own ledger says 1 owed.
    with pytest.raises(NotReady):
        maint_mod.guard(cfg, NODE, 0.0, 0.1)
    # status (root, CLI): 1 pending on the node.
    r = cli("status", "--json", "--no-slurm", config=site.config_file())
    assert r.returncode == 0, r.stderr
    node = json.loads(r.stdout)["nodes"][0]
    assert node["node"] == NODE and node["pending_checkpoints"] == 1


def test_status_planted_by_a_user_in_roots_directory_is_ignored(site: Site) -> None:
    cfg = _owed_checkpoint(site)
    nodes = site.pfs / ".slurm_ckpt" / "nodes"
    # A status file of another owner in root's directory (left from an insecure past,
    # or linked in): readers take root's files only.
    fake = nodes / "n2.json"
    fake.write_text(json.dumps(dict(FORGED, node="n2")))
    os.chown(fake, ids(ATTACKER).uid, -1)
    problems: list = []
    docs = read_node_statuses(site.pfs, problems)
    assert [d["node"] for d in docs] == [NODE]
    assert any("n2.json" in p and "owned by uid" in p for p in problems)
    # A hard link to root's own status under another node's name is refused too.
    os.unlink(fake)
    os.link(nodes / f"{NODE}.json", nodes / "n3.json")
    assert read_node_statuses(site.pfs) == []  # both names of a linked file: refused
    stager_pass(cfg, NODE, Recorder(jobs=[("100", VICTIM)]))  # root republishes
    assert [d["node"] for d in read_node_statuses(site.pfs)] == [NODE]


def test_symlinked_meta_directory_is_never_followed(site: Site) -> None:
    def plant(pfs: str) -> str:
        mine = os.path.join(pfs, ATTACKER, "fake-meta")
        os.makedirs(os.path.join(mine, "nodes"))
        with open(os.path.join(mine, "nodes", f"{NODE}.json"), "w") as fh:
            json.dump(FORGED, fh)
        os.symlink(mine, os.path.join(pfs, ".slurm_ckpt"))
        return mine

    mine = Path(as_user(ATTACKER, plant, str(site.pfs)))
    before = sorted(os.listdir(mine / "nodes"))
    # Readers do not follow it either: nothing is trusted through a symlink.
    problems: list = []
    assert read_node_statuses(site.pfs, problems) == [] and problems
    _owed_checkpoint(site)
    assert sorted(os.listdir(mine / "nodes")) == before  # root wrote nothing there
    assert not (site.pfs / ".slurm_ckpt").is_symlink()
    docs = read_node_statuses(site.pfs)
    assert [d["pending"]["count"] for d in docs] == [1]


def test_the_job_publishes_its_own_status_never_the_nodes(site: Site) -> None:
    cfg = site.cfg()
    save(cfg, VICTIM, "run", 1)

    def job_publishes(pfs: str) -> None:
        books = Bookkeeper(cfg, VICTIM, "run", "100", NODE)
        books.publish(pfs)

    as_user(VICTIM, job_publishes, str(site.pfs))
    assert not (site.pfs / ".slurm_ckpt").exists()  # the node's: root's alone
    own = site.pfs / VICTIM / ".slurm_ckpt" / "nodes" / f"{NODE}.json"
    assert own.stat().st_uid == ids(VICTIM).uid
    assert json.loads(own.read_text())["user"] == VICTIM
    assert read_node_statuses(site.pfs) == []
