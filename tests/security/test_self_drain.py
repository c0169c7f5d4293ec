"""Attack 7: users keeping nodes drained without end. Each trigger the attack found is
built for real: the flush of that user's checkpoint fails *because of that user*, and
then

* the checkpoint is held (``BAD`` when the checkpoint itself is unsafe, else ``FAILED``
  with a ``hold``), retried only after its backoff, reported (an event, the node status
  that ``ckpt-slurm status`` shows), never left ``FLUSHING``;
* the node is not drained (and the stager resumes one that was), and another user's
  checkpoint in the same pass is flushed;
* a drain reason, where there is one, carries counts and sizes only.

Then the backstop for failures nobody caused on purpose (the PFS full): a retry limit
with backoff, after which the checkpoint no longer keeps the node drained; and the
prolog reclaiming a departed user's junk that would otherwise fail every prolog.
"""

from __future__ import annotations

import json
import os
import resource
from typing import Any, Callable, Dict

import pytest

from slurm_ckpt.core.layout import lock_name, step_dirname
from slurm_ckpt.hooks.epilog import run_epilog
from slurm_ckpt.hooks.prolog import run_prolog
from slurm_ckpt.hooks.stager import stager_pass
from slurm_ckpt.ledger import State
from slurm_ckpt.ledger.events import EventLog, read_events
from slurm_ckpt.ledger.node_status import read_node_statuses
from slurm_ckpt.tiers.copy import copy_checkpoint
from slurm_ckpt.tiers.registry import tiers_from_config

