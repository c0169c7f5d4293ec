"""Round 3, issue 28 A: the owners of partner copies, looked up as a user pleases.

A checkpoint's manifest names the node that wrote it; one naming another node is a
partner copy, left to that node's own hooks while it is alive. The epilog once asked
SLURM about every distinct name (``scontrol show node NAME``, one process and one RPC
each), with no cap, before it computed its flush deadline. One user's leftovers - N tiny
checkpoints naming made-up nodes, their payload ``chmod 000`` so that they stay owed -
then made every later epilog on the node flush nothing and drain it (400 names: 8.7 s;
2,500: the hook timed out).

Now the owners' liveness comes from one query per hook (``scontrol show node -o``, all
nodes), a name SLURM does not list is not a live node, records held for their owner's
doing are not looked at, and a copy naming another node is flushed here once that node
is not alive or after ``[partner] owner_grace``.

SLURM is :class:`~tests.security.fake_slurm.FakeSlurm` (the machine has none): the real
client runs its scripts, each call costing what a real controller's does.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import pytest

from slurm_ckpt.core.hashing import chunk_digest, combine
from slurm_ckpt.core.layout import step_dirname
from slurm_ckpt.core.manifest import FileEntry, Manifest
from slurm_ckpt.hooks.epilog import run_epilog
from slurm_ckpt.hooks.prolog import ensure_user_dir
from slurm_ckpt.hooks.stager import stager_pass
from slurm_ckpt.tiers.registry import tiers_from_config

from .conftest import ATTACKER, NODE, VICTIM, Site, as_user, ids, save, steps
from .fake_slurm import FakeSlurm

COUNT = 5_000
BUDGET = 20.0


def _ghost_checkpoints(local: str, count: int) -> int:
    """As the attacker: ``count`` committed one-file checkpoints, each naming a node of
    its own that does not exist, the payload then made unreadable (``chmod 000``) so that
    every flush fails and they stay owed."""
    data = b"g" * 64
    digest = chunk_digest(data)
    entry = FileEntry("w.bin", len(data), combine([digest]), [digest])
    key_dir = os.path.join(local, ATTACKER, "ghosts")
    os.makedirs(key_dir, mode=0o700)
    for step in range(count):
        sdir = os.path.join(key_dir, step_dirname(step))
        os.mkdir(sdir, 0o700)
        path = os.path.join(sdir, "w.bin")
        with open(path, "wb") as fh:
            fh.write(data)
        man = Manifest(ATTACKER, "ghosts", step, [entry], job="100", node=f"ghost{step:05d}")
        with open(os.path.join(sdir, "manifest.json"), "wb") as fh:
            fh.write(man.to_bytes())
        os.chmod(path, 0)
    return count


def _site_with_ghosts(site: Site, **hooks: Any) -> Any:
    # tmpfs for both tiers (the epilog's own work is measured, not the disk's fsyncs).
    site.local = site.mounts.tmpfs("256m", "local-big")
    site.pfs = site.mounts.tmpfs("64m", "pfs-big")
    os.chmod(site.pfs, 0o1777)
    cfg = site.cfg(hooks=dict({"budget": BUDGET}, **hooks), retention={"keep_local": 100_000})
    ensure_user_dir(str(cfg.tiers.local.root), ids(ATTACKER))
    assert as_user(ATTACKER, _ghost_checkpoints, str(site.local), COUNT) == COUNT
    return cfg


def _held_by_the_stager(cfg: Any) -> None:
    """The attacker's job ended long ago: the epilog and the stager since tried each
    of the ghosts once and hold them (``permission``: the attacker's own doing)."""
    srep = stager_pass(cfg, NODE, None)
    assert len(srep.flush.failed) == COUNT and srep.backlog == 0, srep.line()


def _check_victim_flushed(cfg: Any, slurm: FakeSlurm, run: Callable[[], Any]) -> Any:
    save(cfg, VICTIM, "good", 1, job="200")
    t0 = time.monotonic()
    rep = run()
    took = time.monotonic() - t0  # the epilog's contract with SLURM: PrologEpilogTimeout
    assert steps(cfg, "pfs", VICTIM, "good") == [1], rep.line()
    assert tiers_from_config(cfg)["pfs"].verify(VICTIM, "good", 1).ok
    assert rep.drained is None and not slurm.drains, (rep.line(), slurm.drains)
    assert took <= BUDGET, f"{took:.1f}s: {rep.line()}"
    # Not one name a user wrote went to SLURM; at most one query about all nodes.
    assert not [c for c in slurm.calls if "ghost" in c], slurm.calls[:5]
    table = [c for c in slurm.calls if c == "scontrol show node -o"]
    assert len(table) <= 1 and rep.owners is not None and rep.owners.queries <= 1
    return rep


def test_five_thousand_made_up_owner_nodes_never_stop_a_victims_flush(
    site: Site, no_hang: Callable[[int], None]
) -> None:
    """The must-show: 5,000 held leftovers naming 5,000 unknown nodes, and a victim's
    checkpoint: flushed within the budget, the node not drained."""
    cfg = _site_with_ghosts(site)
    _held_by_the_stager(cfg)
    slurm = FakeSlurm(site.base)
    slurm.set_node(NODE)
    no_hang(600)
    rep = _check_victim_flushed(
        cfg, slurm, lambda: run_epilog(cfg, site.env(VICTIM, job="200"), slurm.client())
    )
    # Held and not due for a retry: not looked at, so SLURM was not asked at all.
    assert rep.owners.queries == 0 and rep.owners.skipped == COUNT, rep.owners


def test_ghosts_due_for_a_retry_cost_one_query(site: Site, no_hang: Callable[[int], None]) -> None:
    """The ghosts are due again (backoff 1 ms): all 5,000 names are asked about, in one
    query; unknown to SLURM, they are flushed here (and fail again, held) after the
    victim's, and the node is not drained."""
    cfg = _site_with_ghosts(site, retry_backoff="1ms")
    _held_by_the_stager(cfg)
    slurm = FakeSlurm(site.base)
    slurm.set_node(NODE)
    no_hang(600)
    rep = _check_victim_flushed(
        cfg, slurm, lambda: run_epilog(cfg, site.env(VICTIM, job="200"), slurm.client())
    )
    assert rep.owners.queries == 1 and rep.owners.unknown == COUNT, rep.owners
    assert rep.backlog == (0, 0), rep.line()


# --------------------------------------------------------------------------- partner copies


def _copy_from(cfg: Any, user: str, node: str, job: str = "100") -> None:
    """A checkpoint of ``user`` on this node written by ``node`` (a partner copy)."""
    ensure_user_dir(str(cfg.tiers.local.root), ids(user))

    def write() -> None:
        w = tiers_from_config(cfg)["local"].writer(user, "run", 1, job=job, node=node)
        w.write_buffers({"model.bin": b"p" * 4096})
        w.commit()

    as_user(user, write)


@pytest.mark.parametrize(
    "owner_state, grace, flushed_here",
    [
        ("IDLE", "1h", False),  # alive, within the grace: the owner's to flush
        ("DOWN", "1h", True),  # lost: this node holds the only copy
        ("IDLE+NOT_RESPONDING", "1h", True),
        ("IDLE", "0s", True),  # past the grace: flushed here too
        (None, "1h", True),  # a name SLURM does not know
    ],
)
def test_a_copy_naming_another_node(
    site: Site, owner_state: Any, grace: str, flushed_here: bool
) -> None:
    cfg = site.cfg(partner={"owner_grace": grace})
    slurm = FakeSlurm(site.base)
    slurm.set_node(NODE)
    if owner_state is not None:
        slurm.set_node("n2", owner_state)
    _copy_from(cfg, VICTIM, "n2")
    rep = run_epilog(cfg, site.env(ATTACKER, job="300"), slurm.client())
    assert (steps(cfg, "pfs", VICTIM, "run") == [1]) is flushed_here, (rep.line(), rep.owners)
    # Left to a live owner or flushed: either way it keeps no node drained.
    assert rep.drained is None and not slurm.drains and rep.backlog == (0, 0), rep.line()
    assert not [c for c in slurm.calls if c.startswith("scontrol show node -o n2")]
