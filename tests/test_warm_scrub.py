"""A damaged warm copy is flushed again (issue 28, item 2).

A PFS copy verified when it was flushed can rot afterwards. The real epilog and stager,
as root over real users' checkpoints (tmpfs local tier, a mode-1777 PFS directory): the
epilog reads back the PFS copies of what the node holds, uncommits a damaged one there
(its manifest moved aside: nothing lists or restores it any more), and flushes the good
local copy again; a node whose copy was uncommitted by someone else learns it from the
warm tier at its next pass and flushes its own; ``ckpt-slurm verify``, run by the
copy's owner or root, uncommits a damaged warm copy the same way (anyone else gets the
report only), and so does a job's restore that meets one (on another node too).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Tuple

import pytest
import test_hooks
from test_hooks import REPO, Area, ids, local_steps, pfs_steps, save

from slurm_ckpt.core.manifest import DAMAGED_MANIFEST_NAME, MANIFEST_NAME
from slurm_ckpt.hooks.epilog import run_epilog
from slurm_ckpt.hooks.prolog import ensure_user_dir
from slurm_ckpt.hooks.stager import stager_pass
from slurm_ckpt.ledger import State
from slurm_ckpt.node.asuser import run_as_user
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


# --------------------------------------------------------------------------- verify


def _config_file(area: Area) -> Path:
    path = area.base / "site.toml"
    path.write_text(
        f'[tiers.local]\nroot = "{area.local}"\nmin_free = 0\n'
        f'[tiers.pfs]\nkind = "posix"\nroot = "{area.pfs}"\n[copy]\nchunk_size = "1MiB"\n'
    )
    os.chmod(path, 0o644)
    return path


def _cli(area: Area, user: str, *args: str) -> subprocess.CompletedProcess:
    """``ckpt-slurm ARGS`` as ``user`` (root: as is), with the area's config."""
    env = {
        "HOME": str(area.base),
        "PATH": os.path.dirname(sys.executable) + ":/usr/bin:/bin",
        "PYTHONPATH": str(REPO),
        "LANG": "C.UTF-8",
        "COLUMNS": "200",
        "SLURM_CKPT_CONFIG": str(_config_file(area)),
    }
    argv = [sys.executable, "-m", "slurm_ckpt.cli.main", *args]
    if user != "root":
        argv = (
            ["runuser", "-u", user, "--", "env", "-i"] + [f"{k}={v}" for k, v in env.items()] + argv
        )
    return subprocess.run(
        argv,
        env=env if user == "root" else None,  # a user's: only what `env -i` sets
        cwd=str(area.base),
        capture_output=True,
        text=True,
        timeout=120,
    )


def _flushed_then_damaged(area: Area) -> Tuple[Any, bytes, bytes]:
    """Steps 1 and 2 flushed by the epilog, then a bit of step 2's warm copy flips: the
    config, step 2's good manifest and its payload's good bytes."""
    cfg = area.cfg(retention={"keep_local": 2})
    for step in (1, 2):
        save(cfg, USER, KEY, step)
    rep = run_epilog(cfg, area.env(USER))
    assert len(rep.flush.flushed) == 2 and pfs_steps(cfg, USER, KEY) == [1, 2]
    pfs = tiers_from_config(cfg)["pfs"]
    good = pfs.manifest_bytes(USER, KEY, 2)
    payload = (_step_dir(area, 2) / "model.bin").read_bytes()
    _flip(_step_dir(area, 2) / "model.bin")
    return cfg, good, payload


