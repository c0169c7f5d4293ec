"""Attack 6: a backlog of many tiny checkpoints (12,000 against a 20 s budget) made the
epilog rewrite the whole ledger once per checkpoint and run minutes past its budget; in
production the wrapper kills it and the node is drained "timed out".

The epilog must return within its budget at any backlog size, hand the rest to the
stager in one transaction, drain the node with counts and sizes only, and the stager
must then finish the backlog and resume the node.

The budget is the epilog's contract with SLURM (PrologEpilogTimeout), so it is asserted;
how many checkpoints fit in it is not (that is a matter of speed, not of safety).
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

from slurm_ckpt.core.hashing import chunk_digest, combine
from slurm_ckpt.core.layout import step_dirname
from slurm_ckpt.core.manifest import FileEntry, Manifest
from slurm_ckpt.hooks.epilog import run_epilog
from slurm_ckpt.hooks.prolog import ensure_user_dir
from slurm_ckpt.hooks.stager import stager_pass
from slurm_ckpt.ledger import State
from slurm_ckpt.ledger.node_status import read_node_statuses

from .conftest import NODE, VICTIM, Recorder, Site, as_user, ids

COUNT = 12_000
BUDGET = 20.0


def _tiny_checkpoints(local: str, count: int) -> int:
    """As the user: ``count`` committed one-file checkpoints (each a real, valid
    checkpoint: payload, then the manifest with its checksum)."""
    data = b"t" * 64
    digest = chunk_digest(data)
    entry = FileEntry("w.bin", len(data), combine([digest]), [digest])
    key_dir = os.path.join(local, VICTIM, "tiny")
    os.makedirs(key_dir, mode=0o700)
    for step in range(count):
        sdir = os.path.join(key_dir, step_dirname(step))
        os.mkdir(sdir, 0o700)
        with open(os.path.join(sdir, "w.bin"), "wb") as fh:
            fh.write(data)
        man = Manifest(VICTIM, "tiny", step, [entry], job="100", node=NODE)
        with open(os.path.join(sdir, "manifest.json"), "wb") as fh:
            fh.write(man.to_bytes())
    return count


def test_twelve_thousand_tiny_checkpoints_within_a_20s_budget(site: Site) -> Any:
    # tmpfs for both tiers: this is about the epilog's own work, not the disk's fsyncs
    # (the stager must finish the rest within the suite's time too).
    site.local = site.mounts.tmpfs("256m", "local-big")
    site.pfs = site.mounts.tmpfs("256m", "pfs-big")
    os.chmod(site.pfs, 0o1777)
    cfg = site.cfg(retention={"keep_local": 100_000})
    ensure_user_dir(str(cfg.tiers.local.root), ids(VICTIM))
    assert as_user(VICTIM, _tiny_checkpoints, str(site.local), COUNT) == COUNT
    slurm = Recorder()
    t0 = time.monotonic()
    rep = run_epilog(cfg, site.env(VICTIM), slurm, budget=BUDGET)
    took = time.monotonic() - t0  # all of it: scan, flushes, hand-off, drain, status
    assert took <= BUDGET, f"{took:.1f}s: {rep.line()}"
    done = len(rep.flush.flushed)
    handed = len(rep.flush.handed)
    assert done > 0 and done + handed == COUNT, rep.line()
    # Whatever is left is the stager's, and the drain says counts and sizes only.
    if handed:
        assert slurm.drains and re.fullmatch(
            r"slurm_ckpt: flushing \d+ checkpoints \([0-9.]+[KMG]?i?B\); see ckpt-slurm status",
            slurm.drains[-1],
        ), slurm.drains
    led = site.ledger(cfg)
    pending = led.pending_flush()
    assert len(pending) == handed
    assert all(r.state("pfs") is State.FLUSH_PENDING for r in pending)
    # The stager finishes the backlog and gives the node back.
    srep = stager_pass(cfg, NODE, slurm)
    assert srep.backlog == 0 and not srep.flush.failed, srep.line()
    assert not slurm.drained and (slurm.resumes == 1 or not handed)
    assert led.pending_flush() == []
    assert read_node_statuses(site.pfs)[0]["pending"]["count"] == 0
