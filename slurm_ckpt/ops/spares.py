"""Spare nodes inside the allocation: which nodes run the step, and which replace a dead one.

``ckpt-srun --spares K`` runs in a batch job submitted with ``N + K`` nodes and
``--no-kill`` (so SLURM keeps the job when one of its nodes dies). The step runs on ``N``
of them; when it fails because a node died, ckpt-srun relaunches it on the surviving
nodes plus a spare, inside the same allocation: no requeue, no wait in the queue.

Why the step's node *order* is pinned: a rank's fast restore is its own node's local
copy, so after a relaunch every surviving rank must land on the node it ran on before,
and only the rank of the dead node moves (to the spare). SLURM sorts a plain
``--nodelist``, which would shift ranks whenever the spare does not sort into the dead
node's place. So the step gets ``--distribution=arbitrary`` with the node list in *slot*
order (slot ``i`` = rank ``i``'s node, one task per node), which srun keeps as given.

What counts as a dead node (SLURM's records, :class:`~slurm_ckpt.slurm.records.NodeInfo`):
its state is ``DOWN`` (or it is no longer in the job's node list, which ``--no-kill``
jobs see after SLURM takes a failed node away), or it carries ``NOT_RESPONDING`` (its
slurmd is gone). A step that fails while all its nodes are up failed by itself: that is
the program's business and is not retried here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, List, Optional, Sequence

from slurm_ckpt.errors import CkptError, UsageError
from slurm_ckpt.slurm.records import NodeInfo

__all__ = [
    "NodeSet",
    "check_srun_args",
    "dead_nodes",
    "is_dead",
    "layout_args",
    "wait_for_dead",
]

#: Base states (or flags) that mean the node's slurmd is gone for the controller.
DEAD_STATES = frozenset({"DOWN", "FUTURE", "POWERED_DOWN", "POWER_DOWN"})
DEAD_FLAGS = frozenset({"NOT_RESPONDING", "POWERED_DOWN", "POWER_DOWN", "POWERING_DOWN"})

#: srun options that choose nodes or the task layout: with spares ckpt-srun sets them.
_LAYOUT_OPTS = (
    "-N",
    "--nodes",
    "-n",
    "--ntasks",
    "-w",
    "--nodelist",
    "-x",
    "--exclude",
    "-m",
    "--distribution",
)


@dataclass
class NodeSet:
    """The step's nodes in slot (rank) order, the spares left, the nodes lost so far."""

    slots: List[str]
    spares: List[str]
    lost: List[str] = field(default_factory=list)

    @classmethod
    def initial(cls, nodes: Sequence[str], spares: int) -> NodeSet:
        """The first ``len(nodes) - spares`` nodes run the step, the rest wait as spares
        (SLURM lists the allocation sorted, so the same job always picks the same)."""
        if spares < 0:
            raise UsageError("--spares must be 0 or more")
        if spares >= len(nodes):
            raise UsageError(
                f"--spares {spares}: the job has {len(nodes)} node(s); submit it with "
                f"N + {spares} nodes (and --no-kill)"
            )
        return cls(list(nodes[: len(nodes) - spares]), list(nodes[len(nodes) - spares :]))

    def replace(self, dead: Iterable[str]) -> Optional[NodeSet]:
        """The node set with every dead slot taken over by a live spare (in the dead
        slot's place, so no other rank moves), or None when the spares do not suffice.
        Dead spares are dropped from the pool first."""
        gone = set(dead)
        pool = [n for n in self.spares if n not in gone]
        slots: List[str] = []
        for node in self.slots:
            if node in gone:
                if not pool:
                    return None
                slots.append(pool.pop(0))
            else:
                slots.append(node)
        lost = self.lost + [n for n in self.slots + self.spares if n in gone]
        return NodeSet(slots, pool, lost)


def check_srun_args(args: Sequence[str]) -> None:
    """UsageError when the user's srun options choose nodes or the task layout: with
    ``--spares`` ckpt-srun does (it must place the ranks itself). Only the options before
    the command are looked at (the first word not starting with ``-`` ends them, as far
    as this check can tell)."""
    for tok in args:
        if not tok.startswith("-"):
            return
        if tok == "--":
            return
        name = tok.split("=", 1)[0]
        short = tok[:2] if not tok.startswith("--") else name
        if name in _LAYOUT_OPTS or short in _LAYOUT_OPTS:
            raise UsageError(
                f"with --spares ckpt-srun places the step's nodes itself: leave out {name} "
                "(-N/--nodes, -n/--ntasks, -w/--nodelist, -x/--exclude, -m/--distribution)"
            )


def layout_args(ns: NodeSet) -> List[str]:
    """srun options that run one task per slot node, rank ``i`` on ``ns.slots[i]``.

    ``--overlap``: a step that lost a node stays RUNNING in the controller on its
    surviving nodes until SLURM declares the node dead (minutes, ``SlurmdTimeout``), and
    even after; a relaunch that waited for those nodes' CPUs would wait with it. The
    step shares the allocation with ckpt-srun's heartbeat agents the same way."""
    return [
        f"--nodes={len(ns.slots)}",
        f"--ntasks={len(ns.slots)}",
        f"--nodelist={','.join(ns.slots)}",
        "--distribution=arbitrary",
        "--overlap",
    ]


def is_dead(info: NodeInfo) -> bool:
    """Whether SLURM's record says this node's slurmd is gone (see the module docstring)."""
    return info.state in DEAD_STATES or bool(DEAD_FLAGS & set(info.flags))


def dead_nodes(
    nodes: Sequence[str],
    node_info: Callable[[str], NodeInfo],
    job_nodes: Optional[Callable[[], Sequence[str]]] = None,
    silent: Optional[Callable[[Sequence[str]], List[str]]] = None,
) -> List[str]:
    """Those of ``nodes`` that are dead now (a node SLURM does not answer for counts as
    alive: a query failing is not a verdict). ``silent(nodes)``: the nodes whose
    heartbeats stopped (:mod:`slurm_ckpt.ops.heartbeat`), dead whatever SLURM says."""
    quiet = set(silent(nodes)) if silent is not None else set()
    in_job: Optional[set] = None
    if job_nodes is not None:
        try:
            listed = set(job_nodes())
            in_job = listed or None  # an empty list: SLURM said nothing useful
        except CkptError:
            in_job = None
    out = []
    for node in nodes:
        if node in quiet or (in_job is not None and node not in in_job):
            out.append(node)
            continue
        try:
            if is_dead(node_info(node)):
                out.append(node)
        except CkptError:
            continue
    return out


def wait_for_dead(
    nodes: Sequence[str],
    node_info: Callable[[str], NodeInfo],
    job_nodes: Optional[Callable[[], Sequence[str]]],
    wait_s: float,
    poll_s: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    silent: Optional[Callable[[Sequence[str]], List[str]]] = None,
) -> List[str]:
    """The dead ones among ``nodes``, asking SLURM until one is found or ``wait_s``
    passed: a step may end (its other ranks' collectives fail) before the controller
    has declared the node dead. Empty: every node is up, the step failed by itself."""
    deadline = clock() + max(0.0, wait_s)
    while True:
        dead = dead_nodes(nodes, node_info, job_nodes, silent)
        if dead or clock() >= deadline:
            return dead
        sleep(min(poll_s, max(0.0, deadline - clock())))
