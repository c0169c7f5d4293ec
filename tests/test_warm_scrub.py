"""A damaged warm copy is flushed again (issue 28, item 2).

A PFS copy verified when it was flushed can rot afterwards. The real epilog and stager,
as root over real users' checkpoints (tmpfs local tier, a mode-1777 PFS directory): the
epilog reads back the PFS copies of what the node holds, uncommits a damaged one there
(its manifest moved aside: nothing lists or restores it any more), and flushes the good
local copy again; a node whose copy was uncommitted by someone else learns it from the
warm tier at its next pass and flushes its own.
"""

from __future__ import annotations

import os
from pathlib import Path

import test_hooks
from test_hooks import Area, local_steps, pfs_steps, save

from slurm_ckpt.core.manifest import DAMAGED_MANIFEST_NAME, MANIFEST_NAME
from slurm_ckpt.hooks.epilog import run_epilog
from slurm_ckpt.hooks.stager import stager_pass
from slurm_ckpt.ledger import State
from slurm_ckpt.node.work import NodeWork
from slurm_ckpt.ops.damage import scan_series
from slurm_ckpt.tiers.registry import tiers_from_config

USER, KEY = "ckptuser1", "run"
area = test_hooks.area  # the fixture: real users, a tmpfs local tier, a mode-1777 PFS


def _flip(path: Path, offset: int = 100) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x10]))


def _step_dir(area: Area, step: int) -> Path:
    return area.pfs / USER / KEY / f"step-{step:010d}"


def test_the_epilog_uncommits_a_rotten_pfs_copy_and_flushes_it_again(area: Area) -> None:
    cfg = area.cfg(retention={"keep_local": 2})
    for step in (1, 2):
        save(cfg, USER, KEY, step)
    rep = run_epilog(cfg, area.env(USER))
    assert len(rep.flush.flushed) == 2 and pfs_steps(cfg, USER, KEY) == [1, 2]
    pfs = tiers_from_config(cfg)["pfs"]
    good = pfs.manifest_bytes(USER, KEY, 2)
    _flip(_step_dir(area, 2) / "model.bin")  # bit rot after the copy was verified
    assert not pfs.verify(USER, KEY, 2).ok
    rep = run_epilog(cfg, area.env(USER, job="101"))
    # Found, uncommitted, and the node's good copy flushed again, in this epilog.
    assert [r.ident for r in rep.flush.results if r.status == "flushed"] == [(USER, KEY, 2)]
    assert rep.backlog == (0, 0) and rep.drained is None
    assert pfs_steps(cfg, USER, KEY) == [1, 2]
    assert pfs.manifest_bytes(USER, KEY, 2) == good and pfs.verify(USER, KEY, 2).ok
    assert pfs.verify(USER, KEY, 1).ok and local_steps(cfg, USER, KEY) == [1, 2]
    led = NodeWork(cfg, "n1").ledger
    assert led.get(USER, KEY, 2).state("pfs") is State.VERIFIED


def test_a_copy_uncommitted_elsewhere_is_learnt_and_flushed_by_the_stager(area: Area) -> None:
    cfg = area.cfg(retention={"keep_local": 2})
    save(cfg, USER, KEY, 1)
    run_epilog(cfg, area.env(USER))
    pfs = tiers_from_config(cfg)["pfs"]
    good = pfs.manifest_bytes(USER, KEY, 1)
    # Another node (or a restore, or verify) found this warm copy damaged and uncommitted
    # it: its manifest moved aside, as PosixTier.uncommit does.
    _flip(_step_dir(area, 1) / "model.bin")
    os.rename(_step_dir(area, 1) / MANIFEST_NAME, _step_dir(area, 1) / DAMAGED_MANIFEST_NAME)
    assert (_step_dir(area, 1) / DAMAGED_MANIFEST_NAME).exists()
    assert not (_step_dir(area, 1) / MANIFEST_NAME).exists()
    _good, damaged = scan_series(pfs, USER, KEY)  # what `verify`, `list`, `gc` report
    assert [(d.step, d.state) for d in damaged] == [(1, "CORRUPT")]
    assert "found damaged and uncommitted" in damaged[0].reason
    led = NodeWork(cfg, "n1").ledger
    assert led.get(USER, KEY, 1).state("pfs") is State.VERIFIED  # the ledger's belief
    srep = stager_pass(cfg, "n1")
    assert [r.ident for r in srep.flush.results if r.status == "flushed"] == [(USER, KEY, 1)]
    assert srep.backlog == 0
    assert pfs.manifest_bytes(USER, KEY, 1) == good and pfs.verify(USER, KEY, 1).ok
    assert NodeWork(cfg, "n1").ledger.get(USER, KEY, 1).state("pfs") is State.VERIFIED
    assert not (_step_dir(area, 1) / DAMAGED_MANIFEST_NAME).exists()
    assert [n for n in os.listdir(area.pfs / USER / KEY) if n.startswith(".partial-")] == []


def test_a_copy_the_warm_tiers_retention_deleted_is_not_flushed_again(area: Area) -> None:
    """gc deleted a PFS step the node still holds: the node learns it is gone from the PFS
    (not VERIFIED any more) but does not undo gc by flushing it again."""
    cfg = area.cfg(retention={"keep_local": 2})
    save(cfg, USER, KEY, 1)
    run_epilog(cfg, area.env(USER))
    pfs = tiers_from_config(cfg)["pfs"]
    pfs.delete(USER, KEY, 1)  # as the warm tier's retention does
    srep = stager_pass(cfg, "n1")
    assert srep.flush.results == [] and srep.backlog == 0, srep.line()
    assert pfs_steps(cfg, USER, KEY) == [] and local_steps(cfg, USER, KEY) == [1]
    assert NodeWork(cfg, "n1").ledger.get(USER, KEY, 1).state("pfs") is State.DELETED
