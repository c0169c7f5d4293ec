#!/usr/bin/env python3
"""DDP training that survives a node loss inside the job: ``slurm_ckpt.torch.recovery()``.

Copy this script and put your own model, data and step in ``build``, ``batch`` and
``train_step``. When a node dies, the surviving ranks keep their processes and their
state in memory, a hot spare takes the lost rank's place and its state from the
partner's memory, and training goes on, losing at most the step in flight
(docs/in-job-recovery.md).

On a SLURM cluster, 3 training nodes and 1 hot spare (``--no-kill``: the job outlives a
node; the tiers come from the site config)::

    #!/bin/bash
    #SBATCH -N 4 --no-kill
    exec ckpt-srun --key my-run --spares 1 --in-job -- --ntasks-per-node=1 \\
        python recovery_ddp.py --steps 1000

ckpt-srun starts one task per node, the last one as the hot spare
(``SLURM_CKPT_SPARE=1``: the same script, waiting inside ``recovery()``), watches the
nodes' heartbeats and, when a node is lost, writes the next membership with the spare in
its place.

On a laptop, without SLURM::

    python examples/recovery_ddp.py --laptop

starts 2 ranks and 1 hot spare as local processes (gloo on 127.0.0.1, each "node" its
own directory under ``--work``, a temporary directory by default), SIGKILLs rank 1 after
step ``--kill-at`` and plays ckpt-srun's part: it declares the rank lost
(``slurm_ckpt.core.membership.Coordinator``), the spare takes it, the survivor keeps its
process. The last lines::

    RANK 0 pid=P recovered=[{"epoch": 1, "step": S, "tier": "ram", "recomputed": 0}]
    RANK 1 pid=Q started={"step": S, "tier": "partner-ram"}
    RESULT ok digest=<sha256 of the final weights, the same on every rank>

(exit status 0; ``--kill-at 0``: no failure and no spare, the digest of an
uninterrupted run, which is the same.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:  # runnable from a checkout without installing
    sys.path.insert(0, _REPO)

import slurm_ckpt.torch as sct  # noqa: E402
from slurm_ckpt import Checkpointer, RamOptions  # noqa: E402

#: How long a launch of the laptop mode may take before it gives up (a hang must end).
LAPTOP_WAIT_S = 300.0


def build() -> nn.Module:
    """The model: the same initial weights in every process (a spare builds it too)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))


