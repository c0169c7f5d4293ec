"""Restart inside the allocation (``ckpt-srun --spares``) on the real dev cluster.

A 3 + 1 spare node job (``sbatch -N4 --no-kill``) runs ``examples/train_tiny.py`` as three
ranks, one per node, under ``ckpt-srun --spares 1``. Once every rank has a checkpoint on
the PFS, one node dies as nodes die on a real cluster (``dev-cluster power-off``: its
slurmd and everything on it get SIGKILL, its disk is gone) and **nobody marks it DOWN**:
the controller would only notice after ``SlurmdTimeout`` (300 s here). ckpt-srun must
find the loss itself, from its heartbeats (slurm_ckpt/ops/heartbeat.py), and relaunch
while SLURM still counts the dead step as running. What must hold:

* the job is never requeued: same job id, ``Restarts=0`` (``scontrol show job``), one
  batch script run;
* ckpt-srun relaunches the step on the two surviving nodes plus the spare, each surviving
  rank on its own node again and the lost rank on the spare;
* partner copies are on and ``flush_every`` is so high that the PFS holds only the first
  step when the node dies: the surviving ranks resume from their node's local copy, the
  rank on the spare fetches its newest step from its partner copy on n3
  (``RESUMED ... tier=partner``), all at that step, which is not on the PFS;
* the run ends bitwise equal to an uninterrupted run of the same world size;
* ckpt-srun says how long the recovery took; the test prints the time from the node's
  death to every rank training again (no timed assertion: it is a measurement).

The dev cluster needs a fourth node; the module adds it if the cluster has fewer, and
puts the shape back afterwards. The lost node is rebooted and returned to service.
Every wait polls SLURM or the job's output; nothing sleeps for a fixed time.
"""

from __future__ import annotations

import json
import re
import sys
import time
from typing import Iterator

import pytest
from helpers.cluster import DevCluster, at_least_nodes
from test_cluster_e2e import CKPT_SLURM, CKPT_SRUN
from test_cluster_multinode import (
    INTERVAL,
    RUN_LINE,
    STEPS,
    MultiRun,
    MultiSite,
    _bring_back,
)

pytestmark = pytest.mark.root

NEED_NODES = 4
WORLD = 3
LOST = "n2"  # rank 1's node; the batch script runs on n1, which must survive
SPARE = "n4"


class SpareSite(MultiSite):
    def spare_job(self, key: str) -> str:
        """Three ranks on n1-n3 under ``ckpt-srun --spares 1``; n4 waits as the spare.
        ckpt-srun places the ranks itself (no -N/-w for srun)."""
        body = RUN_LINE + (
            f"exec {CKPT_SRUN} --key {key} --warn 0 --spares 1 --node-wait 2min -- "
            f"--ntasks-per-node=1 --label bash -c '{self.rank_cmd(key)}'\n"
        )
        nodes = ",".join(f"n{i}" for i in range(1, NEED_NODES + 1))
        return self.job(body, args=["-N", str(NEED_NODES), "-w", nodes, "--no-kill", "-p", "low"])


@pytest.fixture(scope="module")
def site(slurm_cluster: DevCluster) -> Iterator[SpareSite]:
    with at_least_nodes(slurm_cluster, NEED_NODES), SpareSite(slurm_cluster).running(WORLD) as s:
        yield s


@pytest.fixture
def t(site: SpareSite) -> Iterator[SpareSite]:
    site.ensure_hooks()
    # Survivors keep every step locally, so that the step all ranks agree on (bounded by
    # what the lost rank has on the PFS) is on their own disk: their read is local.
    # Partner copies on, flush_every so high that only the first step reaches the PFS:
    # the newest step of the lost rank is on its partner's disk only.
    site.configure(
        hooks={"stage_on_requeue": False},
        retention={"keep_local": 10, "flush_every": 1000},
        partner={"enabled": True, "keep_partner": 2},
    )
    yield site
    site.configure(hooks={"stage_on_requeue": False})


