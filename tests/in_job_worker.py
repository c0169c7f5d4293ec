"""A rank (or hot spare) that speaks only the membership protocol, for ckpt-srun's
in-job cluster tests of the launcher's side (no torch: the re-form of a process group is
the job layer's business, tested on its own).

* A rank (``RANK`` set) prints ``PID pid=P node=N rank=R``, then runs ``--steps`` steps
  of ``--step-s`` seconds. Between steps it reads the newest epoch: a new one is printed
  (``EPOCH n lost=[..]``); a process no longer in it is fenced and exits 3 (``FENCED``).
  At the end it writes ``rank-<r>.done`` and prints ``DONE rank=R pid=P``.
* A hot spare (``SLURM_CKPT_SPARE=1``) writes ``spare-<task>.json``, prints
  ``SPARE task=T pid=P node=N`` and waits: for ``end.json`` (prints ``SPARE_EXIT``,
  exits 0) or for an epoch naming its task, when it prints ``JOINED rank=R epoch=n`` and
  runs the steps that rank has left (``--spare-steps``) as that rank.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

from slurm_ckpt.core.membership import RecoveryDir, Spare, task_from_env


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def run_rank(rd: RecoveryDir, rank: int, task: int, steps: int, step_s: float) -> int:
    seen = -1
    for _ in range(steps):
        ep = rd.newest_epoch()
        if ep is not None and ep.epoch != seen:
            seen = ep.epoch
            say(f"EPOCH {ep.epoch} lost={list(ep.lost)}")
            if not ep.has(rank, task):
                say(f"FENCED rank={rank} task={task}")
                return 3
        time.sleep(step_s)
    rd.mark_done(rank)
    say(f"DONE rank={rank} pid={os.getpid()}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--spare-steps", type=int, default=20)
    p.add_argument("--step-s", type=float, default=0.5)
    args = p.parse_args()
    rd = RecoveryDir.from_env()
    task = task_from_env()
    node = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    if rd is None or task is None:
        say("no recovery directory or task number")
        return 2
    pid = os.getpid()
    if os.environ.get("SLURM_CKPT_SPARE") == "1":
        rd.write_spare(Spare(task, "127.0.0.1", pid))
        say(f"SPARE task={task} pid={pid} node={node}")
        while True:
            if rd.ended():
                say("SPARE_EXIT")
                return 0
            ep = rd.newest_epoch()
            rank = ep.rank_of(task) if ep is not None else None
            if ep is not None and rank is not None:
                say(f"JOINED rank={rank} epoch={ep.epoch} pid={pid} node={node}")
                return run_rank(rd, rank, task, args.spare_steps, args.step_s)
            time.sleep(0.1)
    rank = int(os.environ["RANK"])
    say(f"PID pid={pid} node={node} rank={rank} world={os.environ.get('WORLD_SIZE')}")
    return run_rank(rd, rank, task, args.steps, args.step_s)


if __name__ == "__main__":
    sys.exit(main())
