"""Attack 4 (and the hard-link part of 10): FIFOs, sockets and hard links where root
expects checkpoint files. Root's ``gc``, ``verify``, ``status`` and ``list`` must refuse
them at once (non-blocking opens, the type checked before reading, one link, the owner
of the directory) and still do their work for everyone else; the epilog's scan must not
spend its budget on them.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable

from slurm_ckpt.core.layout import step_dirname
from slurm_ckpt.hooks.epilog import run_epilog
from slurm_ckpt.tiers.copy import copy_checkpoint
from slurm_ckpt.tiers.registry import tiers_from_config

from .conftest import (
    ATTACKER,
    SECRET,
    VICTIM,
    Recorder,
    Site,
    as_user,
    cli,
    forged_manifest,
    plant_checkpoint,
    save,
    steps,
)

DATA = b"x" * 100


def _on_pfs(cfg: Any, user: str, key: str, step: int, **kw: Any) -> None:
    """A real checkpoint of ``user`` on the PFS (written locally, copied as the user)."""
    save(cfg, user, key, step, **kw)

    def copy() -> None:
        t = tiers_from_config(cfg)
        copy_checkpoint(t["local"], t["pfs"], user, key, step)
        t["local"].delete(user, key, step)

    as_user(user, copy)


def _plant_fifos(pfs: str) -> None:
    """As the attacker, in their own PFS directory: a FIFO as manifest.json, a FIFO as a
    payload named by a valid manifest, a socket as a payload."""
    sdir = plant_checkpoint(pfs, ATTACKER, "fifo", 1, DATA, b"")
    os.unlink(os.path.join(sdir, "manifest.json"))
    os.mkfifo(os.path.join(sdir, "manifest.json"))
    man = forged_manifest(ATTACKER, "fifo", 2, DATA)
    sdir = plant_checkpoint(pfs, ATTACKER, "fifo", 2, DATA, man)
    os.unlink(os.path.join(sdir, "w.bin"))
    os.mkfifo(os.path.join(sdir, "w.bin"))
    man = forged_manifest(ATTACKER, "fifo", 3, DATA)
    sdir = plant_checkpoint(pfs, ATTACKER, "fifo", 3, DATA, man)
    os.unlink(os.path.join(sdir, "w.bin"))
    s = socket.socket(socket.AF_UNIX)
    s.bind(os.path.join(sdir, "w.bin"))
    s.close()


def test_fifos_never_hang_root_gc_verify_status_list(site: Site) -> None:
    cfg = site.cfg(retention={"keep_warm": 1, "keep_warm_every": 0})
    conf = site.config_file(retention={"keep_warm": 1, "keep_warm_every": 0})
    for step in (1, 2):
        _on_pfs(cfg, VICTIM, "run", step, job="7")
    as_user(ATTACKER, _plant_fifos, str(site.pfs))
    # Each would block forever on a blocking open: cli() fails the test at its timeout.
    r = cli("verify", "fifo", "-u", ATTACKER, "--json", config=conf, timeout=60)
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    text = json.dumps(doc)
    assert "not a regular file" in text
    r = cli("verify", "run", "-u", VICTIM, config=conf, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    r = cli("list", "fifo", "-u", ATTACKER, "--json", config=conf, timeout=60)
    assert r.returncode == 1 and "CORRUPT" in r.stdout
    r = cli("list", "--json", config=conf, timeout=60)
    rows = json.loads(r.stdout)
    assert any(x["user"] == VICTIM and x["key"] == "run" for x in _rows(rows))
    r = cli("status", "--json", "--no-slurm", config=conf, timeout=60)
    assert r.returncode == 0, r.stderr
    jobs = json.loads(r.stdout)["jobs"]
    assert any(j["user"] == VICTIM and j["keys"] == ["run"] for j in jobs)
    # gc: the attacker's FIFOs are reported, the victim's old checkpoint reclaimed.
    r = cli("gc", "--json", config=conf, timeout=60)
    doc = json.loads(r.stdout)
    mine = [s for s in doc["series"] if s["user"] == VICTIM]
    assert mine and mine[0]["deleted"] == [1], r.stdout
    assert steps(cfg, "pfs", VICTIM, "run") == [2]


def _rows(doc: Any) -> list:
    if isinstance(doc, list):
        return doc
    for v in doc.values():
        if isinstance(v, list):
            return v
    return []


def test_hard_links_are_never_read_by_root(site: Site) -> None:
    """fs.protected_hardlinks=0 (some kernels, some filesystems): a user links a root-only
    file into their checkpoint. Root's verify, list and gc must not read it."""
    cfg = site.cfg()
    conf = site.config_file()
    _on_pfs(cfg, ATTACKER, "link", 1)
    target = site.pfs / ATTACKER / "link" / step_dirname(1) / "model.bin"
    leak = site.pfs / "leak"  # the same filesystem, root-only
    leak.write_bytes(SECRET)
    os.chmod(leak, 0o600)
    os.unlink(target)
    os.link(leak, target)  # done by root here: what protected_hardlinks=0 allows users
    r = cli("verify", "link", "-u", ATTACKER, "--json", config=conf, timeout=60)
    assert r.returncode == 1 and "hard links" in r.stdout
    assert SECRET.decode() not in r.stdout + r.stderr
    r = cli("verify", str(target.parent), "--json", config=conf, timeout=60)
    assert r.returncode == 1 and "hard links" in r.stdout
    assert leak.read_bytes() == SECRET and os.stat(leak).st_nlink == 2


def test_epilog_scan_is_not_stalled_by_fifos(site: Site, no_hang: Callable) -> None:
    cfg = site.cfg()
    save(cfg, VICTIM, "run", 1, job="100")
    save(cfg, ATTACKER, "trap", 1, job="200")

    def fifo_manifests(local: str) -> None:
        for step in range(2, 40):
            sdir = Path(local) / ATTACKER / "trap" / step_dirname(step)
            sdir.mkdir()
            os.mkfifo(sdir / "manifest.json")

    as_user(ATTACKER, fifo_manifests, str(site.local))
    slurm = Recorder()
    no_hang(60)
    t0 = time.monotonic()
    rep = run_epilog(cfg, site.env(VICTIM), slurm, budget=20)
    assert time.monotonic() - t0 < 20  # within its budget, not 16 s in a scan
    assert steps(cfg, "pfs", VICTIM, "run") == [1]
    assert steps(cfg, "pfs", ATTACKER, "trap") == [1]  # their real one too
    assert rep.backlog == (0, 0) and not slurm.drained