def test_lost_node_step_relaunched_on_spare_same_job_bitwise_exact(t: SpareSite) -> None:
    key = f"spare-{t.tok}"
    job = t.spare_job(key)
    try:
        t.wait_ranks(job, WORLD, rf"FLUSHED step={INTERVAL}$", timeout=180)
        # Rank 1 (n2) has its partner copy of a step the PFS lacks on n3 (rank 2).
        newer = 2 * INTERVAL
        t.c.wait_until(
            lambda: newer in t.local_steps("n3", key, 1),
            timeout=120,
            interval=0.1,
            what=f"rank 1's partner copy of step {newer} on n3",
        )
        died = time.monotonic()
        t.c.power_off(LOST, wipe_local=True)
        held = t.local_steps("n3", key, 1)  # rank 1's partner copies, nowhere else now
        pfs_at_loss = t.complete_on_pfs(key, WORLD)
        # Nothing tells SLURM: the controller still lists the node as up (SlurmdTimeout
        # is 300 s), so the relaunch below can only come from ckpt-srun's heartbeats.
        t.c.wait_until(
            lambda: all(t.multi(job).resumed(r) for r in range(WORLD)),
            timeout=180,
            interval=0.1,
            what=f"every rank of job {job} resumed after {LOST} died",
        )
        training_again = time.monotonic() - died
        # The batch script's end: COMPLETING while the controller still waits for the
        # dead node (it is not DOWN for SLURM yet), COMPLETED once it gives up on it.
        info = t.c.wait_job_state(job, ("COMPLETING", "COMPLETED"), timeout=300)
        assert info["ExitCode"] == "0:0", info
        run: MultiRun = t.multi(job)
        out = run.text
        # Same job, never requeued, one run of the batch script.
        assert info["JobId"] == job and info["Restarts"] == "0", (info, out)
        assert [(j, r) for j, r, _ in run.runs] == [(job, "0")], out
        # Relaunched on the survivors plus the spare, every survivor on its own node.
        assert run.hosts(0) == ["n1", "n1"], out
        assert run.hosts(1) == [LOST, SPARE], out
        assert run.hosts(2) == ["n3", "n3"], out
        assert f"node {LOST} lost" in out and f"relaunching the step on spare {SPARE}" in out
        assert "no heartbeat for 10s" in out or "found " in out, out
        state = t.c.run(["sinfo", "-h", "-n", LOST, "-o", "%T"], check=False).stdout.strip()
        print(f"\n[spares] SLURM's state of {LOST} when the job completed: {state}")
        m = re.search(r"recovery: relaunched step 1 starts ([0-9.]+)s after the failed", out)
        assert m, out
        # Survivors read their local copy, the spare's rank its partner copy on n3; one
        # step for all: the newest partner copy, which the PFS did not have.
        res = {r: run.resumed(r) for r in range(WORLD)}
        assert [len(v) for v in res.values()] == [1] * WORLD, out
        tiers = {r: v[0]["tier"] for r, v in res.items()}
        assert tiers == {0: "local", 1: "partner", 2: "local"}, out
        steps = {int(v[0]["step"]) for v in res.values()}
        assert pfs_at_loss == INTERVAL and max(held) >= newer, (pfs_at_loss, held)
        assert steps == {max(held)}, (steps, held, out)
        ref = t.reference_digest_world(WORLD)
        for rank in range(WORLD):
            assert run.done(rank) == [(STEPS, ref)], (rank, out)
        # The job measured its own goodput: one node loss, found by the heartbeats, and
        # what it cost, from the timeline ckpt-srun and rank 0 wrote on the PFS.
        g = json.loads(
            t.c.run(
                [str(CKPT_SLURM), "--config", str(t.config), "goodput", job, "--json"],
                user="ckptuser1",
            ).stdout
        )
        assert [f["nodes"] for f in g["failures"]] == [[LOST]], g
        f = g["failures"][0]
        assert f["found_by"] == "heartbeat" and 0 <= f["detection_s"] <= 20, g
        assert f["restored_step"] == min(steps) and f["training_again_s"] is not None, g
        assert 0 < g["goodput"] < 1 and g["steps_recomputed"] >= 0, g
        print(
            f"\n[spares] goodput {g['goodput']:.3f}, detection {f['detection_s']:.1f}s, "
            f"training again {f['training_again_s']:.1f}s after the last heartbeat, "
            f"{g['steps_recomputed']} steps recomputed"
        )
        print(
            f"\n[spares] {LOST} died -> every rank training again after {training_again:.1f}s "
            f"(ckpt-srun: relaunch {m.group(1)}s after the failed step ended; "
            f"resumed at step {min(steps)}, rank 1 from its partner copy; the PFS had "
            f"step {pfs_at_loss})"
        )
    finally:
        t.c.run(["scancel", job], check=False)
        t.configure(hooks={"stage_on_requeue": False})
        _bring_back(t, LOST)


def _plain_spare_job(t: SpareSite, key: str, step: str, extra: str, sbatch: list) -> str:
    """Two ranks on n1,n2 plus spare n3 running ``step`` (a shell command)."""
    cmd = f'echo "HOST rank=$SLURM_PROCID node=$SLURMD_NODENAME"; {step}'
    body = f"exec {CKPT_SRUN} --key {key} --warn 0 --spares 1 {extra} -- --label bash -c '{cmd}'\n"
    return t.job(
        body,
        args=["-N", "3", "-w", "n1,n2,n3", "--no-kill", "-p", "low", "--open-mode=append", *sbatch],
    )


def test_programs_own_failure_is_not_relaunched(t: SpareSite) -> None:
    """A step that fails while all its nodes are up is the program's business: ckpt-srun
    does not relaunch it (nor requeue), and the job ends with the step's status."""
    job = _plain_spare_job(t, f"own-{t.tok}", "exit 3", "--node-wait 3s", [])
    try:
        info = t.c.wait_job_state(job, "FAILED", timeout=120, fail_fast=False)
        out = t.c.job_output(job)
        assert info["ExitCode"] == "3:0" and info["Restarts"] == "0", (info, out)
        assert "the program's own failure, not relaunched" in out, out
        assert out.count("ckpt-srun: step on ") == 1 and "relaunching" not in out, out
    finally:
        t.c.run(["scancel", job], check=False)


