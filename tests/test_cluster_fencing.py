"""Fencing on the real dev cluster: a partitioned node that comes back never commits.

A 3 + 1 spare node job (``sbatch -N4 --no-kill``) runs three ranks of
``tests/srun_worker.py`` (train_tiny's training, one rank per node) under
``ckpt-srun --spares 1``, partner copies on. Then n2 is **partitioned** as the issue
describes: every process of the node (its slurmd, the step's slurmstepd, the rank, the
heartbeat agent) is stopped with SIGSTOP, beyond ``--node-timeout``. Nothing marks it
DOWN (``SlurmdTimeout`` is 300 s). ckpt-srun's heartbeats declare it lost, and today's
relaunch path puts rank 1 on the spare n4, which restores its newest step from its
partner copy on n3 and takes the series' lease: a new **generation**.

Then the old rank 1 on n2 gets SIGCONT (the rest of the node after it: see the test). It
runs again, finds its peers gone, and does what a training script's error handler does:
it saves its last completed step and waits for the commits (``--last-gasp``). What must
hold:

* the old rank tried (its own log says ``LAST_GASP``), and was refused: the error names
  the newer generation;
* nothing of it is committed after the fence: no new step of rank 1's series on n2's
  disk, no manifest of the old generation on the PFS or on n3 (where rank 1's partner
  copies live) newer than what was there when it was fenced;
* the copy the spare's rank restored from is n3's (``tier=partner``), not n2's;
* the job goes on and ends bitwise equal to an uninterrupted run, same job id,
  ``Restarts=0``.

Every wait polls SLURM, the job's output or the tiers; nothing sleeps for a fixed time.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import sys
from pathlib import Path
from typing import Dict, Iterator, Optional, Set

import pytest
from helpers.cluster import DevCluster, at_least_nodes
from test_cluster_e2e import CKPT_SRUN, PY
from test_cluster_multinode import INTERVAL, RUN_LINE, STEPS, MultiSite, shard
from test_cluster_train import USER

from slurm_ckpt.core.lease import LeaseRecord, generation_of
from slurm_ckpt.errors import CkptError

pytestmark = pytest.mark.root

NEED_NODES = 4
WORLD = 3
PARTITIONED = "n2"  # rank 1's node; the batch script runs on n1
SPARE = "n4"
WORKER = Path(__file__).parent / "srun_worker.py"


def node_pids(c: DevCluster, node: str) -> Set[int]:
    """Every process of ``node``: those in its mount namespace (found by the tagged tmpfs
    in their mountinfo, as ``dev-cluster`` finds them), its slurmd included."""
    tag = f" devcluster-hide:{c.state_dir}:{node} "
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if tag in (entry / "mountinfo").read_text():
                pids.add(int(entry.name))
        except OSError:
            continue
    return pids


def signal_node(c: DevCluster, node: str, sig: signal.Signals) -> Set[int]:
    """Send ``sig`` to every process of ``node`` until no new one appears (a process
    forking while the others are stopped is caught in the next round)."""
    done: Set[int] = set()
    for _ in range(20):
        new = node_pids(c, node) - done
        if not new:
            break
        for pid in new:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        done |= new
    assert done, f"no process of {node} found"
    return done


class FenceSite(MultiSite):
    def __init__(self, cluster: DevCluster) -> None:
        super().__init__(cluster)
        self.worker = self.dir / "examples" / "srun_worker.py"
        shutil.copyfile(WORKER, self.worker)
        os.chmod(self.worker, 0o644)

    def worker_cmd(self, key: str, extra: str = "") -> str:
        return (
            'echo "HOST rank=$SLURM_PROCID node=$SLURMD_NODENAME"; '
            f"exec {PY} {self.worker} --key {key} --steps {STEPS} --interval-steps {INTERVAL} "
            f"--sleep-per-step 0.2 --log-dir {self.out} --digest-out {self.out / key}.digest "
            f"{extra}"
        )

    def spare_job(self, key: str, extra: str = "", ckpt_srun: str = "") -> str:
        body = RUN_LINE + (
            f"exec {CKPT_SRUN} --key {key} --warn 0 --spares 1 --node-wait 2min {ckpt_srun} -- "
            f"--ntasks-per-node=1 --label bash -c '{self.worker_cmd(key, extra)}'\n"
        )
        nodes = ",".join(f"n{i}" for i in range(1, NEED_NODES + 1))
        return self.job(body, args=["-N", str(NEED_NODES), "-w", nodes, "--no-kill", "-p", "low"])

    def proc_logs(self, key: str, rank: int) -> Dict[int, str]:
        """Each process's own log of ``rank``: pid -> text."""
        out = {}
        for path in self.out.glob(f"{key}.rank{rank}.pid*.log"):
            out[int(path.name.rsplit(".pid", 1)[1][:-4])] = path.read_text()
        return out

    def generations(self, where: str, key: str, rank: int) -> Dict[int, int]:
        """step -> generation of rank ``rank``'s committed steps on a tier (``pfs`` or a
        node's local tier)."""
        tier = self.tier("pfs") if where == "pfs" else self.tier("local", where)
        try:
            infos = tier.steps(USER, shard(key, rank))
        except CkptError:
            return {}
        return {i.step: generation_of(i.manifest.meta) for i in infos}

    def warm_lease(self, key: str, rank: int) -> Optional[LeaseRecord]:
        data = self.tier("pfs").read_lease(USER, shard(key, rank))
        return None if data is None else LeaseRecord.from_bytes(data)


