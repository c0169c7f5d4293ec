"""Multi-node training on the real dev cluster: a 2- and a 3-node job, and node loss.

``examples/train_tiny.py`` runs as one rank per node under ``ckpt-srun`` with
torch.distributed (gloo): data-parallel training whose ranks each save their own shard
through the Checkpointer onto *their own node's* local disk (each dev-cluster node has a
private one) and flush it to the shared PFS. The site hooks run as the cluster's
Prolog/Epilog. What must hold:

1. **Preempted and requeued onto a different node set** (a ``high`` job takes one node;
   the requeued job is moved so that it keeps some of its nodes and gets a new one): the
   ranks whose node kept their shard read it locally, the others read it from the PFS;
   all ranks resume at the one step they saved at the preemption, nothing is lost, and the
   finished weights are bitwise equal to an uninterrupted run with the same world size.
2. **Node loss** (``dev-cluster power-off``: the node's slurmd and everything on it get
   SIGKILL; the controller marks it DOWN, as it would after SlurmdTimeout): SLURM
   requeues the job, which restarts on the remaining nodes from the PFS and loses at most
   the work since the newest step whose every shard was verified on the PFS.
   With ``--wipe-local`` the node's disk is gone too. In the variant where the disk
   survives, the node comes back, its prolog (run for the next job there) rescues the
   newer local shards it still held to the PFS, and the restart then takes that newer
   step: restore prefers the newest *verified* step.

The dev cluster needs a fourth node for a 3-node job to move to a different node set; the
module adds it if the cluster has fewer, and puts the shape back afterwards.

Every wait polls SLURM, the job's output or the tiers; nothing sleeps for a fixed time.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple, TypeVar

import pytest
from helpers.cluster import DevCluster, at_least_nodes
from test_cluster_e2e import CKPT_SRUN, PY, hooked_site
from test_cluster_train import USER, TrainSite
from test_torch_distributed import free_port

from slurm_ckpt.errors import NotFound
from slurm_ckpt.tiers.posix import PosixTier

pytestmark = pytest.mark.root

STEPS = 40
INTERVAL = 10
SLEEP = 0.1
#: Nodes the module needs (a 3-node job requeued onto a partly different node set).
NEED_NODES = 4

_LABEL = re.compile(r"^\s*(\d+): (.*)$")
#: The batch script's first line: which job, which start, which nodes (MultiRun.runs).
RUN_LINE = (
    'echo "RUN job=$SLURM_JOB_ID restart=${SLURM_RESTART_COUNT:-0} nodes=$SLURM_JOB_NODELIST"\n'
)


def shard(key: str, rank: int) -> str:
    """The checkpoint series of one rank (see slurm_ckpt.job.restore.shard_key)."""
    return f"{key}.rank{rank:05d}"


class MultiRun:
    """A multi-node job's output: the batch script's lines and each rank's (srun --label)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.runs = re.findall(r"^RUN job=(\d+) restart=(\d+) nodes=(\S+)$", text, re.M)
        self.rank_lines: Dict[int, List[str]] = {}
        for line in text.splitlines():
            m = _LABEL.match(line)
            if m:
                self.rank_lines.setdefault(int(m.group(1)), []).append(m.group(2))

    def lines(self, rank: int, prefix: str) -> List[str]:
        return [ln for ln in self.rank_lines.get(rank, []) if ln.startswith(prefix)]

    def hosts(self, rank: int) -> List[str]:
        """The node the rank ran on, once per start."""
        return [ln.split("node=", 1)[1] for ln in self.lines(rank, "HOST ")]

    def ints(self, rank: int, what: str) -> List[int]:
        return [int(ln.split("=", 1)[1].split()[0]) for ln in self.lines(rank, f"{what} step=")]

    def resumed(self, rank: int) -> List[Dict[str, str]]:
        out = []
        for ln in self.lines(rank, "RESUMED "):
            out.append(dict(kv.split("=", 1) for kv in ln.split()[1:] if "=" in kv))
        return out

    def done(self, rank: int) -> List[Tuple[int, str]]:
        out = []
        for ln in self.lines(rank, "DONE "):
            m = re.match(r"DONE step=(\d+) digest=([0-9a-f]+)$", ln)
            if m:
                out.append((int(m.group(1)), m.group(2)))
        return out


_Site = TypeVar("_Site", bound="MultiSite")


