"""``ckpt-srun --spares``: which nodes run the step, which replace a dead one, what counts
as dead (:mod:`slurm_ckpt.ops.spares`), and its bad inputs. The relaunch itself, on the
real dev cluster, is tests/test_cluster_spares.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from slurm_ckpt.errors import SlurmError, UsageError
from slurm_ckpt.ops.spares import (
    NodeSet,
    check_srun_args,
    dead_nodes,
    is_dead,
    layout_args,
    wait_for_dead,
)
from slurm_ckpt.slurm.records import NodeInfo, node_from_oneliner, parse_oneliner
from slurm_ckpt.slurm.requeue import NODE_LOST, requeue_reason

REPO = Path(__file__).resolve().parents[1]


def node(line: str) -> NodeInfo:
    """A record as ``scontrol -o show node`` prints it."""
    return node_from_oneliner(parse_oneliner(line))


def test_initial_node_set_keeps_the_last_nodes_as_spares() -> None:
    ns = NodeSet.initial(["n1", "n2", "n3", "n4"], 1)
    assert (ns.slots, ns.spares, ns.lost) == (["n1", "n2", "n3"], ["n4"], [])
    assert layout_args(ns) == [
        "--nodes=3",
        "--ntasks=3",
        "--nodelist=n1,n2,n3",
        "--distribution=arbitrary",
        "--overlap",
    ]


def test_a_spare_takes_the_dead_nodes_place_and_no_other_rank_moves() -> None:
    ns = NodeSet.initial(["n1", "n2", "n3", "n4", "n5"], 2)
    after = ns.replace(["n2"])
    assert after is not None
    assert (after.slots, after.spares, after.lost) == (["n1", "n4", "n3"], ["n5"], ["n2"])
    # the arbitrary distribution keeps that order: rank 1 on n4, rank 2 still on n3
    assert "--nodelist=n1,n4,n3" in layout_args(after)
    again = after.replace(["n1"])
    assert again is not None
    assert (again.slots, again.spares, again.lost) == (["n5", "n4", "n3"], [], ["n2", "n1"])
    assert again.replace(["n3"]) is None  # no spare left: the requeue path


def test_a_dead_spare_is_not_used() -> None:
    ns = NodeSet.initial(["n1", "n2", "n3", "n4"], 2)
    after = ns.replace(["n1", "n3"])  # n3 was the first spare
    assert after is not None
    assert (after.slots, after.spares) == (["n4", "n2"], [])
    assert ns.replace(["n1", "n2", "n3"]) is None


@pytest.mark.parametrize("spares,nodes", [(1, 1), (3, 3), (4, 2)])
def test_more_spares_than_the_job_has_is_a_usage_error(spares: int, nodes: int) -> None:
    with pytest.raises(UsageError, match="submit it with N"):
        NodeSet.initial([f"n{i}" for i in range(1, nodes + 1)], spares)


@pytest.mark.parametrize(
    "args",
    [
        ["-N3", "python", "t.py"],
        ["--nodes=3", "python"],
        ["--label", "-w", "n1", "python"],
        ["--nodelist=n1", "python"],
        ["-x", "n2", "python"],
        ["--exclude=n2", "python"],
        ["-n", "3", "python"],
        ["--ntasks=3", "python"],
        ["-m", "block", "python"],
        ["--distribution=cyclic", "python"],
    ],
)
def test_srun_options_that_place_nodes_are_refused(args: List[str]) -> None:
    with pytest.raises(UsageError, match="places the step's nodes itself"):
        check_srun_args(args)


def test_other_srun_options_and_the_programs_own_options_pass() -> None:
    check_srun_args(["--label", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "python", "-N3"])
    check_srun_args(["bash", "-c", "python t.py -n 4"])


@pytest.mark.parametrize(
    "state,dead",
    [
        ("IDLE", False),
        ("MIXED", False),
        ("ALLOCATED", False),
        ("ALLOCATED+DRAIN", False),  # drained: still up, running its jobs
        ("DOWN", True),
        ("DOWN+NOT_RESPONDING", True),
        ("ALLOCATED+NOT_RESPONDING", True),  # slurmd gone, not yet declared DOWN
        ("MIXED*", False),  # the '*' suffix of sinfo is not scontrol's flag
        ("IDLE+POWERED_DOWN", True),
    ],
)
def test_what_counts_as_a_dead_node(state: str, dead: bool) -> None:
    assert is_dead(node(f"NodeName=n2 Arch=x86_64 State={state} Reason=none")) is dead


def test_dead_nodes_also_counts_nodes_slurm_took_out_of_the_job() -> None:
    infos: Dict[str, NodeInfo] = {n: node(f"NodeName={n} State=ALLOCATED") for n in "abc"}
    assert dead_nodes(["a", "b", "c"], infos.__getitem__, lambda: ["a", "c"]) == ["b"]
    assert dead_nodes(["a", "b", "c"], infos.__getitem__, lambda: []) == []  # no answer

    def failing(name: str) -> NodeInfo:
        raise SlurmError("controller timeout")

    # A query that fails is no verdict: the node counts as alive.
    assert dead_nodes(["a"], failing, None) == []


def test_wait_for_dead_stops_at_the_verdict_or_the_deadline() -> None:
    now = [0.0]
    states = {"n1": "ALLOCATED", "n2": "ALLOCATED"}
    asked: List[float] = []

    def info(name: str) -> NodeInfo:
        asked.append(now[0])
        return node(f"NodeName={name} State={states[name]}")

    def sleep(s: float) -> None:
        now[0] += s
        if now[0] >= 3:
            states["n2"] = "DOWN+NOT_RESPONDING"

    got = wait_for_dead(["n1", "n2"], info, None, 10.0, clock=lambda: now[0], sleep=sleep)
    assert got == ["n2"] and now[0] == 3.0
    states["n2"] = "ALLOCATED"
    now[0] = 100.0

    def tick(s: float) -> None:
        now[0] += s

    assert wait_for_dead(["n1"], info, None, 2.5, clock=lambda: now[0], sleep=tick) == []
    assert now[0] == pytest.approx(102.5)


def test_no_spare_left_requeues_within_the_limit() -> None:
    why = requeue_reason(NODE_LOST, restarts=0, max_requeues=3, detail="node n2 lost")
    assert why == "no spare left (node n2 lost): requeueing (restart 1)"
    assert requeue_reason(NODE_LOST, restarts=3, max_requeues=3) is None
    assert requeue_reason(NODE_LOST, enabled=False) is None
    assert requeue_reason("FAILED") is None  # the program's own failure: never


def _ckpt_srun(args: List[str], env: Dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "slurm_ckpt.cli.srun", *args],
        env=env,
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--spares", "2", "--", "python", "t.py"], "the job has 2 node(s)"),
        (["--spares", "1", "--", "-N2", "python", "t.py"], "leave out -N"),
        (["--spares", "-1", "--", "python"], "--spares"),
    ],
)
def test_ckpt_srun_spares_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, args: List[str], fragment: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    env.update(
        PYTHONPATH=str(REPO),
        SLURM_JOB_ID="77",
        SLURM_JOB_NODELIST="n[1-2]",
        SLURM_NNODES="2",
        SLURM_CKPT_CONFIG=str(tmp_path / "none.toml"),
    )
    proc = _ckpt_srun(["--key", "k", "--no-flush", *args], env)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.splitlines()
    assert err and err[-1].startswith("ckpt-srun: error: ") and fragment in err[-1], err
    assert "Traceback" not in proc.stderr