@pytest.fixture(scope="module")
def site(slurm_cluster: DevCluster) -> Iterator[FenceSite]:
    with at_least_nodes(slurm_cluster, NEED_NODES), FenceSite(slurm_cluster).running(WORLD) as s:
        yield s


@pytest.fixture
def t(site: FenceSite) -> Iterator[FenceSite]:
    site.ensure_hooks()
    site.configure(
        hooks={"stage_on_requeue": False},
        retention={"keep_local": 10},
        partner={"enabled": True, "keep_partner": 2},
    )
    yield site
    site.configure(hooks={"stage_on_requeue": False})


def test_partitioned_node_is_fenced_after_relaunch(t: FenceSite) -> None:
    key = f"fence-{t.tok}"
    job = t.spare_job(key, f"--last-gasp {PARTITIONED}")
    stopped: Set[int] = set()
    try:
        t.wait_ranks(job, WORLD, rf"COMMITTED step={2 * INTERVAL}$", timeout=240)
        t.c.wait_until(
            lambda: 2 * INTERVAL in t.local_steps("n3", key, 1),
            timeout=120,
            interval=0.1,
            what="rank 1's partner copy on n3",
        )
        [old_pid] = [p for p, text in t.proc_logs(key, 1).items() if f"node={PARTITIONED}" in text]
        old_gen = t.warm_lease(key, 1).generation  # type: ignore[union-attr]
        stopped = signal_node(t.c, PARTITIONED, signal.SIGSTOP)
        # ckpt-srun finds the silence (nobody marks the node DOWN) and relaunches rank 1
        # on the spare; wait until every rank of the new step resumed.
        t.c.wait_until(
            lambda: all(len(t.multi(job).resumed(r)) == 1 for r in range(WORLD)),
            timeout=240,
            interval=0.2,
            what=f"every rank of job {job} resumed while {PARTITIONED} is stopped",
        )
        lease = t.warm_lease(key, 1)
        assert lease is not None and lease.generation > old_gen, (lease, old_gen)
        assert lease.node == SPARE, lease
        fenced_at = {where: t.generations(where, key, 1) for where in (PARTITIONED, "n3", "pfs")}
        out = t.multi(job).text
        assert f"node {PARTITIONED} lost" in out and f"spare {SPARE}" in out, out
        # The partition heals for the old rank first: it runs again while its node's
        # SLURM daemons stay stopped. In a real partition they would be cut off from the
        # controller and from srun all along; here, woken together with the rank, the
        # node's slurmstepd would act on the kill request srun queued at the stop and
        # SIGKILL the rank before it did anything (the queued request is an artefact of
        # SIGSTOP: the kernel accepted srun's connection for the stopped daemon).
        os.kill(old_pid, signal.SIGCONT)

        # The old rank runs again: its peers are gone, it tries its last-gasp save.
        def gasped() -> Optional[re.Match]:
            text = t.proc_logs(key, 1).get(old_pid, "")
            m = re.search(r"^LAST_GASP .*$", text, re.M)
            if m is None and not os.path.exists(f"/proc/{old_pid}"):
                raise AssertionError(
                    f"old rank 1 (pid {old_pid}) gone without a LAST_GASP:\n{text}"
                )
            return m

        gasp = t.c.wait_until(
            gasped,
            timeout=120,
            interval=0.2,
            what=f"the old rank 1 (pid {old_pid}) trying to save after SIGCONT",
        )
        line = gasp.group(0)  # type: ignore[union-attr]
        signal_node(t.c, PARTITIONED, signal.SIGCONT)  # and now the rest of the node
        stopped = set()
        assert "may not commit" in line and f"(generation {old_gen})" in line, (
            line,
            t.proc_logs(key, 1),
        )
        info = t.c.wait_job_state(job, ("COMPLETING", "COMPLETED"), timeout=300)
        run = t.multi(job)
        out = run.text
        assert info["ExitCode"] == "0:0" and info["Restarts"] == "0", (info, out)
        assert run.hosts(1) == [PARTITIONED, SPARE], out
        res = {r: run.resumed(r)[0] for r in range(WORLD)}
        assert {r: v["tier"] for r, v in res.items()} == {0: "local", 1: "partner", 2: "local"}
        ref = t.reference_digest_world(WORLD)
        for rank in range(WORLD):
            assert run.done(rank) == [(STEPS, ref)], (rank, out)
        # Nothing of the old generation committed after the fence, anywhere.
        for where, before in fenced_at.items():
            now = t.generations(where, key, 1)
            late = {s: g for s, g in now.items() if g <= old_gen and before.get(s) != g}
            assert not late, (where, late, before, now, t.proc_logs(key, 1))
        print(
            f"\n[fencing] {PARTITIONED} stopped, rank 1 relaunched on {SPARE} (generation "
            f"{old_gen} -> {lease.generation}); after SIGCONT the old rank: {line}"
        )
    finally:
        if stopped:
            signal_node(t.c, PARTITIONED, signal.SIGCONT)
        t.c.run(["scancel", job], check=False)
        t.configure(hooks={"stage_on_requeue": False})
        # Power-cycle the node: whatever of the old step is still there goes.
        t.c.reboot_node(PARTITIONED)
        if "DOWN" in t.c.node_state(PARTITIONED) or "DRAIN" in t.c.node_state(PARTITIONED):
            t.resume(PARTITIONED)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v", "-s"]))