def batch(rank: int, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of ``step``: a pure function of both, so a redone step sees the
    same data (bring your sampler's position back from the restored step)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def checkpointer(rec: Any, laptop: Optional[Path], task: int) -> Checkpointer:
    """The RAM tier on every step, copied to the partner rank's memory: what a spare
    restores from. On a cluster the tiers come from the site config (from_env)."""
    ram = RamOptions(every=1, keep=2)  # keep=2: ranks one step apart still agree
    if laptop is None:
        return Checkpointer.from_env(partner=True, ram=ram)
    node = laptop / f"node{task}"
    for d in (node / "local", node / "ledger", laptop / "pfs"):
        d.mkdir(parents=True, exist_ok=True)
    os.chmod(node / "ledger", 0o700)
    return Checkpointer(
        local=node / "local",
        warm=laptop / "pfs",
        key="recovery-demo",
        rank=rec.rank,
        world_size=rec.world_size,
        node=f"node{task}",
        job="laptop",
        ledger_dir=node / "ledger",
        install_signals=False,
        end_time_fn=None,
        partner=True,
        keep_partner=2,
        partner_dir=laptop / "rendezvous",
        partner_host="127.0.0.1",
        ram=ram,
    )


def train(steps: int, laptop: Optional[Path], sleep_s: float) -> int:
    """One rank (or the hot spare) of the job."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(1)
    model = build()  # a hot spare gets this far, then waits in recovery()
    try:
        rec = sct.recovery(timeout_s=20, deadline_s=120)  # joins; forms the gloo group
    except sct.RecoveryFailed as exc:
        print(f"FAILED {exc}", flush=True)
        return exc.exit_code
    task = int(os.environ.get("SLURM_CKPT_TASK", os.environ.get("SLURM_PROCID", "0")))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    tc = sct.TorchCheckpointer(checkpointer(rec, laptop, task), model, opt)
    net: Dict[str, nn.Module] = {}

    def rebuild(group: Any) -> None:
        """Before the first step and after every re-form: the one place that wraps the
        model. find_unused_parameters keeps DDP's first gradient-bucket layout, so a
        re-wrapped DDP sums in the same order: the run stays bitwise exact."""
        from torch.nn.parallel import DistributedDataParallel

        net["ddp"] = DistributedDataParallel(
            model, process_group=group, find_unused_parameters=True
        )

    def train_step(step: int) -> None:
        """One step, collectives included: a lost peer makes it raise, and rec.run
        recovers and restores the newest step every rank holds."""
        x, y = batch(rec.rank, step)
        opt.zero_grad()
        ((net["ddp"](x) - y) ** 2).mean().backward()
        opt.step()
        print(f"STEP {step}", flush=True)
        time.sleep(sleep_s)

    try:
        last = rec.run(tc, train_step, steps, on_reform=rebuild)
    except sct.RecoveryFailed as exc:  # no spare, no common step: relaunch instead
        print(f"FAILED {exc}", flush=True)
        return exc.exit_code
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode() + v.detach().numpy().tobytes())
    doc = {"rank": rec.rank, "last": last, "history": rec.history, "started": rec.started}
    print("DONE " + json.dumps({**doc, "digest": h.hexdigest()}), flush=True)
    tc.close()
    return 0


# -- the laptop mode: this script's own launcher ----------------------------------------


class _Proc:
    """One local process of the laptop mode, its output in a file."""

    def __init__(self, work: Path, task: int, spare: bool, argv: List[str]) -> None:
        self.task = task
        self.out = work / f"task{task}.out"
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
        env.update(
            SLURM_CKPT_RECOVERY_DIR=str(work / "recovery"),
            SLURM_CKPT_TASK=str(task),
            SLURM_CKPT_HOST="127.0.0.1",
        )
        if spare:
            env["SLURM_CKPT_SPARE"] = "1"
        with self.out.open("w") as f:
            self.p = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), *argv],
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
            )

    def lines(self, head: str) -> List[str]:
        return [ln[len(head) :] for ln in self.out.read_text().splitlines() if ln.startswith(head)]


def laptop(args: argparse.Namespace) -> int:
    """Ranks and a hot spare as local processes; kill one; the Coordinator (what
    ckpt-srun runs) declares it lost and the spare takes its place."""
    from slurm_ckpt.core.membership import Coordinator, Member, RecoveryDir

    work = Path(args.work or tempfile.mkdtemp(prefix="recovery-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    co = Coordinator(RecoveryDir(str(work / "recovery"), create=True))
    co.launch({r: Member("127.0.0.1", r) for r in range(args.ranks)})
    child = ["--child", str(work), "--steps", str(args.steps), "--sleep", str(args.sleep)]
    ranks = {r: _Proc(work, r, False, child) for r in range(args.ranks)}
    spares = [_Proc(work, args.ranks, True, child)] if args.kill_at else []
    procs = list(ranks.values()) + spares
    until = time.monotonic() + LAPTOP_WAIT_S
    try:
        if args.kill_at:
            victim = ranks[1]
            while not co.dir.spares() or f"{args.kill_at}" not in victim.lines("STEP "):
                if victim.p.poll() is not None or time.monotonic() > until:
                    print(f"rank 1 ended before step {args.kill_at}:\n{victim.out.read_text()}")
                    return 1
                time.sleep(0.05)
            victim.p.send_signal(signal.SIGKILL)
            victim.p.wait()
            print(f"laptop: rank 1 (pid {victim.p.pid}) killed after step {args.kill_at}")
            ep = co.declare_lost([1])  # ckpt-srun's verdict after missed heartbeats
            if ep is None:
                print("laptop: no spare ready")
                return 1
            ranks[1] = next(p for p in procs if p.task == ep.members[1].task)
            print(f"laptop: epoch {ep.epoch}: task {ranks[1].task} (the spare) is rank 1")
        for r, p in ranks.items():
            p.p.wait(max(1.0, until - time.monotonic()))
            if p.p.returncode != 0:
                print(f"laptop: rank {r} failed:\n{p.out.read_text()[-3000:]}")
                return 1
        co.end()  # an unused spare exits 0
        for p in procs:
            p.p.wait(max(1.0, until - time.monotonic()))
    finally:
        for p in procs:
            if p.p.poll() is None:
                p.p.kill()
                p.p.wait()
    done = {r: json.loads(p.lines("DONE ")[0]) for r, p in ranks.items()}
    for r, d in sorted(done.items()):
        what = f"started={json.dumps(d['started'])}" if d["started"] else ""
        if d["history"]:
            what = f"recovered={json.dumps(d['history'])}"
        print(f"RANK {r} pid={ranks[r].p.pid} {what}".rstrip())
    digests = {d["digest"] for d in done.values()}
    ok = len(digests) == 1 and all(d["last"] == args.steps for d in done.values())
    print(f"RESULT {'ok' if ok else 'MISMATCH'} digest={','.join(sorted(digests))}")
    print(f"laptop: outputs in {work}")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--sleep", type=float, default=0.05, help="seconds per step (a demo)")
    ap.add_argument("--laptop", action="store_true", help="local processes, no SLURM")
    ap.add_argument("--ranks", type=int, default=2, help="laptop: training ranks (>= 2)")
    ap.add_argument("--kill-at", type=int, default=10, help="laptop: kill rank 1 here; 0: no")
    ap.add_argument("--work", help="laptop: where the nodes' directories go")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.laptop:
        if args.ranks < 2 or not 0 <= args.kill_at < args.steps:
            ap.error("--ranks must be >= 2 and --kill-at in [0, --steps)")
        return laptop(args)
    return train(args.steps, Path(args.child) if args.child else None, args.sleep)


if __name__ == "__main__":
    sys.exit(main())
