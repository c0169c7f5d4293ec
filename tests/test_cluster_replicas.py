"""Replicas agree, on the real SLURM dev cluster (issue 34, "must show").

A real 2-node DDP job (two ranks per node, gloo, ``Checkpointer.from_env(replicas=True)``
under ``ckpt-srun``, the site hooks as Prolog/Epilog) saves every step; just before the
save of step 6 the last rank - on the second node - flips one bit of one parameter in
memory (tests/replica_worker.py's test hook, silent data corruption as a GPU makes it).
Then:

* every rank is told on its training thread (``on_suspect``) that step 6 is suspect,
  naming rank 3 and the node it ran on, and the job stops;
* every rank's manifest of step 6 (on its node's local tier) records the verdict;
* the next job on the same nodes restores step 5 on every rank: the step before the
  flip, passing over the suspect ones;
* each node's metrics textfile, written by root's hooks as node_exporter reads it,
  counts the suspect steps once each (not once per rank), from the manifests root's
  scan read - and the next job's prolog and epilog, scanning them again, add nothing.

Every wait polls SLURM or the job's output; nothing sleeps for a fixed time.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import pytest
from helpers.cluster import DevCluster, at_least_nodes
from prometheus_client.parser import text_string_to_metric_families
from test_cluster_e2e import CKPT_SLURM, CKPT_SRUN, E2E, PY, hooked_site
from test_torch_distributed import free_port

from slurm_ckpt.errors import NotFound
from slurm_ckpt.ledger.metrics import TEXTFILE_NAME

pytestmark = pytest.mark.root

USER = "ckptuser1"
WORKER = Path(__file__).with_name("replica_worker.py")
_LABEL = re.compile(r"^\s*(\d+): (.*)$")
PROM_DIR = ".metrics"


class ReplicaSite(E2E):
    """The e2e site (hooks, private tiers, config) plus the replica worker, readable by
    the job user in a directory without a slurm_ckpt tree (the venv's package runs)."""

    def __init__(self, cluster: DevCluster) -> None:
        super().__init__(cluster)
        self.worker = self.dir / "replica_worker.py"
        shutil.copyfile(WORKER, self.worker)
        os.chmod(self.worker, 0o644)
        # Root's hooks write each node's textfile below that node's local root (a
        # hidden name: no user's directory). Every step stays on the local tier until
        # the epilog's scan: the suspect ones too.
        self.configure(
            metrics={"textfile_dir": str(self.local_root / PROM_DIR)},
            retention={"keep_local": 100},
        )

    def node_metrics(self, node: str) -> Dict[str, float]:
        """``node``'s textfile (the root-written file node_exporter serves), read with
        prometheus' own parser: the suspect-steps counter and the epilog's last run."""
        path = self.local_dir(node) / PROM_DIR / TEXTFILE_NAME
        out: Dict[str, float] = {}
        if not path.exists():
            return out
        for fam in text_string_to_metric_families(path.read_text()):
            for s in fam.samples:
                if s.labels.get("node") != node:
                    continue
                if s.name == "slurm_ckpt_suspect_steps_total":
                    out["suspect"] = s.value
                if s.name == "slurm_ckpt_hook_last_run_timestamp_seconds" and (
                    s.labels.get("hook") == "epilog"
                ):
                    out["epilog"] = s.value
        return out

    def suspect_after_epilog(self, node: str, since: float) -> float:
        """The node's suspect-steps counter once its textfile holds an epilog run
        that started after ``since`` (the hook rewrites the file after its log line)."""

        def done() -> Optional[Dict[str, float]]:
            m = self.node_metrics(node)
            return m if m.get("epilog", 0.0) >= since and "suspect" in m else None

        got = self.c.wait_until(done, timeout=60, what=f"{node}'s textfile")
        assert isinstance(got, dict)
        return float(got["suspect"])

    def ddp_job(self, key: str, nodes: str, *worker_args: str) -> str:
        """Two ranks on each of the two ``nodes``; ``srun --label`` prefixes each rank's
        lines with its rank, and each rank first says where it runs (``HOST``)."""
        body = (
            f"export MASTER_ADDR=127.0.0.1 MASTER_PORT={free_port()}\n"
            f"exec {CKPT_SRUN} --key {key} --warn 0 -- -N2 --ntasks-per-node=2 --label "
            'bash -c \'echo "HOST rank=$SLURM_PROCID node=$SLURMD_NODENAME"; '
            f"exec {PY} {self.worker} --key {key} {' '.join(worker_args)}'\n"
        )
        return self.job(body, args=["-N", "2", "--ntasks-per-node=2", "-w", nodes])

    def rank_lines(self, jobid: str) -> Dict[int, List[str]]:
        out: Dict[int, List[str]] = {}
        for line in self.c.job_output(jobid).splitlines():
            m = _LABEL.match(line)
            if m:
                out.setdefault(int(m.group(1)), []).append(m.group(2))
        return out

    def finished(self, jobid: str) -> Dict[int, List[str]]:
        try:
            self.c.wait_job_state(jobid, "COMPLETED", timeout=300)
        except AssertionError as exc:  # say why, without ckpt-srun's flush lines
            text = self.c.job_output(jobid).splitlines()
            kept = "\n".join(ln for ln in text if "already on the PFS" not in ln)
            raise AssertionError(f"{exc}\n{kept[-8000:]}") from None
        return self.rank_lines(jobid)


@pytest.fixture(scope="module")
def site(slurm_cluster: DevCluster) -> Iterator[ReplicaSite]:
    with at_least_nodes(slurm_cluster, 2):
        s = ReplicaSite(slurm_cluster)
        with hooked_site(s):
            yield s


def _meta_anywhere(site: ReplicaSite, node: str, series: str, step: int) -> Dict:
    """A step's manifest meta from the node's local tier, else from the PFS."""
    for tier in (site.tier("local", node), site.tier("pfs")):
        try:
            return dict(tier.manifest(USER, series, step).meta)
        except NotFound:
            continue
    raise AssertionError(f"{series} step {step} is on no tier")


def _starts(lines: List[str], prefix: str) -> List[str]:
    return [ln for ln in lines if ln.startswith(prefix)]


def test_a_flipped_bit_on_one_node_is_named_and_the_restore_takes_the_step_before(
    site: ReplicaSite,
) -> None:
    nodes = ",".join(site.c.nodes[:2])
    key = "ddp-flip"
    t_first = time.time()
    job = site.ddp_job(
        key, nodes, "--steps 40 --flip-at 6 --flip-rank 3 --stop-on-suspect --hidden 32"
    )
    ranks = site.finished(job)
    assert sorted(ranks) == [0, 1, 2, 3], site.c.job_output(job)
    where = {r: _starts(lines, "HOST ")[0].split("node=", 1)[1] for r, lines in ranks.items()}
    assert where[2] == where[3] != where[0] == where[1], where  # two ranks on each node
    assert _starts(ranks[3], "FLIPPED ") == ["FLIPPED step=6"]
    for lines in ranks.values():
        told = _starts(lines, "SUSPECT ")
        assert told and told[0] == f"SUSPECT step=6 ranks=3 nodes={where[3]}", lines
        assert _starts(lines, "STOPPED "), lines
    # the verdict is in every rank's manifest of step 6 (on its node, or on the PFS
    # once the epilog flushed it and the node's copy went); step 5 was compared and fine
    for r in range(4):
        series = f"{key}.rank{r:05d}"
        rep = _meta_anywhere(site, where[r], series, 6)["replicas"]
        assert rep["suspect"] is True, rep
        assert (rep["ranks"], rep["nodes"]) == ([3], [where[3]]), rep
        before = _meta_anywhere(site, where[r], series, 5)["replicas"]
        assert before == {"checked": 1, "suspect": False}, before
    # each node's metric, from root's hooks (the job's own events go to the user's
    # log): the suspect steps its local tier holds, once each - two ranks per node
    counted = _suspect_metrics(site, job, t_first, key, where)
    assert counted[where[3]] >= 1, counted
    # list and status (root on the host, the site's config) read the flushed manifests
    rows = json.loads(_ckpt(site, "list", key, "-u", USER, "--json"))["checkpoints"]
    bad = {x["step"] for x in rows if x.get("suspect")}
    assert 6 in bad and 5 not in bad, rows
    jobs = json.loads(_ckpt(site, "status", "--json", "--no-slurm", "-k", key))["jobs"]
    assert any(f"rank(s) 3 on {where[3]}" in (j.get("suspect") or "") for j in jobs), jobs
    # the next job restores the step before the flip on every rank
    t_again = time.time()
    again_job = site.ddp_job(key, nodes, "--restore-only --hidden 32")
    again = site.finished(again_job)
    for lines in again.values():
        resumed = _starts(lines, "RESUMED ")
        assert resumed and resumed[0].startswith("RESUMED step=5 "), json.dumps(again)
    # that job's prolog and epilog scanned the same manifests again: nothing new counted
    assert _suspect_metrics(site, again_job, t_again, key, where) == counted


def _ckpt(site: ReplicaSite, *args: str) -> str:
    r = subprocess.run(
        [str(CKPT_SLURM), *args],
        env=dict(site.c.env, SLURM_CKPT_CONFIG=str(site.config)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def _suspect_metrics(
    site: ReplicaSite, job: str, since: float, key: str, where: Dict[int, str]
) -> Dict[str, float]:
    """After ``job``'s epilog on each node: its metric, checked against the suspect
    steps of the node's ranks' manifests on its local tier (step 6 among them)."""
    out: Dict[str, float] = {}
    for node in sorted(set(where.values())):
        site.wait_hook("epilog", job, node)
        local = site.tier("local", node)
        steps = set()
        for r in (r for r, n in where.items() if n == node):
            series = f"{key}.rank{r:05d}"
            for info in local.steps(USER, series):
                if info.manifest.meta.get("replicas", {}).get("suspect"):
                    steps.add(info.step)
        assert 6 in steps, (node, steps)
        out[node] = site.suspect_after_epilog(node, since)
        assert out[node] == len(steps), (node, out[node], sorted(steps))
    return out
