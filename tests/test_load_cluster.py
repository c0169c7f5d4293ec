"""Under load (``benchmarks/load.py`` for a short while): several jobs per node on every
node, each saving at every step, all flushing to one PFS. The ledger, the locks and
``ckpt-slurm status`` must stay correct:

* every job finishes, with no failed save or flush (no lock was left held, nothing hung);
* every checkpoint listed on any tier verifies, and no work area (``.tmp-``/``.partial-``)
  is left behind once the epilogs ran;
* each job's last checkpoint is verified on the PFS, the node ledgers owe nothing, and no
  node is left drained;
* ``ckpt-slurm status --json`` reports each job's newest PFS step as the tiers have it,
  with nothing at risk.

The figures themselves (saves/s, flush throughput, p99 stall) are the benchmark's.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
from helpers.cluster import DevCluster
from test_cluster_e2e import CKPT_SLURM, E2E, hooked_site

from benchmarks.load import Load
from slurm_ckpt.ledger import Ledger
from slurm_ckpt.tiers.posix import PosixTier

pytestmark = pytest.mark.root

USER = "ckptuser1"
PER_NODE = 2
SECONDS = 12
SIZE = 256 << 10


@pytest.fixture(scope="module")
def loaded(slurm_cluster: DevCluster) -> Iterator[tuple]:
    site = E2E(slurm_cluster)
    with hooked_site(site):
        site.configure(
            hooks={"stage_on_requeue": False},
            retention={"keep_local": 2, "flush_every": 1},
        )
        load = Load(site)
        docs = load.run(slurm_cluster.nodes, PER_NODE, SECONDS, SIZE, "t")
        yield site, docs


def test_every_job_saved_and_flushed_without_failure(loaded: tuple) -> None:
    site, docs = loaded
    assert len(docs) == PER_NODE * len(site.c.nodes)
    for d in docs:
        assert d["saves"] >= 5 and d["committed"] == d["saves"], d["key"]
        assert d["failures"] == 0 and d["flush_failures"] == 0, d
        assert d["last_flushed_step"] == d["last_step"] == d["saves"], d


def _steps(tier: PosixTier, key: str) -> List[int]:
    return [s.step for s in tier.steps(USER, key)]


def test_tiers_hold_only_verified_checkpoints_and_no_work_areas(loaded: tuple) -> None:
    site, docs = loaded
    for d in docs:
        site.wait_hook("epilog", d["job"], d["node"])
    pfs = site.tier("pfs")
    for d in docs:
        key = d["key"]
        steps = _steps(pfs, key)
        assert d["saves"] in steps, (key, steps)
        for step in steps:
            assert pfs.verify(USER, key, step).ok, (key, step)
        local = site.tier("local", d["node"])
        for step in _steps(local, key):
            assert local.verify(USER, key, step).ok, (key, step)
        for root in (Path(pfs.root), Path(local.root)):
            left = [
                n for n in os.listdir(root / USER / key) if n.startswith((".tmp-", ".partial-"))
            ]
            assert left == [], (root, key, left)


def test_ledgers_owe_nothing_and_no_node_is_drained(loaded: tuple) -> None:
    site, docs = loaded
    keys = {d["key"] for d in docs}
    for node in site.c.nodes:
        ledger = Ledger(site.local_dir(node) / ".slurm_ckpt", node)
        owed = [r.ident for r in ledger.pending_flush() if r.key in keys]
        assert owed == [], (node, owed)
        assert "DRAIN" not in site.c.node_state(node), site.node_reason(node)


def _status(site: E2E, key: str) -> Dict[str, Any]:
    env = dict(site.c.env, SLURM_CKPT_CONFIG=str(site.config))
    proc = subprocess.run(
        [str(CKPT_SLURM), "status", "--json", "--key", key],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def test_status_reports_the_tiers_as_they_are(loaded: tuple) -> None:
    site, docs = loaded
    for d in docs[:: max(1, len(docs) // 3)]:
        doc = _status(site, d["key"])
        rows = [j for j in doc["jobs"] if j["job"] == d["job"]]
        assert len(rows) == 1, doc["jobs"]
        row = rows[0]
        assert row["tiers"]["pfs"]["step"] == d["saves"], row
        assert row["steps_at_risk"] == 0 and row["checkpoints_at_risk"] == 0, row