class MultiSite(TrainSite):
    """The trainer site (hooks, private tiers, config) with multi-node jobs and a
    reference run per world size."""

    def __init__(self, cluster: DevCluster) -> None:
        super().__init__(cluster)
        self._refs: Dict[int, Tuple[List[subprocess.Popen], Path]] = {}
        self._ref_digests: Dict[int, str] = {}

    # -- the uninterrupted references (outside SLURM, same world size, no checkpoints) --
    def start_reference_world(self, world: int) -> None:
        ref_dir = self.dir / f"reference-{world}"
        ref_dir.mkdir()
        port = free_port()
        args = self.trainer_args(f"reference-{world}", STEPS)
        procs = []
        for rank in range(world):
            env = dict(
                os.environ,
                RANK=str(rank),
                WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                GLOO_SOCKET_IFNAME="lo",
            )
            procs.append(
                subprocess.Popen(
                    [str(PY), str(self.train), *args, "--no-ckpt"]
                    + ["--digest-out", str(ref_dir / "d")],
                    cwd=str(ref_dir),
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        self._refs[world] = (procs, ref_dir)

    def reference_digest_world(self, world: int) -> str:
        if world not in self._ref_digests:
            procs, ref_dir = self._refs[world]
            outs = [p.communicate(timeout=600)[0] for p in procs]
            assert [p.returncode for p in procs] == [0] * world, outs
            digest = (ref_dir / "d").read_text().strip()
            for out in outs:  # every rank ends with the same weights
                assert f"DONE step={STEPS} digest={digest}" in out, out
            self._ref_digests[world] = digest
        return self._ref_digests[world]

    def stop_references(self) -> None:
        for procs, _ in self._refs.values():
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()

    @contextmanager
    def running(self: _Site, *worlds: int) -> Iterator[_Site]:
        """The site for a module of multi-node tests: a reference run per world size
        started at once (they run while the tests do), the site hooks installed as the
        cluster's Prolog/Epilog; the references stopped at the end."""
        for world in worlds:
            self.start_reference_world(world)
        try:
            with hooked_site(self):
                yield self
        finally:
            self.stop_references()

    # -- jobs ---------------------------------------------------------------------------
    def multi_job(self, key: str, nodes: str, sbatch_args: List[str]) -> str:
        """``len(nodes)`` ranks, one per node, as the last line of the batch script.

        Each rank first says where it runs (``HOST``); ``srun --label`` prefixes every
        line with the rank. The digest goes next to the progress files, which the trainer
        keeps per rank (``.train_tiny-<key>-rank<r>.progress``)."""
        n = len(nodes.split(","))
        body = RUN_LINE + (
            f"exec {CKPT_SRUN} --key {key} --warn 0 -- -N{n} --ntasks-per-node=1 "
            f"--label bash -c '{self.rank_cmd(key)}'\n"
        )
        return self.job(body, args=["-N", str(n), "-w", nodes, *sbatch_args])

    def rank_cmd(self, key: str) -> str:
        """What each rank runs: it says where it runs (``HOST``), then trains."""
        args = " ".join(self.trainer_args(key, STEPS))
        return (
            'echo "HOST rank=$SLURM_PROCID node=$SLURMD_NODENAME"; '
            f"exec {PY} {self.train} {args} --sleep-per-step {SLEEP} "
            f"--digest-out {self.out / key}.digest"
        )

    def multi(self, jobid: str) -> MultiRun:
        return MultiRun(self.c.job_output(jobid))

    def wait_ranks(self, jobid: str, world: int, pattern: str, timeout: float = 120) -> MultiRun:
        """Until every rank printed a line matching ``pattern`` (a regex on its line)."""
        rx = re.compile(pattern)

        def seen() -> Optional[MultiRun]:
            run = self.multi(jobid)
            if all(any(rx.match(ln) for ln in run.rank_lines.get(r, [])) for r in range(world)):
                return run
            state = self.c.job_state(jobid)
            assert state not in ("FAILED", "CANCELLED", "COMPLETED"), f"{state}\n{run.text}"
            return None

        what = f"/{pattern}/ from every rank of job {jobid}"
        return self.c.wait_until(seen, timeout=timeout, what=what)  # type: ignore[return-value]

    def wait_pending_again(self, jobid: str, restarts: int, timeout: float = 120) -> None:
        def back() -> bool:
            info = self.c.job_info(jobid) or {}
            return info.get("Restarts") == str(restarts) and info.get("JobState") == "PENDING"

        self.c.wait_until(back, timeout=timeout, what=f"job {jobid} requeued ({restarts})")

    def move(self, jobid: str, nodes: str) -> None:
        """A requeued job keeps its node list: give it another one while it waits."""
        self.c.run(["scontrol", "update", f"jobid={jobid}", f"ReqNodeList={nodes}"])

    # -- tiers --------------------------------------------------------------------------
    def warm_verified(self, key: str, rank: int) -> List[int]:
        pfs = PosixTier("pfs", str(self.pfs_root))
        try:
            steps = [s.step for s in pfs.steps(USER, shard(key, rank))]
        except NotFound:
            return []
        return [s for s in steps if pfs.verify(USER, shard(key, rank), s).ok]

    def complete_on_pfs(self, key: str, world: int) -> int:
        """The newest step every rank's shard has verified on the PFS (0: none)."""
        common = set.intersection(*(set(self.warm_verified(key, r)) for r in range(world)))
        return max(common, default=0)

    def local_steps(self, node: str, key: str, rank: int) -> List[int]:
        try:
            return [s.step for s in self.tier("local", node).steps(USER, shard(key, rank))]
        except NotFound:
            return []

    def reached(self, key: str, rank: int = 0) -> int:  # type: ignore[override]
        path = self.out / f".train_tiny-{key}-rank{rank}.progress"
        return int(json.loads(path.read_text())["step"])


@pytest.fixture(scope="module")
def site(slurm_cluster: DevCluster) -> Iterator[MultiSite]:
    with at_least_nodes(slurm_cluster, NEED_NODES), MultiSite(slurm_cluster).running(2, 3) as s:
        yield s


@pytest.fixture
def t(site: MultiSite) -> Iterator[MultiSite]:
    site.ensure_hooks()
    site.configure(hooks={"stage_on_requeue": False})
    yield site
    site.configure(hooks={"stage_on_requeue": False})


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize(
    "first,second,local_ranks",
    [
        # rank r runs on the r-th node of the allocation (SLURM orders them by name)
        ("n1,n2", "n1,n3", [0]),
        ("n1,n2,n3", "n1,n2,n4", [0, 1]),
    ],
    ids=["2-node", "3-node"],
)
def test_multinode_preempted_requeued_elsewhere_resumes_exact(
    t: MultiSite, first: str, second: str, local_ranks: List[int]
) -> None:
    """Preempted by a high job on the last node, requeued onto a node set that keeps the
    first nodes and swaps the last: the kept ranks read their shard from their node's
    disk, the moved rank from the PFS; one step for all; bitwise-exact result."""
    world = len(first.split(","))
    key = f"mn{world}-{t.tok}"
    job = t.multi_job(key, first, ["-p", "low", "--requeue", "--open-mode=append"])
    high = None
    try:
        t.wait_ranks(job, world, r"COMMITTED step=")
        high = t.preempt(first.split(",")[-1])
        t.wait_pending_again(job, 1)
        t.move(job, second)
        info = t.c.wait_job_state(job, "COMPLETED", timeout=240)
        run = t.multi(job)
        out = run.text
        assert info["Restarts"] == "1", out
        assert [(j, r) for j, r, _ in run.runs] == [(job, "0"), (job, "1")], out
        for rank in range(world):
            assert run.hosts(rank) == [first.split(",")[rank], second.split(",")[rank]], out
        saved = {run.ints(r, "PREEMPTED")[0] for r in range(world)}
        assert len(saved) == 1, out  # every rank saved the same step at the preemption
        [step] = saved
        for rank in range(world):
            [res] = run.resumed(rank)
            want = "local" if rank in local_ranks else "pfs"
            assert res["tier"] == want, (rank, res, out)
            assert int(res["step"]) == step and res["lost"] == "0", (rank, res, out)
            assert run.done(rank) == [(STEPS, t.reference_digest_world(world))], out
        for rank in range(world):
            t.wait_hook("epilog", job, second.split(",")[rank])
            assert {step, STEPS} <= set(t.warm_verified(key, rank)), rank
    finally:
        t.c.run(["scancel", job] + ([high] if high else []), check=False)


def _lose_node_mid_job(
    t: MultiSite, key: str, wipe: bool, jobs: List[str]
) -> Tuple[str, int, Dict[int, int], Dict[int, List[int]]]:
    """A 2-node job on n1,n2 that flushes only its first checkpoint itself; once both
    ranks committed three, n2 dies. Returns the job, the newest complete PFS step at the
    loss, what each rank had reached, and the shards n2 still holds (rank 1's)."""
    t.configure(hooks={"stage_on_requeue": False}, retention={"flush_every": 1000})
    job = t.multi_job(key, "n1,n2", ["-p", "low", "--requeue", "--open-mode=append"])
    jobs.append(job)
    t.wait_ranks(job, 2, rf"COMMITTED step={3 * INTERVAL}$")
    t.wait_ranks(job, 2, rf"FLUSHED step={INTERVAL}$")
    t.c.power_off("n2", wipe_local=wipe)
    reached = {r: t.reached(key, r) for r in range(2)}
    held = {1: t.local_steps("n2", key, 1)}
    # The controller's verdict once SlurmdTimeout passes, without the wait: the node is
    # DOWN, and SLURM requeues the job that ran on it (JobRequeue=1).
    t.c.run(["scontrol", "update", "nodename=n2", "state=down", "reason=test: node lost"])
    t.wait_pending_again(job, 1)
    return job, t.complete_on_pfs(key, 2), reached, held


def test_node_loss_restarts_on_remaining_nodes_from_pfs(t: MultiSite) -> None:
    """n2 dies with its disk: the job restarts on n1 and n3 at the newest step whose every
    shard is verified on the PFS - never older - and still ends bitwise exact."""
    key = f"lost-{t.tok}"
    jobs: List[str] = []
    try:
        job, pfs_step, reached, held = _lose_node_mid_job(t, key, True, jobs)
        assert held == {1: []}  # the disk went with the node
        assert pfs_step >= INTERVAL
        t.move(job, "n1,n3")
        t.c.wait_job_state(job, "COMPLETED", timeout=240)
        run = t.multi(job)
        out = run.text
        for rank in range(2):
            res = run.resumed(rank)[-1]
            assert int(res["step"]) == pfs_step, (rank, pfs_step, out)
            # at most the work since the newest PFS-verified step
            assert reached[rank] - int(res["step"]) <= reached[rank] - pfs_step, out
            assert run.done(rank) == [(STEPS, t.reference_digest_world(2))], out
        assert run.resumed(1)[-1]["tier"] == "pfs", out  # n3 never held rank 1's shard
        assert run.hosts(1)[-1] == "n3", out
    finally:
        t.c.run(["scancel", *jobs], check=False)
        t.configure(hooks={"stage_on_requeue": False})
        _bring_back(t, "n2")


def test_node_loss_disk_survives_prolog_rescues_newer_step(t: MultiSite) -> None:
    """n2 dies but its disk survives. While the requeued job waits (held), n2 comes back,
    and its hooks flush rank 1's newer shards that never reached the PFS: SLURM runs the
    epilog of the job that died there once the node registers again, and the prolog of
    the next job there (a probe job) would rescue whatever that left. The restart (on n1
    and n3) then resumes at that newer step, not at the older one that was complete on the
    PFS when the node died."""
    key = f"rescue-{t.tok}"
    jobs: List[str] = []
    try:
        job, pfs_step, reached, held = _lose_node_mid_job(t, key, False, jobs)
        t.c.run(["scontrol", "hold", job])
        newer = [s for s in held[1] if s > pfs_step]
        assert newer, (held, pfs_step)  # n2 kept shards newer than the PFS has
        t.c.reboot_node("n2")
        t.c.wait_node_state("n2", lambda s: "DOWN" not in s and "DRAIN" not in s, timeout=60)
        probe = t.job("true\n", user="ckptuser2", args=["-w", "n2"])
        jobs.append(probe)
        t.c.wait_job_state(probe, "COMPLETED", timeout=60)
        t.wait_hook("prolog", probe, "n2")
        t.c.wait_until(
            lambda: set(newer) <= set(t.warm_verified(key, 1)),
            timeout=60,
            what=f"rank 1's shards {newer} flushed from n2 once it is back",
        )
        # Who flushed them: slurmd runs the epilog of the job that died there when the
        # node registers again, else the prolog of the next job there rescues them.
        text = t.log.read_text()
        after = (
            text[text.index(f"epilog n1 job {job}:") :] if f"epilog n1 job {job}:" in text else text
        )
        hooks = rf"(?:epilog n2 job {job}: .*flushed [1-9]|prolog n2 job {probe}: .*rescued [1-9])"
        by = re.findall(rf"^.* {hooks}.*$", after, re.M)
        assert by, text
        want = t.complete_on_pfs(key, 2)
        assert want == max(newer) > pfs_step, (want, newer, pfs_step)
        t.move(job, "n1,n3")
        t.c.run(["scontrol", "release", job])
        t.c.wait_job_state(job, "COMPLETED", timeout=240)
        run = t.multi(job)
        out = run.text
        for rank in range(2):
            res = run.resumed(rank)[-1]
            assert int(res["step"]) == want, (rank, want, out)
            assert run.done(rank) == [(STEPS, t.reference_digest_world(2))], out
        assert run.resumed(1)[-1]["tier"] == "pfs", out
        assert reached[1] - want < reached[1] - pfs_step  # the rescue saved work
    finally:
        t.c.run(["scancel", *jobs], check=False)
        t.configure(hooks={"stage_on_requeue": False})
        _bring_back(t, "n2")


def _bring_back(t: MultiSite, node: str) -> None:
    """A node a test powered off is started again and returned to service, with the
    site's local root on its disk again if the disk was wiped (what provisioning does)."""
    d = t.local_dir(node)
    if not d.is_dir():
        d.mkdir(mode=0o755)
        os.chmod(d, 0o755)
    state = t.c.node_state(node)
    # Powered off, a node is dead before SLURM says so (SlurmdTimeout later): start it
    # again whatever SLURM lists, or the next test finds a node that runs nothing.
    if "DOWN" in state or "NOT_RESPONDING" in state or not t.c.slurmd_running(node):
        t.c.reboot_node(node)
    state = t.c.node_state(node)
    if "DOWN" in state or "DRAIN" in state:
        t.resume(node)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))
