"""Partner copies on the real dev cluster (issue 21, must-show requeue test).

A 3-node job (``examples/train_tiny.py`` under ``ckpt-srun``, one rank per node, gloo)
runs with ``[partner] enabled`` and ``flush_every`` so high that only its first
checkpoint reaches the PFS from the job itself. Each rank's committed local checkpoint is
copied to the next node's private local disk (the ring n1 -> n2 -> n3 -> n1). Once rank
1's partner copy of a newer step is on n3, n2 dies with its disk (``dev-cluster
power-off --wipe-local``) and is marked DOWN; SLURM requeues the job. The epilogs of n1
and n3 flush what they hold - n3 the partner copy of rank 1 - so the job, moved to
n1,n3,n4, resumes at the newest step rank 1's partner copy reached (never at the older
step the PFS had when n2 died) and ends bitwise equal to an uninterrupted run.

Every wait polls SLURM, the job's output or the tiers; nothing sleeps for a fixed time.
"""

from __future__ import annotations

import sys
from typing import Iterator, List

import pytest
from test_cluster_multinode import INTERVAL, STEPS, MultiSite, _bring_back
from test_cluster_multinode import site as site  # noqa: F401 - the module's cluster site

pytestmark = [pytest.mark.root, pytest.mark.cluster]

WORLD = 3


@pytest.fixture
def t(site: MultiSite) -> Iterator[MultiSite]:  # noqa: F811
    site.ensure_hooks()
    site.configure(
        hooks={"stage_on_requeue": False},
        retention={"flush_every": 1000},
        partner={"enabled": True, "keep_partner": 2},
    )
    yield site
    site.configure(hooks={"stage_on_requeue": False})


def test_node_lost_requeued_elsewhere_resumes_at_the_newest_step(t: MultiSite) -> None:
    key = f"partner-{t.tok}"
    jobs: List[str] = []
    try:
        job = t.multi_job(key, "n1,n2,n3", ["-p", "low", "--requeue", "--open-mode=append"])
        jobs.append(job)
        t.wait_ranks(job, WORLD, rf"FLUSHED step={INTERVAL}$")
        # Rank 1 (n2) has its partner copy of a step the PFS does not have on n3.
        newer = 2 * INTERVAL
        t.c.wait_until(
            lambda: newer in t.local_steps("n3", key, 1),
            timeout=120,
            what=f"rank 1's partner copy of step {newer} on n3",
        )
        t.c.power_off("n2", wipe_local=True)
        held = t.local_steps("n3", key, 1)  # rank 1's partner copies on n3
        pfs_at_loss = t.complete_on_pfs(key, WORLD)
        t.c.run(["scontrol", "update", "nodename=n2", "state=down", "reason=test: node lost"])
        t.wait_pending_again(job, 1)
        assert pfs_at_loss == INTERVAL and max(held) >= newer, (pfs_at_loss, held)
        for node in ("n1", "n3"):
            t.wait_hook("epilog", job, node)
        # What n3's epilog flushed for rank 1 is the newest step every rank has.
        want = t.complete_on_pfs(key, WORLD)
        # (rank 1's shards exist nowhere else: n2 is gone, the PFS had step 10 only)
        assert want == max(held) > pfs_at_loss, (want, held, pfs_at_loss)
        t.move(job, "n1,n3,n4")
        t.c.wait_job_state(job, "COMPLETED", timeout=300)
        run = t.multi(job)
        out = run.text
        for rank in range(WORLD):
            res = run.resumed(rank)[-1]
            assert int(res["step"]) == want, (rank, want, out)
            assert run.done(rank) == [(STEPS, t.reference_digest_world(WORLD))], out
        assert run.hosts(1)[-1] == "n3", out
        # n3 held rank 1's partner copy: the restarted rank 1 read it from n3's disk.
        assert run.resumed(1)[-1]["tier"] == "local", out
    finally:
        t.c.run(["scancel", *jobs], check=False)
        t.configure(hooks={"stage_on_requeue": False})
        _bring_back(t, "n2")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))
