"""Admission control on the real dev cluster: 3 nodes whose jobs end in the same second,
each leaving a checkpoint whose (capped) flush takes seconds, under ``[admission]
max_nodes = 1``. The three epilogs flush one at a time (the PFS never holds two copies in
progress), none runs past its budget (a flush that gets no slot in time goes to the
stager, which finishes it), and every checkpoint ends up verified on the PFS."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Dict, Iterator, List

import pytest
from helpers.cluster import DevCluster
from test_cluster_e2e import E2E, PY, hooked_site

from slurm_ckpt.core.units import parse_duration
from slurm_ckpt.ledger.events import read_events

pytestmark = pytest.mark.root

USER = "ckptuser1"
NODES = ("n1", "n2", "n3")
SIZE = 10 * 2**20  # at 2 MB/s: ~5 s per flush; three take longer than one epilog's budget
BUDGET_S = 20.0


@pytest.fixture(scope="module")
def e2e(slurm_cluster: DevCluster) -> Iterator[E2E]:
    with hooked_site(E2E(slurm_cluster)) as e:
        yield e


def _in_progress(pfs: Path) -> int:
    """Copies in progress on the PFS now: ``.partial-step-*`` directories of any key."""
    n = 0
    try:
        for key in (pfs / USER).iterdir():
            n += sum(1 for p in key.iterdir() if p.name.startswith(".partial-"))
    except OSError:
        pass
    return n


def test_three_nodes_with_a_cap_of_one_flush_serialized_within_budget(e2e: E2E) -> None:
    e, c = e2e, e2e.c
    e.configure(
        tiers_pfs={"bandwidth_limit": "2MB/s"},
        admission={"max_nodes": 1, "lease": "10s", "poll": "0.2s"},
    )
    e.ensure_hooks()
    keys = {node: f"adm-{node}-{e.tok}" for node in NODES}
    end_at = int(time.time()) + 20  # all three jobs end in the same second
    jobs: Dict[str, str] = {}
    for node, key in keys.items():
        body = f"{PY} {e.dir / 'writer.py'} {key} {SIZE} 1\nsleep $(( {end_at} - $(date +%s) ))\n"
        jobs[node] = e.job(body, args=["-w", node])

    samples: List[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(_in_progress(e.pfs_root))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        lines = {}
        for node, jobid in jobs.items():
            c.wait_job_state(jobid, "COMPLETED", timeout=120)
            lines[node] = e.wait_hook("epilog", jobid, node, timeout=120)
        # Whatever an epilog handed off, the stager finishes, also under the cap.
        for node, line in lines.items():
            if "handed" in line:
                for _ in range(5):
                    res = e.stager(node)
                    if res.returncode == 0 and "0 still owed" in res.stdout:
                        break
                else:
                    raise AssertionError(f"stager on {node}: {res.stdout}{res.stderr}")
                e.resume(node)
    finally:
        stop.set()
        sampler.join()
        e.configure()

    assert max(samples) == 1, "two copies to the PFS were in progress at once"
    assert samples.count(1) > 10  # the sampler did see the copies
    for line in lines.values():
        took = parse_duration(line.rsplit(" in ", 1)[1])
        assert took <= BUDGET_S, line  # no epilog past its budget
    for node, key in keys.items():
        assert e.verified_on_pfs(USER, key, 1), (node, lines[node])
    # Someone waited for the slot; nobody was refused silently: every request is an event.
    waits = []
    for node in NODES:
        path = e.local_dir(node) / ".slurm_ckpt" / "events.jsonl"
        waits += [ev for ev in read_events(path) if ev["type"].startswith("admission")]
    assert len([w for w in waits if w["type"] == "admission"]) >= 3, waits
    assert max(w["wait_s"] for w in waits) > 1.0, waits
