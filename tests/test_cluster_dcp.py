"""FSDP2 through torch.distributed.checkpoint and our DCP backend, on the real dev cluster.

``tests/dcp_worker.py`` (a tiny FSDP2 model, Adam, a scheduler, the RNG; CPU, gloo) runs
as one rank per node under ``ckpt-srun``, as an unprivileged user, with the site hooks as
Prolog/Epilog. Each rank's DCP part lands on its own node's local disk (each dev-cluster
node has a private one), committed with our manifest, and is flushed to the shared PFS.
What must hold:

1. **Preempted and requeued onto another node set**: a 2-node job on n1,n2 is preempted
   by a ``high`` job on n2 (SIGTERM to every rank: the preemption save through
   ``dcp.async_save``), and the requeued job is moved to n1,n3. Rank 0 (n1 again) reads
   its part from n1's disk, rank 1 (n3, which never held it) from the PFS, as is every
   other part a rank's plan needs (replicated items live in one part each); both resume
   at the step saved at the preemption, and the finished weights, optimizer state and
   RNG are bitwise equal to an uninterrupted 2-rank run.
2. **The same checkpoint loads in a 3-node job** (n1,n2,n3): DCP's planner reshards the
   two parts over three ranks; each part a rank needs comes from its node's disk where
   that node holds it and from the PFS where it does not, and every loaded tensor is
   ``torch.equal`` to what was saved.

Every wait polls SLURM or the job's output; nothing sleeps for a fixed time.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import pytest
import torch
from helpers.cluster import DevCluster
from test_cluster_e2e import CKPT_SRUN, PY, hooked_site
from test_cluster_multinode import MultiRun, MultiSite
from test_cluster_train import USER
from test_dcp_fsdp2 import equal
from test_torch_distributed import free_port

from slurm_ckpt.errors import NotFound
from slurm_ckpt.job.dcp_series import part_key

pytestmark = pytest.mark.root

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "dcp_worker.py"
#: Small and short, but slow enough per step that the preemption lands mid-run (the
#: worker sleeps on the first run only).
STEPS = 40
EVERY = 4
SLEEP = 0.25


class DcpSite(MultiSite):
    """The multi-node site (hooks, private tiers, config) with the DCP worker, copied to
    a private directory the job user can read (beside it there is no slurm_ckpt source
    tree: jobs import the package installed in the venv, as the hooks do)."""

    def __init__(self, cluster: DevCluster) -> None:
        super().__init__(cluster)
        self.worker = self.dir / "dcp_worker.py"
        shutil.copyfile(WORKER, self.worker)
        os.chmod(self.worker, 0o644)
        self._ref_procs: List[subprocess.Popen] = []

    def worker_args(self, cmd: str, key: str, *extra: str) -> List[str]:
        tiers = ["--local", str(self.local_root), "--pfs", str(self.pfs_root)]
        return [cmd, "--key", key, *tiers, "--dump", str(self.out), *extra]

    def dcp_job(self, key: str, nodes: str, args: List[str], sbatch_args: List[str]) -> str:
        """One rank per node under ckpt-srun; rank 0's node (all nodes run on 127.0.0.1)
        holds the rendezvous, on a port of the job's own."""
        n = len(nodes.split(","))
        rank_cmd = (
            'echo "HOST rank=$SLURM_PROCID node=$SLURMD_NODENAME"; '
            f"exec {PY} -W ignore {self.worker} {' '.join(args)}"
        )
        body = (
            'echo "RUN job=$SLURM_JOB_ID restart=${SLURM_RESTART_COUNT:-0} '
            'nodes=$SLURM_JOB_NODELIST"\n'
            "export MASTER_ADDR=127.0.0.1 GLOO_SOCKET_IFNAME=lo "
            "MASTER_PORT=$((21000 + SLURM_JOB_ID % 2000))\n"
            f"exec {CKPT_SRUN} --key {key} --warn 0 -- -N{n} --ntasks-per-node=1 "
            f"--label bash -c '{rank_cmd}'\n"
        )
        return self.job(body, args=["-N", str(n), "-w", nodes, *sbatch_args])

    def reference(self, steps: int) -> None:
        """The uninterrupted 2-rank run (outside SLURM, as root, its own tiers)."""
        ref = self.dir / "reference"
        port = free_port()
        procs = []
        for rank in range(2):
            env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
            env.update(
                RANK=str(rank),
                WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                GLOO_SOCKET_IFNAME="lo",
            )
            cmd = [str(PY), "-W", "ignore", str(self.worker), "train", "--key", "ref"]
            cmd += ["--steps", str(steps), "--every", str(EVERY)]
            cmd += ["--local", str(ref / "local"), "--pfs", str(ref / "pfs")]
            procs.append(
                subprocess.Popen(
                    cmd,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        self._ref_procs = procs

    def reference_digest(self) -> str:  # type: ignore[override]
        outs = [p.communicate(timeout=300)[0] for p in self._ref_procs]
        assert [p.returncode for p in self._ref_procs] == [0, 0], outs
        digests = {m for o in outs for m in re.findall(r"^DONE digest=(\w+)$", o, re.M)}
        assert len(digests) == 1, outs
        return digests.pop()

    def holds(self, node: str, key: str, part: int, step: int) -> bool:
        """``node``'s disk holds ``part`` of ``step``, committed."""
        try:
            steps = self.tier("local", node).steps(USER, part_key(key, part))
        except NotFound:
            return False
        return step in {s.step for s in steps}


def tiers_of(res: Dict[str, str]) -> Dict[int, str]:
    """``tiers=0:local,1:pfs`` -> {0: "local", 1: "pfs"}: where each part was read."""
    return {int(r): t for r, t in (p.split(":") for p in res["tiers"].split(",") if p)}


@pytest.fixture(scope="module")
def site(slurm_cluster: DevCluster) -> Iterator[DcpSite]:
    s = DcpSite(slurm_cluster)
    with hooked_site(s):
        yield s


def test_dcp_fsdp2_preempted_requeued_elsewhere_resumes_exact_and_loads_at_3(
    site: DcpSite,
) -> None:
    t = site
    t.ensure_hooks()
    t.configure(hooks={"stage_on_requeue": False})  # a restart elsewhere reads the PFS itself
    t.reference(STEPS)
    key = f"dcp-{t.tok}"
    train = t.worker_args("train", key, "--steps", str(STEPS), "--every", str(EVERY))
    train += ["--sleep", str(SLEEP)]
    job = t.dcp_job(key, "n1,n2", train, ["-p", "low", "--requeue", "--open-mode=append"])
    high: Optional[str] = None
    load: Optional[str] = None
    try:
        t.wait_ranks(job, 2, rf"SAVED step={EVERY}$")
        high = t.preempt("n2")
        t.wait_pending_again(job, 1)
        t.move(job, "n1,n3")
        info = t.c.wait_job_state(job, "COMPLETED", timeout=240)
        run = t.multi(job)
        out = run.text
        assert info["Restarts"] == "1", out
        assert [(j, r) for j, r, _ in run.runs] == [(job, "0"), (job, "1")], out
        assert run.hosts(0) == ["n1", "n1"] and run.hosts(1) == ["n2", "n3"], out
        saved = {s for r in range(2) for s in run.ints(r, "PREEMPTED")}
        assert len(saved) == 1, out  # every rank saved the same step at the preemption
        [step] = saved
        assert EVERY <= step < STEPS, out
        reference = t.reference_digest()
        for rank in (0, 1):
            assert run.lines(rank, f"NOTHING key={key}"), out  # the first start: fresh
            [res] = run.resumed(rank)
            assert int(res["step"]) == step, (rank, res, out)
            # Its own part and any other its plan needs (DCP spreads the replicated items
            # over the parts): only n1 held one, rank 0's; everything else is the PFS's.
            got = tiers_of(res)
            assert rank in got, (rank, res, out)
            want = {p: "local" if (rank, p) == (0, 0) else "pfs" for p in got}
            assert got == want, (rank, res, out)
            assert run.lines(rank, "DONE ") == [f"DONE digest={reference}"], out
        # The preemption save and the last one, every part: verified on the PFS (the
        # job's own flush or its epilog; a requeued job's epilogs share its id, so poll).
        t.c.wait_until(
            lambda: all(
                t.verified_on_pfs(USER, part_key(key, r), s) for r in (0, 1) for s in (step, STEPS)
            ),
            timeout=90,
            what=f"steps {step} and {STEPS} of both parts verified on the PFS",
        )

        # The same checkpoint at 3 ranks: each part from the node's disk if it holds it.
        nodes = ["n1", "n2", "n3"]
        held = {(n, p): t.holds(n, key, p, STEPS) for n in nodes for p in (0, 1)}
        assert held[("n1", 0)] and held[("n3", 1)] and not held[("n2", 1)], held
        load = t.dcp_job(key, ",".join(nodes), t.worker_args("load", key), [])
        t.c.wait_job_state(load, "COMPLETED", timeout=180)
        run3: MultiRun = t.multi(load)
        read = set()
        for rank, node in enumerate(nodes):
            assert run3.hosts(rank) == [node], run3.text
            [res] = run3.resumed(rank)
            assert int(res["step"]) == STEPS, (rank, res, run3.text)
            got = tiers_of(res)
            want = {p: "local" if held[(node, p)] else "pfs" for p in got}
            assert got and got == want, (rank, node, got, held, run3.text)
            read |= set(got.values())
        assert read == {"local", "pfs"}, run3.text
        saved_sd = torch.load(t.out / f"saved-{key}-{STEPS}.pt", weights_only=True)
        loaded_sd = torch.load(t.out / f"loaded-{key}-3.pt", weights_only=True)
        assert saved_sd["optim"]["state"], "the optimizer state was saved (Adam moments)"
        assert equal(saved_sd, loaded_sd) > 30
    finally:
        t.c.run(["scancel", job] + [j for j in (high, load) if j], check=False)
        for p in t._ref_procs:
            if p.poll() is None:
                p.kill()
                p.wait()
