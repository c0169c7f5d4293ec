"""The one all-reduce the toolkit needs across training ranks: small integers, MIN or MAX.

Ranks must take the same checkpoint decisions: restore agrees on the newest step every
rank has (MIN), and the torch wrapper saves at the same step boundary once any rank wants
to or got a signal (MAX). torch is never imported here: if the training script has not
imported it, there is no process group to talk to.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, List, Optional, Sequence

__all__ = ["all_reduce_ints", "dist_agree", "process_group", "run_launch"]


def run_launch() -> Optional[str]:
    """This launch of the job's ranks, the same for every rank of it: the SLURM job, its
    requeue count, the job step and ckpt-srun's relaunch count; None outside SLURM. A
    multi-rank save records it in its manifest (``meta["launch"]``), so that a restore
    without an agreement function can tell a step another rank of this very launch has
    already saved (it started first) from one of an earlier launch."""
    env = os.environ.get
    job = env("SLURM_JOB_ID", "")
    if not job:
        return None
    restart, step = env("SLURM_RESTART_COUNT", "0"), env("SLURM_STEP_ID", "")
    return f"{job}.{restart}.{step}.{env('SLURM_CKPT_RELAUNCH', '0')}"


def process_group() -> Optional[Any]:
    """``torch.distributed`` when it is initialised with more than one rank, else None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist if dist.get_world_size() > 1 else None


def all_reduce_ints(values: Sequence[int], op: str, group: Any = None) -> List[int]:
    """``values`` reduced element-wise over all ranks (or the ranks of ``group``, a
    subgroup) with ``op`` ("min" or "max"); the values themselves when there is no
    process group."""
    dist = process_group()
    if dist is None:  # one rank in the world: no subgroup has more
        return [int(v) for v in values]
    torch = sys.modules["torch"]
    device = "cpu"
    if dist.get_backend(group) == "nccl":  # pragma: no cover - needs GPUs
        device = f"cuda:{torch.cuda.current_device()}"
    t = torch.tensor([int(v) for v in values], dtype=torch.int64, device=device)
    reduce_op = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]
    dist.all_reduce(t, op=reduce_op, group=group)
    return [int(x) for x in t.tolist()]


def dist_agree() -> Optional[Callable[[int], int]]:
    """A min-reduce over the ranks, or None without a process group."""
    if process_group() is None:
        return None
    return lambda value: all_reduce_ints([value], "min")[0]