from .conftest import (
    ATTACKER,
    NODE,
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


def _own_pfs_dir(cfg: Any, mode: int) -> Callable[[], None]:
    def make() -> None:
        os.mkdir(os.path.join(str(cfg.tiers.pfs.root), ATTACKER), 0o700)
        os.chmod(os.path.join(str(cfg.tiers.pfs.root), ATTACKER), mode)

    return make


def _pfs_dir_symlink(cfg: Any) -> Callable[[], None]:
    def make() -> None:
        pfs = str(cfg.tiers.pfs.root)
        os.mkdir(os.path.join(pfs, f"{ATTACKER}-elsewhere"), 0o700)
        os.symlink(f"{ATTACKER}-elsewhere", os.path.join(pfs, ATTACKER))

    return make


def _lock_symlink(cfg: Any) -> Callable[[], None]:
    def make() -> None:
        kdir = os.path.join(str(cfg.tiers.local.root), ATTACKER, "evil")
        os.symlink("/etc/passwd", os.path.join(kdir, lock_name(1)))

    return make


def _pfs_step_symlink(cfg: Any) -> Callable[[], None]:
    def make() -> None:
        kdir = os.path.join(str(cfg.tiers.pfs.root), ATTACKER, "evil")
        os.makedirs(kdir, mode=0o700)
        os.symlink("/etc", os.path.join(kdir, step_dirname(1)))

    return make


def _lying_manifest(cfg: Any) -> Callable[[], None]:
    def make() -> None:
        local = str(cfg.tiers.local.root)
        data = b"z" * 64
        huge = 2048 * 2**50  # the 2048 PiB of the attack: fallocate would say ENOSPC
        files = [{"path": "w.bin", "size": huge, "hash": "0" * 32, "chunks": ["0" * 32]}]
        man = forged_manifest(ATTACKER, "evil", 1, data, files=files, chunk_size=2**62)
        sdir = os.path.join(local, ATTACKER, "evil", step_dirname(1))
        for name in os.listdir(sdir):
            if name != "manifest.json":
                path = os.path.join(sdir, name)
                if os.path.isdir(path):
                    for sub in os.listdir(path):
                        os.unlink(os.path.join(path, sub))
                    os.rmdir(path)
                else:
                    os.unlink(path)
        plant_checkpoint(local, ATTACKER, "evil", 1, data, man)

    return make


TRIGGERS: Dict[str, Any] = {
    "pfs-dir-777": (lambda cfg: _own_pfs_dir(cfg, 0o777), "unsafe_dir", "writable by others"),
    "pfs-dir-symlink": (_pfs_dir_symlink, "unsafe_dir", "not a directory"),
    "lock-symlink": (_lock_symlink, "unsafe", "symbolic link"),
    "pfs-step-symlink": (_pfs_step_symlink, "unsafe", "symbolic link"),
    "lying-manifest": (_lying_manifest, "unsafe", "the manifest says"),
}


@pytest.mark.parametrize("trigger", sorted(TRIGGERS))
def test_self_inflicted_failures_never_keep_a_node_drained(site: Site, trigger: str) -> None:
    make, code, words = TRIGGERS[trigger]
    cfg = site.cfg()
    save(cfg, VICTIM, "good", 1, job="200")
    save(cfg, ATTACKER, "evil", 1, job="100")
    as_user(ATTACKER, make(cfg))
    slurm = Recorder()
    rep = run_epilog(cfg, site.env(ATTACKER, job="100"), slurm)
    assert steps(cfg, "pfs", VICTIM, "good") == [1]  # the other user's flush went on
    assert rep.backlog == (0, 0) and not slurm.drained, (rep.line(), slurm.drains)
    [res] = [r for r in rep.flush.results if r.ident == (ATTACKER, "evil", 1)]
    assert res.hold == code and words in (res.error or ""), res
    rec = site.ledger(cfg).get(ATTACKER, "evil", 1)
    assert rec.state("pfs") is not State.FLUSHING  # not "in flight" forever
    assert rec.extra["hold"] == code and rec.extra["retry_at"] > site.ledger(cfg).clock()
    # The stager does not retry it before its backoff, and resumes a node drained by us.
    slurm.reason = "slurm_ckpt: flushing 2 checkpoints (8.4KiB); see ckpt-slurm status"
    srep = stager_pass(cfg, NODE, slurm)
    assert not srep.flush.results and srep.backlog == 0 and srep.resumed
    # Told: an event in the node's log, and the node status ckpt-slurm status reads.
    events = list(read_events(EventLog.from_config(cfg, NODE).path))
    assert any(e["type"] == "refused" and e.get("user") == ATTACKER for e in events)
    [doc] = read_node_statuses(site.pfs)
    held = [f for f in doc["failed"] if f["user"] == ATTACKER]
    assert held and held[0]["hold"] == code
    r = cli("status", "--json", "--no-slurm", config=site.config_file())
    problems = [p for j in json.loads(r.stdout)["jobs"] for p in j["problems"]]
    assert any(p["hold"] == code for p in problems), r.stdout
    assert all("PiB" not in d for d in slurm.drains)


def test_more_files_than_half_of_nofile_are_copied_in_batches(site: Site) -> None:
    cfg = site.cfg()
    save(cfg, ATTACKER, "many", 1, job="100", files=400)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # inherited by root's children
    try:
        rep = run_epilog(cfg, site.env(ATTACKER, job="100"), Recorder())
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert rep.flush.flushed == [(ATTACKER, "many", 1)], rep.line()
    assert tiers_from_config(cfg)["pfs"].verify(ATTACKER, "many", 1).ok


def test_a_real_failure_stops_draining_after_the_retry_limit(site: Site) -> None:
    """Nobody's doing: the PFS is full. Retried with backoff; after max_retries the
    checkpoint no longer keeps the node drained (still owed, still reported)."""
    site.pfs = site.mounts.tmpfs("2m", "pfs-small")
    os.chmod(site.pfs, 0o1777)
    cfg = site.cfg(hooks={"retry_backoff": "1ms", "max_retries": 2})
    save(cfg, VICTIM, "run", 1, nbytes=1_500_000)
    filler = site.pfs / "filler"
    filler.write_bytes(b"\0" * 1_200_000)
    slurm = Recorder()
    rep = run_epilog(cfg, site.env(VICTIM), slurm)
    assert rep.flush.failed and rep.backlog[0] == 1 and slurm.drained  # a real backlog
    assert "no space" not in slurm.reason  # counts and sizes only
    srep = stager_pass(cfg, NODE, slurm)  # second failure: the limit
    assert srep.flush.failed and srep.backlog == 0 and srep.resumed and not slurm.drained
    rec = site.ledger(cfg).get(VICTIM, "run", 1)
    assert rec.extra["gave_up"] and rec.pending_flush  # still owed: maint/guard see it
    filler.unlink()
    srep = stager_pass(cfg, NODE, slurm)  # retried (backoff over): the PFS has room
    assert steps(cfg, "pfs", VICTIM, "run") == [1] and srep.backlog == 0


def test_prolog_reclaims_a_departed_users_junk(site: Site) -> None:
    site.local = site.mounts.tmpfs("32m", "local-small")
    cfg = site.cfg(local={"min_free": "12MiB"})
    save(cfg, ATTACKER, "kept", 1, job="100")  # owed to the PFS: must survive
    save(cfg, ATTACKER, "flushed", 1, job="100")

    def flush_one() -> None:
        t = tiers_from_config(cfg)
        copy_checkpoint(t["local"], t["pfs"], ATTACKER, "flushed", 1)

    as_user(ATTACKER, flush_one)

    def junk(local: str) -> None:
        d = os.path.join(local, ATTACKER, "not-a-checkpoint")
        os.mkdir(d)
        for i in range(20):
            with open(os.path.join(d, f"junk{i}"), "wb") as fh:
                fh.write(b"j" * 2**20)

    as_user(ATTACKER, junk, str(site.local))
    # The attacker's job is gone; the victim's job 300 comes next.
    slurm = Recorder(jobs=[("300", VICTIM)])
    rep = run_prolog(cfg, site.env(VICTIM, job="300"), slurm)
    assert rep.reclaimed and "reclaimed" in rep.line()
    assert not (site.local / ATTACKER / "not-a-checkpoint").exists()
    assert steps(cfg, "local", ATTACKER, "kept") == [1]  # not safe on the PFS: kept
    assert tiers_from_config(cfg)["local"].verify(ATTACKER, "kept", 1).ok
    # Without SLURM saying who has a job here, nobody counts as departed.
    as_user(ATTACKER, junk, str(site.local))
    with pytest.raises(Exception, match="free, need"):
        run_prolog(cfg, site.env(VICTIM, job="301"), None)
    assert (site.local / ATTACKER / "not-a-checkpoint").exists()
