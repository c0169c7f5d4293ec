"""Root's hooks count the suspect steps they find in users' manifests (issue 34).

On a SLURM node the job writes its ``replicas_suspect`` events to its user's event log;
the node's metrics come from root's. So root's scan of the local tier (prolog, epilog,
stager) carries each manifest's suspect flag and records one event per step: the
node's ``slurm_ckpt_suspect_steps_total`` says how many steps, whichever hooks scanned
them and how often, however many ranks' series hold them. The flag is a user's text:
it is counted and nothing else, and forging many costs root a bounded summary.
Real filesystems and real privilege drops (root); the SLURM side is in
test_cluster_replicas.py.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List

import pytest
from helpers.metrics import one_sample
from test_hooks import Area, area, ids  # noqa: F401 - the fixture

from slurm_ckpt.core.config import Config
from slurm_ckpt.hooks.epilog import run_epilog
from slurm_ckpt.hooks.prolog import ensure_user_dir, run_prolog
from slurm_ckpt.hooks.stager import stager_pass
from slurm_ckpt.ledger import suspect_steps
from slurm_ckpt.ledger.events import events_path, read_events, read_summary
from slurm_ckpt.ledger.metrics import TEXTFILE_NAME
from slurm_ckpt.node.asuser import run_as_user
from slurm_ckpt.node.hook_record import note_hook
from slurm_ckpt.node.suspects import PER_USER
from slurm_ckpt.tiers.registry import tiers_from_config

pytestmark = pytest.mark.root
USER = "ckptuser1"
SUSPECT = {"replicas": {"checked": 1, "suspect": True, "ranks": [3], "nodes": ["n2"]}}
AGREED = {"replicas": {"checked": 1, "suspect": False}}


def _save(cfg: Config, key: str, step: int, meta: Dict[str, Any]) -> None:
    ensure_user_dir(str(cfg.tiers.local.root), ids(USER))

    def write() -> int:
        w = tiers_from_config(cfg)["local"].writer(USER, key, step, job="100", meta=meta)
        w.write_buffers({"model.bin": os.urandom(512)})
        w.commit()
        return step

    run_as_user(USER, write)


def _metric(cfg: Config) -> float:
    """The node's textfile as a hook leaves it (note_hook: what the hook entry points
    run after their work), read with prometheus' own parser."""
    note_hook(cfg, "n1", "epilog", 0.1, True)
    textfile = cfg.metrics.textfile_dir / TEXTFILE_NAME  # type: ignore[operator]
    return one_sample(textfile, "slurm_ckpt_suspect_steps_total")


def _suspect_events(cfg: Config) -> List[Dict[str, Any]]:
    return [e for e in read_events(events_path(cfg, "n1")) if e["type"] == "replicas_suspect"]


def test_the_hooks_count_a_suspect_step_of_two_ranks_once(area: Area) -> None:  # noqa: F811 - fixture
    cfg = area.cfg(metrics={"textfile_dir": str(area.base / "prom")})
    for rank in (2, 3):  # two ranks of a job on this node; step 6 suspect, 5 fine
        _save(cfg, f"run.rank{rank:05d}", 5, AGREED)
        _save(cfg, f"run.rank{rank:05d}", 6, SUSPECT)
    run_epilog(cfg, area.env(USER))
    assert _metric(cfg) == 1
    got = _suspect_events(cfg)
    assert [(e["user"], e["key"], e["step"], e["source"]) for e in got] == [
        (USER, "run", 6, "manifest")
    ]
    # every later scan finds the same manifests (or their PFS copies gone local): once
    run_prolog(cfg, area.env(USER, job="101"))
    stager_pass(cfg, "n1")
    run_epilog(cfg, area.env(USER, job="101"))
    assert _metric(cfg) == 1 and len(_suspect_events(cfg)) == 1
    # a new suspect step counts
    _save(cfg, "run.rank00002", 7, SUSPECT)
    run_epilog(cfg, area.env(USER, job="101"))
    assert _metric(cfg) == 2 and len(_suspect_events(cfg)) == 2


def test_a_user_forging_suspect_manifests_costs_root_a_bounded_summary(area: Area) -> None:  # noqa: F811 - fixture
    cfg = area.cfg(metrics={"textfile_dir": str(area.base / "prom")}, retention={"keep_local": 500})
    for step in range(1, 3 * suspect_steps.STEPS_KEPT):
        _save(cfg, "forged", step, SUSPECT)
    for k in range(2 * suspect_steps.SERIES_PER_USER):
        _save(cfg, f"forged{k}", 1, SUSPECT)
    run_epilog(cfg, area.env(USER))
    first = len(_suspect_events(cfg))
    assert first == PER_USER  # one scan records at most this many per user, newest first
    mem = read_summary(events_path(cfg, "n1"))["suspect"]
    assert len(mem) <= suspect_steps.SERIES_PER_USER
    assert all(len(e["steps"]) <= suspect_steps.STEPS_KEPT for e in mem.values())
    assert len(json.dumps(mem)) < 16 * 1024
    # the flag is only counted: every forged step was flushed like any other
    assert tiers_from_config(cfg)["pfs"].steps(USER, "forged")