def _restored(area: Area, tag: str) -> Tuple[int, bytes]:
    """``ckpt-slurm restore`` from the warm tier as the owner: (step, its model.bin)."""
    to = area.base / f"restored-{tag}"
    to.mkdir()
    shutil.chown(to, USER, USER)
    r = _cli(area, USER, "restore", KEY, "--tier", "warm", "--to", str(to), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    step = json.loads(r.stdout)["step"]
    return step, (to / USER / KEY / f"step-{step:010d}" / "model.bin").read_bytes()


@pytest.mark.parametrize("who", [USER, "root"])
def test_verify_by_the_owner_or_root_uncommits_a_damaged_warm_copy(area: Area, who: str) -> None:
    """Issue 28: ``verify`` that finds a damaged warm copy takes it out of use, as the
    scrub does; the node holding the good copy flushes it again at its next pass, and a
    restore takes a good copy all along (step 1 until then, the good step 2 after)."""
    cfg, good, payload = _flushed_then_damaged(area)
    r = _cli(area, who, "verify", KEY, "-u", USER, "--tier", "warm", "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    rows = {row["step"]: row for row in json.loads(r.stdout)["checkpoints"]}
    assert rows[1]["ok"] and "uncommitted" not in rows[1]
    assert rows[2]["state"] == "CORRUPT" and rows[2]["uncommitted"] is True, rows[2]
    assert "nodes still holding the checkpoint flush it again" in rows[2]["problems"][-1]
    step_dir = _step_dir(area, 2)
    assert (step_dir / DAMAGED_MANIFEST_NAME).read_bytes() == good
    assert not (step_dir / MANIFEST_NAME).exists()
    assert pfs_steps(cfg, USER, KEY) == [1]
    assert _restored(area, "before")[0] == 1  # the damaged copy is never restored
    # The node's ledger still believes step 2 is safe; its next pass learns otherwise.
    assert NodeWork(cfg, "n1").ledger.get(USER, KEY, 2).state("pfs") is State.VERIFIED
    srep = stager_pass(cfg, "n1")
    assert [r.ident for r in srep.flush.results if r.status == "flushed"] == [(USER, KEY, 2)]
    assert srep.backlog == 0
    pfs = tiers_from_config(cfg)["pfs"]
    assert pfs.manifest_bytes(USER, KEY, 2) == good and pfs.verify(USER, KEY, 2).ok
    assert NodeWork(cfg, "n1").ledger.get(USER, KEY, 2).state("pfs") is State.VERIFIED
    assert _restored(area, "after") == (2, payload)
    # Verified again: nothing left to do.
    r = _cli(area, who, "verify", KEY, "-u", USER, "--tier", "warm")
    assert r.returncode == 0, r.stdout + r.stderr


def test_verify_by_another_user_only_reports_the_damage(area: Area) -> None:
    """Someone who may read a warm copy but does not own it hears it is damaged; nothing
    of it changes (and a human reader is told why)."""
    cfg, good, _payload = _flushed_then_damaged(area)
    for d in (area.pfs / USER, area.pfs / USER / KEY, _step_dir(area, 1), _step_dir(area, 2)):
        os.chmod(d, 0o755)  # readable by others: their choice
    for p in (*_step_dir(area, 1).rglob("*"), *_step_dir(area, 2).rglob("*")):
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    r = _cli(area, "ckptuser2", "verify", KEY, "-u", USER, "--tier", "warm")
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"not uncommitted: only {USER} or root may take it out of use" in r.stdout
    assert (_step_dir(area, 2) / MANIFEST_NAME).read_bytes() == good
    assert pfs_steps(cfg, USER, KEY) == [1, 2]


def test_roots_verify_never_follows_a_link_planted_in_a_warm_copy(area: Area) -> None:
    """A payload file of the warm copy replaced by a symlink to a file only root may read:
    root's verify reads nothing through it, the check as the owner finds the copy damaged
    and uncommits it; the link's target is untouched."""
    cfg, good, _payload = _flushed_then_damaged(area)
    secret = area.base / "root-secret"
    secret.write_bytes(b"TOP-SECRET-ROOT-DATA")
    os.chmod(secret, 0o600)
    victim = _step_dir(area, 1) / "model.bin"
    victim.unlink()
    os.symlink(secret, victim)
    os.lchown(victim, ids(USER).uid, ids(USER).gid)
    r = _cli(area, "root", "verify", KEY, "-u", USER, "--tier", "warm", "-s", "1", "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "TOP-SECRET" not in r.stdout + r.stderr
    (row,) = json.loads(r.stdout)["checkpoints"]
    assert row["state"] == "CORRUPT" and row["uncommitted"] is True, row
    assert (_step_dir(area, 1) / DAMAGED_MANIFEST_NAME).exists()
    assert secret.read_bytes() == b"TOP-SECRET-ROOT-DATA" and os.stat(secret).st_uid == 0
    assert victim.is_symlink()


# --------------------------------------------------------------------------- restore


def _ckpt_state(step: int) -> Any:
    import numpy as np

    return {"w": np.full(2048, step, dtype=np.float32), "step": step}


def _checkpointer(local: Path, pfs: Path, node: str, **kw: Any) -> Any:
    from slurm_ckpt import Checkpointer

    return Checkpointer(
        local=local,
        warm=pfs,
        key=KEY,
        node=node,
        job="100",
        install_signals=False,
        end_time_fn=None,
        **kw,
    )


def test_a_copy_a_restore_on_another_node_found_damaged_is_flushed_again(area: Area) -> None:
    """Issue 28: a warm copy found damaged *by a restore* is uncommitted there like one
    found by ``verify`` or the scrub, so that the node still holding the good copy flushes
    it again. Node n1 saved steps 1-2 and its epilog flushed them; the PFS copy of 2
    rots; the job restarts on n2 (an empty local tier), whose restore falls back to step
    1 and takes the rotten copy out of use. n1's next stager pass must then flush its
    good step 2 again (a copy merely deleted by the restore looks like one the warm
    tier's retention removed, which a node must not undo: step 2 would stay lost)."""
    cfg = area.cfg(retention={"keep_local": 2})
    ensure_user_dir(str(area.local), ids(USER))

    def train_on_n1() -> int:
        c = _checkpointer(area.local, area.pfs, "n1", flush_every=1000)
        try:
            for step in (1, 2):
                c.save(_ckpt_state(step), step=step)
                assert c.wait(flush=False)
        finally:
            c.close()
        return 2

    run_as_user(USER, train_on_n1)
    rep = run_epilog(cfg, area.env(USER))
    assert pfs_steps(cfg, USER, KEY) == [1, 2], rep.line()
    for step in (1, 2):
        assert NodeWork(cfg, "n1").ledger.get(USER, KEY, step).state("pfs") is State.VERIFIED
    pfs = tiers_from_config(cfg)["pfs"]
    good = pfs.manifest_bytes(USER, KEY, 2)
    files = [p for p in _step_dir(area, 2).rglob("*") if p.is_file() and p.name != MANIFEST_NAME]
    victim = max(files, key=lambda p: p.stat().st_size)  # the payload
    _flip(victim)
    assert not pfs.verify(USER, KEY, 2).ok
    n2 = area.base / "n2-local"
    n2.mkdir()
    shutil.chown(n2, USER, USER)

    def restore_on_n2() -> int:
        c = _checkpointer(n2, area.pfs, "n2")
        try:
            got = c.restore()
            assert got is not None
            return int(got.step)
        finally:
            c.close()

    assert run_as_user(USER, restore_on_n2) == 1  # the rotten step 2 is never restored
    assert pfs_steps(cfg, USER, KEY) == [1]
    # n1's ledger still believes step 2 is safe on the PFS; its next pass learns it is not.
    assert NodeWork(cfg, "n1").ledger.get(USER, KEY, 2).state("pfs") is State.VERIFIED
    srep = stager_pass(cfg, "n1")
    assert [r.ident for r in srep.flush.results if r.status == "flushed"] == [(USER, KEY, 2)], (
        srep.line()
    )
    assert pfs.manifest_bytes(USER, KEY, 2) == good and pfs.verify(USER, KEY, 2).ok
    assert NodeWork(cfg, "n1").ledger.get(USER, KEY, 2).state("pfs") is State.VERIFIED
