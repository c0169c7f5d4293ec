"""Round 2, finding 4: every failure a user causes is that user's.

Each cause is built for real by the attacker, on their own things, and root runs the
real epilog and stager over it. Once, each of these drained the node through the whole
retry schedule (about 900 s at the defaults), and a new checkpoint started a new one;
``chmod 500`` on one's PFS directory drained every node where any of one's jobs ended:

* ``chmod 000`` on one's own payload file;
* ``chmod 500`` on one's own PFS user directory, or on one's PFS key directory;
* SIGKILL of root's flush child (it runs as the owner) from a process of the owner's.

Now the checkpoint is held (``FAILED`` with a ``hold``), retried after its backoff,
reported (an event, the node status ``status`` shows), and the node is not drained; the
other user's checkpoint in the same pass is flushed. A real fault (the PFS full) keeps
today's drain and backoff: ``test_self_drain.test_a_real_failure_...``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any, Callable, Dict

import pytest

from slurm_ckpt.core.layout import step_dirname
from slurm_ckpt.hooks.epilog import run_epilog
from slurm_ckpt.hooks.stager import stager_pass
from slurm_ckpt.ledger import State
from slurm_ckpt.ledger.events import EventLog, read_events
from slurm_ckpt.ledger.node_status import read_node_statuses

from .conftest import ATTACKER, NODE, VICTIM, Recorder, Site, as_user, cli, ids, save, steps


def _payload_000(cfg: Any) -> Callable[[], None]:
    def make() -> None:
        sdir = os.path.join(str(cfg.tiers.local.root), ATTACKER, "evil", step_dirname(1))
        os.chmod(os.path.join(sdir, "model.bin"), 0)

    return make


def _pfs_user_dir_500(cfg: Any) -> Callable[[], None]:
    def make() -> None:
        d = os.path.join(str(cfg.tiers.pfs.root), ATTACKER)
        os.mkdir(d, 0o700)
        os.chmod(d, 0o500)

    return make


def _pfs_key_dir_500(cfg: Any) -> Callable[[], None]:
    def make() -> None:
        d = os.path.join(str(cfg.tiers.pfs.root), ATTACKER, "evil")
        os.makedirs(d, 0o700)
        os.chmod(d, 0o500)

    return make


TRIGGERS: Dict[str, Any] = {
    "payload-000": (_payload_000, "permission"),
    "pfs-user-dir-500": (_pfs_user_dir_500, "permission"),
    "pfs-key-dir-500": (_pfs_key_dir_500, "permission"),
}


class Killer:
    """A process of the attacker's that SIGKILLs every other process of theirs as soon as
    it appears - root's children running as the attacker included - but the first
    ``skip`` (the scan child): what a job still on the node can do. A context manager."""

    def __init__(self, skip: int = 1) -> None:
        self.uid, self.gid = ids(ATTACKER).uid, ids(ATTACKER).gid
        self.skip = skip
        self.pid = 0

    def __enter__(self) -> Killer:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the attacker
            try:
                os.setgroups([])
                os.setresgid(self.gid, self.gid, self.gid)
                os.setresuid(self.uid, self.uid, self.uid)
                me = os.getpid()
                spared: set = set()
                while True:
                    for name in os.listdir("/proc"):
                        if not name.isdigit() or int(name) in (me, *spared):
                            continue
                        try:
                            if os.stat(f"/proc/{name}").st_uid == self.uid:
                                if len(spared) < self.skip:
                                    spared.add(int(name))
                                    continue
                                os.kill(int(name), signal.SIGKILL)
                        except OSError:
                            pass
                    time.sleep(0.002)
            finally:
                os._exit(0)
        self.pid = pid
        return self

    def __exit__(self, *exc: object) -> None:
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)


def _check_held(site: Site, cfg: Any, slurm: Recorder, rep: Any, code: str) -> None:
    assert steps(cfg, "pfs", VICTIM, "good") == [1]  # the other user's flush went on
    [res] = [r for r in rep.flush.results if r.ident == (ATTACKER, "evil", 1)]
    assert res.hold == code, (res, rep.line())
    assert rep.backlog == (0, 0) and not slurm.drained, (rep.line(), slurm.drains)
    rec = site.ledger(cfg).get(ATTACKER, "evil", 1)
    assert rec.state("pfs") is not State.FLUSHING
    assert rec.extra["hold"] == code and rec.extra["retry_at"] > site.ledger(cfg).clock()
    # The stager leaves it to its backoff and resumes a node drained by us.
    slurm.reason = "slurm_ckpt: flushing 2 checkpoints (8.4KiB); see ckpt-slurm status"
    srep = stager_pass(cfg, NODE, slurm)
    assert not srep.flush.results and srep.backlog == 0 and srep.resumed
    events = list(read_events(EventLog.from_config(cfg, NODE).path))
    assert any(e["type"] == "refused" and e.get("user") == ATTACKER for e in events)
    [doc] = read_node_statuses(site.pfs)
    held = [f for f in doc["failed"] if f["user"] == ATTACKER]
    assert held and held[0]["hold"] == code
    r = cli("status", "--json", "--no-slurm", config=site.config_file())
    problems = [p for j in json.loads(r.stdout)["jobs"] for p in j["problems"]]
    assert any(p["hold"] == code for p in problems), r.stdout


@pytest.mark.parametrize("trigger", sorted(TRIGGERS))
def test_users_own_permission_errors_hold_the_checkpoint(site: Site, trigger: str) -> None:
    make, code = TRIGGERS[trigger]
    cfg = site.cfg()
    save(cfg, VICTIM, "good", 1, job="200")
    save(cfg, ATTACKER, "evil", 1, job="100")
    as_user(ATTACKER, make(cfg))
    slurm = Recorder()
    rep = run_epilog(cfg, site.env(ATTACKER, job="100"), slurm)
    _check_held(site, cfg, slurm, rep, code)


def test_sigkill_of_roots_flush_child_by_its_owner_holds_the_checkpoint(site: Site) -> None:
    cfg = site.cfg()
    save(cfg, VICTIM, "good", 1, job="200")
    save(cfg, ATTACKER, "evil", 1, job="100")
    slurm = Recorder()
    with Killer(skip=1):  # the scan child goes free, the flush child is killed
        rep = run_epilog(cfg, site.env(ATTACKER, job="100"), slurm)
    _check_held(site, cfg, slurm, rep, "killed")


def test_a_site_fault_on_the_pfs_root_still_drains(site: Site) -> None:
    """Not the user's: the PFS root does not let users make their directory (an admin's
    mistake). The checkpoint keeps the node drained, as any real fault does."""
    os.chmod(site.pfs, 0o755)
    cfg = site.cfg()
    save(cfg, VICTIM, "run", 1, job="200")
    slurm = Recorder()
    rep = run_epilog(cfg, site.env(VICTIM, job="200"), slurm)
    [res] = rep.flush.results
    assert res.status == "failed" and res.hold is None, res
    assert rep.backlog[0] == 1 and slurm.drained
