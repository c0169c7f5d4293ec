"""Attack 8: squatting. On a PFS root every user may write (1777), the attacker creates
``<pfs>/ckptuser1`` before the victim ever flushes, and plants a checkpoint there that
says ``user: ckptuser1``.

* Root refuses the directory (the victim's checkpoint is held, never drained for),
  and tells the admin: an event, ``ckpt-slurm status``, ``ckpt-slurm doctor``, each with
  the fix.
* The victim's own job refuses it too: it never restores the planted checkpoint, and
  never writes into a directory the attacker could read or replace.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

from slurm_ckpt.core.trust import Squatted
from slurm_ckpt.hooks.epilog import run_epilog
from slurm_ckpt.hooks.stager import stager_pass
from slurm_ckpt.ledger.events import EventLog, read_events
from slurm_ckpt.ledger.node_status import read_node_statuses
from slurm_ckpt.ops.doctor import Finding, run_doctor
from slurm_ckpt.tiers.posix import PosixTier

from .conftest import ATTACKER, NODE, VICTIM, Recorder, Site, as_user, cli, ids, save, steps


def _squat(pfs: str) -> None:
    os.mkdir(os.path.join(pfs, VICTIM), 0o777)
    os.chmod(os.path.join(pfs, VICTIM), 0o777)


def test_root_refuses_a_squatted_directory_and_tells_the_admin(site: Site) -> None:
    cfg = site.cfg()
    save(cfg, VICTIM, "run", 1, job="100")
    save(cfg, ATTACKER, "own", 1, job="100")
    as_user(ATTACKER, _squat, str(site.pfs))
    slurm = Recorder()
    rep = run_epilog(cfg, site.env(VICTIM), slurm)
    assert steps(cfg, "pfs", VICTIM, "run") == []  # nothing written into their directory
    assert os.listdir(site.pfs / VICTIM) == []
    assert steps(cfg, "pfs", ATTACKER, "own") == [1]  # everyone else goes on
    assert rep.backlog == (0, 0) and not slurm.drained  # another user's doing: no drain
    [res] = [r for r in rep.flush.results if r.ident == (VICTIM, "run", 1)]
    assert res.hold == "squatted" and "squatted" in (res.error or "")
    # The admin hears of it, with the fix: event, node status, status, doctor.
    events = [e for e in read_events(EventLog.from_config(cfg, NODE).path)]
    ev = [e for e in events if e["type"] == "refused" and e.get("reason") == "squatted"]
    assert ev and "fix" in ev[0]["error"] and f"owned by {ATTACKER}" in ev[0]["error"]
    [doc] = read_node_statuses(site.pfs)
    assert doc["extra"]["refused"][0]["user"] == VICTIM
    r = cli("status", "--json", "--no-slurm", config=site.config_file())
    squatted = json.loads(r.stdout)["squatted"]
    assert squatted == [
        {"user": VICTIM, "owner_uid": ids(ATTACKER).uid, "path": str(site.pfs / VICTIM)}
    ]
    r = cli("status", "--no-slurm", config=site.config_file())
    assert "squatted" in r.stderr and "mv " in r.stderr
    report = run_doctor(cfg, None, NODE)
    found = [f for f in report.findings if f.check == "squatted"]
    assert found and found[0].severity == "error" and found[0].fix.startswith("inspect it")
    assert isinstance(found[0], Finding)
    # The admin moves it aside: the next retry (the victim's next epilog) flushes.
    shutil.move(str(site.pfs / VICTIM), str(site.pfs / f"{VICTIM}.squatted"))
    rep = run_epilog(cfg, site.env(VICTIM), slurm)
    assert steps(cfg, "pfs", VICTIM, "run") == [1]
    st = os.lstat(site.pfs / VICTIM)
    assert st.st_uid == ids(VICTIM).uid and st.st_mode & 0o077 == 0
    assert stager_pass(cfg, NODE, slurm).backlog == 0


def _poison(scratch: str, pfs: str) -> None:
    """As the attacker: a real checkpoint of their own (toolkit-written, so it verifies),
    moved into the squatted directory with its manifest rewritten to say ckptuser1."""
    from slurm_ckpt import Checkpointer
    from slurm_ckpt.core import manifest as manifest_mod

    for d in ("l", "p"):
        os.makedirs(os.path.join(scratch, d), exist_ok=True)
    ck = Checkpointer(
        local=os.path.join(scratch, "l"),
        warm=os.path.join(scratch, "p"),
        key="run",
        install_signals=False,
        end_time_fn=None,
    )
    ck.save({"blob": b"POISON", "loader": {"epoch": 666}}, step=5)
    ck.close()
    src = os.path.join(scratch, "l", ATTACKER, "run", "step-0000000005")
    dst = os.path.join(pfs, VICTIM, "run", "step-0000000005")
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "manifest.json"), "rb") as fh:
        body = json.loads(fh.read())
    del body["checksum"]
    body["user"] = VICTIM
    body["checksum"] = manifest_mod._checksum(body)
    with open(os.path.join(dst, "manifest.json"), "wb") as fh:
        fh.write(manifest_mod._serialise(body))
    for d in (os.path.join(pfs, VICTIM, "run"), dst):
        os.chmod(d, 0o777)
    for dirpath, dirs, files in os.walk(dst):  # readable by the victim
        for name in dirs:
            os.chmod(os.path.join(dirpath, name), 0o777)
        for name in files:
            os.chmod(os.path.join(dirpath, name), 0o644)


def _victim_job(local: str, pfs: str) -> Any:
    """As the victim: the training job's restore and one save with its flush."""
    from slurm_ckpt import Checkpointer

    ck = Checkpointer(local=local, warm=pfs, key="run", install_signals=False, end_time_fn=None)
    got = ck.restore()
    restored: Optional[Any] = None if got is None else got.state.get("loader")
    ck.save({"blob": b"mine", "loader": {"epoch": 1}}, step=1, preemption=True)  # flushed
    ck.close()
    try:
        PosixTier("pfs", pfs).check_user(VICTIM)
        refused = ""
    except Squatted as exc:
        refused = str(exc)
    return {"restored": restored, "refused": refused}


def test_the_victims_job_refuses_a_squatted_directory(site: Site) -> None:
    scratch = site.base / "attacker-scratch"
    scratch.mkdir(mode=0o700)
    os.chown(scratch, ids(ATTACKER).uid, ids(ATTACKER).gid)
    as_user(ATTACKER, _squat, str(site.pfs))
    as_user(ATTACKER, _poison, str(scratch), str(site.pfs))
    planted = site.pfs / VICTIM / "run" / "step-0000000005"
    assert (planted / "manifest.json").exists()
    save(site.cfg(), VICTIM, "other", 1)  # the victim's local directory, as the prolog makes
    got = as_user(VICTIM, _victim_job, str(site.local), str(site.pfs))
    assert got["restored"] is None  # the planted checkpoint is never loaded
    assert "squatted" in got["refused"] and "owned by" in got["refused"]
    # Nothing of the victim's went into the attacker's directory.
    assert sorted(os.listdir(site.pfs / VICTIM / "run")) == ["step-0000000005"]
    assert Path(site.local / VICTIM / "run" / "step-0000000001").is_dir()  # saved locally
