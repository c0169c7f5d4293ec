"""``python -m tests.faults``: the fault campaign as one command.

::

    python -m tests.faults --runs 20 --seed 1234            # every scenario, 20 runs each
    python -m tests.faults --runs 2 --scenarios eio-pfs,damage
    python -m tests.faults --runs 20 --scenarios node-loss --out /tmp/nl     # one scenario
    python -m tests.faults --merge /tmp/nl                 # ... into the figures in --out

Needs root (mounts, FUSE, users) and the SLURM dev cluster (``DEV_CLUSTER_DIR`` and
``DEV_CLUSTER_PORT`` choose which one; it is brought up if it is not running). Runs the
package installed in ``$SLURM_CKPT_VENV`` (default /opt/slurm-ckpt/venv), as the cluster's
jobs and hooks do. Writes ``FIGURES.md`` and ``figures.json`` to ``--out``. Exit status 1
when any invariant was violated or a run broke down.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable, Collection, Dict, List, Optional

REPO = Path(__file__).resolve().parents[2]
for p in (REPO, REPO / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from tests.faults.campaign import (  # noqa: E402
    figures,
    markdown,
    merge_figures,
    run_one,
    write_figures,
)
from tests.faults.scenarios import SCENARIOS  # noqa: E402

DEFAULT_OUT = REPO / "tests" / "faults" / "results"


def campaign(
    runs: int,
    seed: int,
    names: List[str],
    out: Optional[Path],
    say: Callable[[str], Any] = print,
    nodes: Optional[List[str]] = None,
    run_seed: Optional[int] = None,
    skip: Collection[str] = (),
) -> Dict[str, Any]:
    """Run ``runs`` runs of each scenario in ``names``; returns the figures. ``nodes``:
    the dev-cluster nodes whose names (drains, DOWN) the runs use (default: the last
    three; the partner scenarios use three, the others one or two). ``skip``: scenarios
    of ``names`` not run, their seeds drawn all the same, so that leaving one out
    changes no other run's seed."""
    from helpers.cluster import start_cluster

    if os.geteuid() != 0:
        raise SystemExit("tests.faults: run as root (mounts, FUSE, users, SLURM drains)")
    cluster = start_cluster()
    nodes = nodes or cluster.nodes[-3:]
    say(
        f"fault campaign: seed {seed}, {runs} run(s) x "
        f"{len([n for n in names if n not in skip])} scenario(s), "
        f"nodes {','.join(nodes)} of {cluster.state_dir}"
    )
    master = random.Random(seed)
    results = []
    for name in names:
        setup, body = SCENARIOS[name]
        for i in range(runs):
            this_seed = master.randrange(2**32) if run_seed is None else run_seed
            if name in skip:
                continue
            t0 = time.monotonic()
            res = run_one(name, body, setup, i, this_seed, cluster.env, nodes)
            bad = len(res.violations) + (1 if res.error else 0)
            say(
                f"  {name} #{i} seed={this_seed}: {sum(res.faults.values())} fault(s), "
                f"{res.restarts} restart(s), lost {res.lost}, "
                f"{'OK' if not bad else 'FAILED'} ({time.monotonic() - t0:.1f}s)"
            )
            for n in res.notes:
                say(f"    {n}")
            for v in res.violations:
                say(f"    VIOLATION {v}")
            if res.violations and res.hook_log:
                say("    hooks: " + res.hook_log.replace("\n", "\n    hooks: "))
            if res.error:
                say("    ERROR " + res.error.replace("\n", "\n    "))
            results.append(res)
    fig = figures(results, seed, runs)
    if out is not None:
        write_figures(fig, results, out)
    fig["results"] = results
    return fig


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.faults", description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=20, help="runs per scenario")
    p.add_argument("--seed", type=int, default=1234, help="master seed (printed, reproducible)")
    p.add_argument("--scenarios", default="", help="comma-separated names (default: all)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where FIGURES.md goes")
    p.add_argument("--nodes", default="", help="three dev-cluster nodes (default: last three)")
    p.add_argument("--run-seed", type=int, help="replay one run: its seed (from a report)")
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    p.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        metavar="DIR",
        help="run nothing: put the runs in these campaign outputs in place of their "
        "scenarios' runs in --out (FIGURES.md says where each scenario's figures come from)",
    )
    args = p.parse_args(argv)
    if args.list:
        print("\n".join(SCENARIOS))
        return 0
    if args.merge:
        missing = [d for d in [args.out, *args.merge] if not (d / "figures.json").is_file()]
        if missing:
            print(f"tests.faults: error: no figures.json in {missing[0]}", file=sys.stderr)
            return 2
        print(markdown(merge_figures(args.out, args.merge, "the earlier full run")))
        return 0
    names = [n for n in args.scenarios.split(",") if n] or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        print(f"tests.faults: error: unknown scenario(s) {', '.join(unknown)}", file=sys.stderr)
        return 2
    if args.runs < 1:
        print("tests.faults: error: --runs must be at least 1", file=sys.stderr)
        return 2
    nodes = [n for n in args.nodes.split(",") if n] or None
    fig = campaign(args.runs, args.seed, names, args.out, nodes=nodes, run_seed=args.run_seed)
    print(markdown(fig))
    return 1 if fig["violations"] or fig["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