#: SLURM's own verdict on a silent node, for the one test that waits for it (the site's
#: 300 s would hold CI for minutes): the dev cluster's SlurmdTimeout meanwhile.
VERDICT_S = 20
#: ckpt-srun's --node-timeout (its default): how long after SLURM's verdict the other
#: nodes must still be heard for the test to show their heartbeats outlived the kill.
NODE_TIMEOUT_S = 10


def test_slurms_later_verdict_on_the_dead_node_ends_no_other_nodes_heartbeat(
    t: SpareSite,
) -> None:
    """SLURM's verdict on a dead node comes ``SlurmdTimeout`` after the death, long after
    the heartbeats found it: it marks the node DOWN and kills every step that had a task
    there. Here the node dies the production way (slurmd and its processes SIGKILLed,
    nobody marks it DOWN) and SLURM gives its own verdict, with ``SlurmdTimeout`` set to
    VERDICT_S for this test only, once the step runs again on the spare. The other
    nodes' heartbeat agents are steps of their own and keep beating: the step (which
    waits for a file the test writes) outlives the verdict by more than ckpt-srun's node
    timeout, ckpt-srun finds no other node lost and the relaunched step ends 0. (With
    one agent step over every node, that step died with the dead node, every node fell
    silent, and the job was requeued as all lost: the seed-2 benchmark's relaunch arm.)"""
    release = t.out / f"release-{t.tok}"
    step = f"while [ ! -e {release} ]; do sleep 0.2; done"
    job = ""
    try:
        with t.c.slurmd_timeout(VERDICT_S):
            job = _plain_spare_job(t, f"verdict-{t.tok}", step, "--node-wait 1min", ["--requeue"])
            t.c.wait_until(
                lambda: all(MultiRun(t.c.job_output(job)).hosts(r) for r in range(2)),
                timeout=90,
                what=f"both ranks of job {job} running",
            )
            t.c.power_off("n2")  # nobody marks it DOWN: the heartbeats find it
            t.c.wait_until(
                lambda: "relaunching the step on spare n3" in t.c.job_output(job),
                timeout=120,
                what=f"job {job}'s step relaunched on n3",
            )
            # before SLURM's own verdict
            assert "DOWN" not in t.c.node_state("n2")
            assert "Node failure on n2" not in t.c.job_output(job)
            # SLURM's verdict, from slurmctld alone: n2 DOWN, and the sruns of the job's
            # steps with a task there told of the node's failure (the steps themselves
            # may stay listed: their node cannot confirm the kill)
            t.c.wait_node_state("n2", lambda st: "DOWN" in st, timeout=VERDICT_S * 6)
            t.c.wait_until(
                lambda: "Node failure on n2" in t.c.job_output(job),
                timeout=120,
                what=f"SLURM's node failure reaching job {job}'s steps on n2",
            )
            verdict = time.monotonic()
            assert (t.c.job_info(job) or {}).get("JobState") == "RUNNING"
            # the other nodes must still be heard a node timeout after it: watched, the
            # job failing meanwhile ends the watch at once
            t.c.wait_until(
                lambda: (
                    "lost" in t.c.job_output(job).split("relaunching the step on spare n3")[-1]
                    or time.monotonic() > verdict + NODE_TIMEOUT_S + 5
                ),
                timeout=NODE_TIMEOUT_S + 60,
                what="the watch after SLURM's verdict",
            )
            release.touch()
            info = t.c.wait_job_state(job, ("COMPLETING", "COMPLETED"), timeout=240)
        out = t.c.job_output(job)
        assert info["ExitCode"] == "0:0" and info["Restarts"] == "0", (info, out)
        assert "node n1 lost" not in out and "node n3 lost" not in out, out
        assert out.count("relaunching the step on spare") == 1, out
    finally:
        release.touch()
        if job:
            t.c.run(["scancel", job], check=False)
        _bring_back(t, "n2")


def test_no_spare_left_falls_back_to_requeue(t: SpareSite) -> None:
    """The step's node and the spare die together: nothing to relaunch on, so ckpt-srun
    requeues the job (a --no-kill job is not requeued by SLURM itself)."""
    job = _plain_spare_job(t, f"nospare-{t.tok}", "sleep 600", "--node-wait 1min", ["--requeue"])
    try:
        t.c.wait_until(
            lambda: all(MultiRun(t.c.job_output(job)).hosts(r) for r in range(2)),
            timeout=90,
            what=f"both ranks of job {job} running",
        )
        for node in ("n2", "n3"):  # nobody marks them DOWN: the heartbeats find both
            t.c.power_off(node)
        t.c.wait_until(
            lambda: (t.c.job_info(job) or {}).get("Restarts") == "1",
            timeout=120,
            what=f"job {job} requeued",
        )
        out = t.c.job_output(job)
        assert "and no spare left: falling back to a requeue" in out, out
        assert "no spare left (node n2 lost): requeueing (restart 1)" in out, out
        assert "relaunching" not in out, out
    finally:
        t.c.run(["scancel", job], check=False)
        for node in ("n2", "n3"):
            _bring_back(t, node)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v", "-s"]))
