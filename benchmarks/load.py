#!/usr/bin/env python3
"""Checkpointing under load on the dev cluster: many jobs per node, on every node, each
saving as often as it can.

Why: one job saving alone says little about a node where four jobs share the NVMe and
every node flushes to one PFS. Under load the per-node ledger, the step locks and
``ckpt-slurm status`` see the most contention; ``tests/test_load_cluster.py`` checks that
they stay correct (with a short run of this same load), this script measures.

Method: a *saver* job (``load.py saver``, run through ``ckpt-srun`` as an unprivileged
user, with the site hooks as Prolog/Epilog) saves a ``--size`` state through the
Checkpointer at every step (``interval_steps=1``, every save flushed) for ``--seconds``,
timing each ``save()`` call (its stall: snapshot plus any backpressure wait). First one
saver alone on one node (the baseline), then ``--per-node`` savers on each node at once,
in the same run. Reported, loaded against alone:

* saves/s, per job and summed over all jobs;
* flush throughput (bytes verified on the PFS per second), per job and summed;
* p99 (and median) of the ``save()`` stall.

::

    DEV_CLUSTER_DIR=... python benchmarks/load.py --per-node 2 --seconds 120
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
SAVER_KEY_PREFIX = "load"


# --------------------------------------------------------------------------- the job
def saver(argv: List[str]) -> int:
    """Inside a job: save as fast as possible for N seconds, write the figures as JSON."""
    import numpy as np

    from slurm_ckpt import Checkpointer

    key, seconds, size, out = argv[0], float(argv[1]), int(argv[2]), argv[3]
    ckpt = Checkpointer.from_env(key=key, interval_steps=1, signals=[], flush_every=1)
    w = np.random.default_rng(0).standard_normal(max(1, size // 4), dtype=np.float32)
    state = {"model": {"w": w}, "step": 0}
    stalls: List[float] = []
    t0 = time.monotonic()
    step = 0
    while time.monotonic() - t0 < seconds:
        step += 1
        w[0] = step
        state["step"] = step
        s0 = time.perf_counter()
        ckpt.save(state, step=step)
        stalls.append(time.perf_counter() - s0)
    saving = time.monotonic() - t0
    stats = ckpt.close()
    wall = time.monotonic() - t0
    doc = {
        "key": key,
        "node": os.environ.get("SLURMD_NODENAME"),
        "job": os.environ.get("SLURM_JOB_ID"),
        "saves": step,
        "saving_s": saving,
        "wall_s": wall,
        "stalls": stalls,
        "committed": stats.committed,
        "failures": stats.failures,
        "flushes": stats.flushes,
        "flush_failures": stats.flush_failures,
        "flush_skipped": stats.flush_skipped,
        "bytes_written": stats.bytes_written,
        "bytes_flushed": stats.bytes_flushed,
        "last_step": stats.last_step,
        "last_flushed_step": stats.last_flushed_step,
    }
    tmp = out + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(doc, fh)
    os.replace(tmp, out)
    print(f"SAVER {key} saves={step} flushed={stats.flushes} failures={stats.failures}")
    return 0


# --------------------------------------------------------------------------- the driver
class Load:
    """Savers on the dev cluster, through the e2e test site (hooks, private tiers)."""

    def __init__(self, site: Any) -> None:
        self.site = site
        self.script = site.dir / "load_saver.py"
        shutil.copyfile(Path(__file__), self.script)
        os.chmod(self.script, 0o644)
        self.results = site.dir / "load-results"
        self.results.mkdir(mode=0o777, exist_ok=True)
        os.chmod(self.results, 0o777)
        self.jobs: List[str] = []

    def submit(self, key: str, node: str, seconds: float, size: int) -> str:
        from test_cluster_e2e import CKPT_SRUN, PY

        out = self.results / f"{key}.json"
        body = (
            f"exec {CKPT_SRUN} --key {key} --warn 0 -- -n1 "
            f"{PY} {self.script} saver {key} {seconds} {size} {out}\n"
        )
        job = self.site.job(body, args=["-w", node, "-n1"])
        self.jobs.append(job)
        return job

    def run(
        self, nodes: List[str], per_node: int, seconds: float, size: int, tag: str
    ) -> List[Dict[str, Any]]:
        """Submit ``per_node`` savers on each node at once; wait; their figures."""
        keys = []
        for node in nodes:
            for i in range(per_node):
                key = f"{SAVER_KEY_PREFIX}-{tag}-{node}-{i}"
                keys.append((key, self.submit(key, node, seconds, size)))
        out = []
        for key, job in keys:
            self.site.c.wait_job_state(job, "COMPLETED", timeout=seconds + 300)
            path = self.results / f"{key}.json"
            doc = json.loads(path.read_text())
            doc["job"] = job
            out.append(doc)
        return out


def p99(xs: List[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))] if xs else 0.0


def summary(docs: List[Dict[str, Any]]) -> Dict[str, float]:
    stalls = [s for d in docs for s in d["stalls"]]
    saves = sum(d["saves"] for d in docs)
    return {
        "jobs": len(docs),
        "saves": saves,
        "saves_per_s": sum(d["saves"] / d["saving_s"] for d in docs),
        "saves_per_s_per_job": statistics.mean(d["saves"] / d["saving_s"] for d in docs),
        "flush_MBps": sum(d["bytes_flushed"] / d["wall_s"] for d in docs) / 1e6,
        "flush_MBps_per_job": statistics.mean(d["bytes_flushed"] / d["wall_s"] for d in docs) / 1e6,
        "stall_p99_ms": p99(stalls) * 1e3,
        "stall_median_ms": statistics.median(stalls) * 1e3 if stalls else 0.0,
        "failures": sum(d["failures"] + d["flush_failures"] for d in docs),
    }


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "saver":
        return saver(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--per-node", type=int, default=2, help="concurrent saver jobs per node")
    p.add_argument("--seconds", type=float, default=90.0, help="how long each job saves")
    p.add_argument(
        "--size",
        type=int,
        default=256 << 10,
        help="state bytes per checkpoint (every one is kept on the PFS: jobs x saves x size "
        "must fit the dev cluster's 2 GiB PFS, or the flushes fail with ENOSPC)",
    )
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    # The driver uses the cluster test fixtures (a saver job must not: its copy of this
    # file sits in a shared directory, which must not shadow installed packages).
    for path in (REPO, REPO / "tests", REPO / "benchmarks"):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    from helpers.cluster import start_cluster
    from test_cluster_e2e import E2E, hooked_site

    cluster = start_cluster()
    site = E2E(cluster)
    with hooked_site(site):
        site.configure(
            hooks={"stage_on_requeue": False},
            retention={"keep_local": 2, "flush_every": 1},
            tiers_local={"min_free": "16MiB"},
        )
        load = Load(site)
        t0 = time.monotonic()
        alone = summary(load.run(cluster.nodes[:1], 1, args.seconds, args.size, "alone"))
        loaded = summary(load.run(cluster.nodes, args.per_node, args.seconds, args.size, "loaded"))
        took = time.monotonic() - t0
    rows = [
        ("saves/s, all jobs", "saves_per_s"),
        ("saves/s per job", "saves_per_s_per_job"),
        ("flush MB/s, all jobs", "flush_MBps"),
        ("flush MB/s per job", "flush_MBps_per_job"),
        ("save() stall p99 (ms)", "stall_p99_ms"),
        ("save() stall median (ms)", "stall_median_ms"),
    ]
    print(
        f"load: {args.per_node} job(s) x {len(cluster.nodes)} node(s) vs 1 job alone, "
        f"{args.seconds:g} s each, {args.size / 2**20:g} MiB per checkpoint ({took:.0f} s)"
    )
    print(f"{'figure':28} {'alone':>10} {'loaded':>10} {'ratio':>7}")
    for label, k in rows:
        ratio = loaded[k] / alone[k] if alone[k] else float("nan")
        print(f"{label:28} {alone[k]:10.2f} {loaded[k]:10.2f} {ratio:7.2f}")
    print(f"failed saves or flushes: alone {alone['failures']}, loaded {loaded['failures']}")
    if args.json:
        from claims import claim  # benchmarks/claims.py: the shape benchmarks/report reads

        def ratio(k: str) -> List[float]:
            return [loaded[k] / alone[k]] if alone[k] else []

        setup = f"{args.per_node} jobs x {len(cluster.nodes)} nodes"
        claims = [
            claim(
                "load-saves-per-job",
                ratio("saves_per_s_per_job"),
                what=f"saves/s of one job among {setup}, every save flushed",
                baseline="the same job saving alone",
                cmp=">=",
            ),
            claim(
                "load-flush-per-job",
                ratio("flush_MBps_per_job"),
                what=f"flush MB/s of one job among {setup}",
                baseline="the same job flushing alone",
                cmp=">=",
            ),
            claim(
                "load-stall-p99",
                ratio("stall_p99_ms"),
                what=f"p99 save() stall among {setup}",
                baseline="p99 save() stall of the job alone",
            ),
        ]
        doc = {"alone": alone, "loaded": loaded, "args": vars(args), "claims": claims}
        args.json.write_text(json.dumps(doc, default=str, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
