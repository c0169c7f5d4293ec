"""One rank (or hot spare) of ``benchmarks/seed2.py``: the same tiny DDP model over gloo
in every arm, so that the arms differ only in how they survive a node loss.

    python seed2_worker.py plain TOTAL SLEEP_S INTERVAL PARTNER   # arms (a), (b), (c)
    python seed2_worker.py injob TOTAL SLEEP_S TIMEOUT_S          # arm (d)

``plain``: ``torch.distributed`` from the SLURM environment (as ``examples/train_tiny.py``),
the site's Checkpointer (``from_env``) with a save every ``INTERVAL`` steps (0: none, arm
(a)), partner copies when ``PARTNER`` is 1; a restart restores the newest step every rank
holds. ``injob``: ``slurm_ckpt.torch.recovery`` with the RAM tier every step (the job
side of ``ckpt-srun --in-job``), as ``tests/in_job_ddp_worker.py``.

Every line carries the wall clock (``t=``, seconds since the epoch: the driver on the
same host compares it with the moment it killed a node): ``PID``, ``RESUMED step=S
tier=T`` (plain, after the restore), ``REFORM`` (injob, each time the group is formed),
``STEP s``, ``DONE {json}``. The driver takes every figure from these lines.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
import warnings
from typing import Any, Dict

import torch
from torch import nn


def out(line: str) -> None:
    sys.stdout.write(f"{line} t={time.time():.3f}\n")
    sys.stdout.flush()


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)
    )


def batch(rank: int, step: int) -> Any:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().numpy().tobytes())
    return h.hexdigest()


def master_addr() -> str:
    """The first node of the allocation, by its NodeAddr (the dev cluster's node names
    are not in DNS; see examples/train_tiny.py)."""
    nodes = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodes:
        return "127.0.0.1"
    hosts = subprocess.run(
        ["scontrol", "show", "hostnames", nodes], capture_output=True, text=True, check=False
    ).stdout.split()
    if not hosts:
        return "127.0.0.1"
    try:
        socket.getaddrinfo(hosts[0], None)
        return hosts[0]
    except OSError:
        pass
    shown = subprocess.run(
        ["scontrol", "-o", "show", "node", hosts[0]], capture_output=True, text=True, check=False
    ).stdout
    m = re.search(r"\bNodeAddr=(\S+)", shown)
    return m.group(1) if m else hosts[0]


def plain(total: int, sleep_s: float, interval: int, partner: bool) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import slurm_ckpt.torch as sct
    from slurm_ckpt import Checkpointer, rank_and_world_size

    rank, world = rank_and_world_size()
    os.environ.setdefault("MASTER_ADDR", master_addr())
    os.environ.setdefault("MASTER_PORT", str(29500 + int(os.environ.get("SLURM_JOB_ID", 0)) % 2000))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    door = None
    step = 0
    if interval > 0:
        ckpt = Checkpointer.from_env(interval_steps=interval, partner=partner)
        door = sct.TorchCheckpointer(ckpt, model, opt, lazy=False)
        got = door.restore()  # the ranks agree on one step
        if got is not None:
            step = int(got.step)
            out(f"RESUMED step={step} tier={got.tier}")
        else:
            out("RESUMED step=0 tier=none")
    else:
        out("RESUMED step=0 tier=none")
    net = DistributedDataParallel(model, find_unused_parameters=True)
    while step < total:
        step += 1
        x, y = batch(rank, step)
        opt.zero_grad()
        loss = ((net(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        out(f"STEP {step}")
        time.sleep(sleep_s)
        if door is not None and door.should_save(step=step):
            t0 = time.perf_counter()
            door.save(step=step)  # what the save blocks the step for (Young/Daly's cost)
            out(f"SAVE {step} cost={time.perf_counter() - t0:.6f}")
    if door is not None:
        door.close()
    out("DONE " + json.dumps({"rank": rank, "last": step, "digest": digest(model)}))
    dist.barrier()
    dist.destroy_process_group()


def injob(total: int, sleep_s: float, timeout_s: float) -> None:
    from torch.nn.parallel import DistributedDataParallel

    import slurm_ckpt.torch as sct
    from slurm_ckpt import Checkpointer
    from slurm_ckpt.job.options import RamOptions

    model = build()  # a hot spare gets this far, then waits in recovery()
    try:
        rec = sct.recovery(timeout_s=timeout_s, deadline_s=180)
    except sct.RecoveryFailed as exc:
        out(f"FAILED {exc}")
        sys.exit(exc.exit_code)
    rank = rec.rank
    ckpt = Checkpointer.from_env(partner=True, ram=RamOptions(every=1, keep=2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    door = sct.TorchCheckpointer(ckpt, model, opt, lazy=False)
    state: Dict[str, Any] = {}

    def rebuild(group: Any) -> None:
        out("REFORM")
        state["net"] = DistributedDataParallel(
            model, process_group=group, find_unused_parameters=True
        )

    def step_fn(step: int) -> None:
        x, y = batch(rank, step)
        opt.zero_grad()
        loss = ((state["net"](x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        out(f"STEP {step}")
        time.sleep(sleep_s)

    try:
        last = rec.run(door, step_fn, total, on_reform=rebuild)
    except sct.RecoveryFailed as exc:
        out(f"FAILED {exc}")
        sys.exit(exc.exit_code)
    doc = {"rank": rank, "last": last, "history": rec.history, "digest": digest(model)}
    out("DONE " + json.dumps(doc))
    ckpt.close()


def main() -> None:
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
    torch.set_num_threads(1)
    node = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    out(f"PID pid={os.getpid()} node={node}")
    mode, total, sleep_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    if mode == "plain":
        plain(total, sleep_s, int(sys.argv[4]), sys.argv[5] == "1")
    else:
        injob(total, sleep_s, float(sys.argv[4]))


if __name__ == "__main__":
    main()
