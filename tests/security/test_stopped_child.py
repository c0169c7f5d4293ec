"""Attack 2: a user SIGSTOPs root's children that run as them (any process of a user may
signal the user's other processes). The stager, root ``ckpt-slurm flush``, retention and
the scans must kill the stopped child (SIGKILL works on a stopped process), mark that
checkpoint for a later retry, and go on with everyone else: the victim's checkpoint is
flushed, the node is resumed (the attacker's stuck flush is their own doing, it keeps no
node drained), and nothing hangs.
"""

from __future__ import annotations

from typing import Any, Callable

from slurm_ckpt.hooks.stager import stager_pass
from slurm_ckpt.ledger import State
from slurm_ckpt.ledger.events import EventLog, read_events
from slurm_ckpt.node.work import NodeWork
from slurm_ckpt.ops.flush_cmd import flush_node

from .conftest import ATTACKER, NODE, VICTIM, Recorder, Site, Stopper, save, steps


def _both_owe(site: Site, **sections: Any) -> Any:
    cfg = site.cfg(**sections)
    save(cfg, VICTIM, "good", 1, job="200")
    save(cfg, ATTACKER, "evil", 1, job="100")
    save(cfg, ATTACKER, "evil", 2, job="100")
    return cfg


def test_stager_kills_a_stopped_flush_and_goes_on(site: Site, no_hang: Callable) -> None:
    cfg = _both_owe(site)
    slurm = Recorder(reason="slurm_ckpt: flushing 3 checkpoints (12.6KiB)")
    no_hang(120)
    with Stopper(ATTACKER, skip=1):  # the scan child goes free, the flush child is stopped
        rep = stager_pass(cfg, NODE, slurm)
    assert steps(cfg, "pfs", VICTIM, "good") == [1]  # the victim's flush went through
    assert steps(cfg, "pfs", ATTACKER, "evil") == []
    assert rep.backlog == 0 and rep.resumed and not slurm.drained  # not kept drained
    led = site.ledger(cfg)
    for step in (1, 2):  # marked, retried later (after the backoff), never forgotten
        rec = led.get(ATTACKER, "evil", step)
        assert rec.state("pfs") is State.FLUSH_PENDING
        assert rec.extra["hold"] == "stopped" and rec.extra["retry_at"] > led.clock()
    stuck = [r for r in rep.flush.results if r.stuck]
    assert len(stuck) == 1 and "stopped (SIGSTOP)" in (stuck[0].error or "")
    events = list(read_events(EventLog.from_config(cfg, NODE).path))
    assert any(e["type"] == "refused" and e.get("reason") == "stopped" for e in events)
    # Once the attacker stops stopping, the retry (due now) flushes them.
    led.update_many(
        [((ATTACKER, "evil", s), _due) for s in (1, 2)]  # as if the backoff were over
    )
    rep = stager_pass(cfg, NODE, slurm)
    assert steps(cfg, "pfs", ATTACKER, "evil") == [1, 2] and rep.backlog == 0
    assert "hold" not in led.get(ATTACKER, "evil", 1).extra


def _due(rec: Any, now: float) -> Any:
    rec.extra["retry_at"] = now - 1
    return rec


def test_root_flush_kills_a_stopped_flush_and_goes_on(site: Site, no_hang: Callable) -> None:
    cfg = _both_owe(site)
    no_hang(120)
    with Stopper(ATTACKER, skip=2):  # the scan and the lock probe go free
        summary = flush_node(cfg, NODE)
    assert steps(cfg, "pfs", VICTIM, "good") == [1]
    assert [ident for ident, _n, _s in summary.flushed] == [(VICTIM, "good", 1)]
    failed = dict(summary.failed)
    assert set(failed) == {(ATTACKER, "evil", 1), (ATTACKER, "evil", 2)}
    assert "stopped" in failed[(ATTACKER, "evil", 1)]
    assert "deferred" in failed[(ATTACKER, "evil", 2)]  # not tried again this round


def test_stopped_scan_child_only_skips_its_user(site: Site, no_hang: Callable) -> None:
    cfg = _both_owe(site)
    no_hang(120)
    with Stopper(ATTACKER):
        work = NodeWork(cfg, NODE)
        work.reconcile()  # the attacker's scan child is stopped: killed, user skipped
        assert VICTIM in work.users and ATTACKER not in work.users
        out = work.flush(work.candidates(None))
    assert [r.ident for r in out.results] == [(VICTIM, "good", 1)]
    assert steps(cfg, "pfs", VICTIM, "good") == [1]
    assert work.backlog(None) == (0, 0)  # the attacker's own doing drains nothing


def test_stopped_retention_child_only_skips_its_user(site: Site, no_hang: Callable) -> None:
    cfg = site.cfg(retention={"keep_local": 1})
    for step in (1, 2):
        save(cfg, VICTIM, "good", step, job="200")
        save(cfg, ATTACKER, "evil", step, job="100")
    work = NodeWork(cfg, NODE)
    work.reconcile()
    work.flush(work.candidates(None))
    assert steps(cfg, "pfs", VICTIM, "good") == steps(cfg, "pfs", ATTACKER, "evil") == [1, 2]
    no_hang(120)
    with Stopper(ATTACKER):
        deleted = work.retention(None)
    assert deleted == 1  # the victim's step 1; the attacker's delete child was killed
    assert steps(cfg, "local", VICTIM, "good") == [2]
    assert steps(cfg, "local", ATTACKER, "evil") == [1, 2]  # tried again next time
    assert work.retention(None) == 1 and steps(cfg, "local", ATTACKER, "evil") == [2]
