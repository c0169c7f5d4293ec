"""One process of the in-job recovery tests (tests/test_in_job_recovery.py): a training
rank, or a hot spare (``SLURM_CKPT_SPARE=1``), of a tiny model trained with DDP (or
FSDP2's ``fully_shard``) over gloo on 127.0.0.1, with partner copies and the RAM tier on
every step, through ``slurm_ckpt.torch.recovery``. Its own "node" directory (local tier,
ledger); the warm tier and the partner rendezvous are shared.

    python recovery_worker.py WORK NODE MODE TOTAL TIMEOUT_S DEADLINE_S

Environment: ``SLURM_CKPT_RECOVERY_DIR``, ``SLURM_CKPT_TASK``, maybe ``SLURM_CKPT_SPARE``
and ``SPARE_SETUP_S`` (a spare sleeps that long once it knows its rank: a slow setup).
Lines on stdout: ``PID p``, ``RANK r``, ``STEP s`` after each step, at the end
``DONE {json}``; the final parameters go to WORK/final.rankR.pt (DDP) or the rank's
shards to WORK/final.rankR.pt (FSDP2). A RecoveryFailed is one line ``FAILED ...`` and
its exit code.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict

import torch
from torch import nn

import slurm_ckpt.torch as sct
from slurm_ckpt import Checkpointer
from slurm_ckpt.job.options import RamOptions

JOB = "5151"


def out(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)
    )


def batch(rank: int, step: int) -> Any:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def main() -> None:
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    work, node, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    total, timeout_s, deadline_s = int(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6])
    torch.set_num_threads(1)
    out(f"PID {os.getpid()}")
    model = build()
    try:
        rec = sct.recovery(timeout_s=timeout_s, deadline_s=deadline_s)
    except sct.RecoveryFailed as exc:
        out(f"FAILED {exc}")
        sys.exit(exc.exit_code)
    rank = rec.rank
    out(f"RANK {rank}")
    if rec.spare:
        # a slow setup after the rank is known (tests of where the re-form's wait lands)
        time.sleep(float(os.environ.get("SPARE_SETUP_S", "0")))
    for d in (work / node / "local", work / node / "ledger", work / "pfs"):
        d.mkdir(parents=True, exist_ok=True)
    os.chmod(work / node / "ledger", 0o700)
    ckpt = Checkpointer(
        local=work / node / "local",
        warm=work / "pfs",
        key="run",
        rank=rank,
        world_size=rec.world_size,
        node=node,
        job=JOB,
        ledger_dir=work / node / "ledger",
        install_signals=False,
        end_time_fn=None,
        flush_every=100,
        keep_local=2,
        partner=True,
        keep_partner=2,
        partner_dir=work / "rendezvous",
        partner_host="127.0.0.1",
        ram=RamOptions(every=1, keep=2),
    )
    state: Dict[str, Any] = {}
    if mode == "ddp":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        door: Any = sct.TorchCheckpointer(ckpt, model, opt, lazy=False)

        def rebuild(group: Any) -> None:
            from torch.nn.parallel import DistributedDataParallel

            # find_unused_parameters: DDP keeps its first gradient-bucket layout (it would
            # rebuild it after the first iteration, and a re-wrapped DDP starts over from
            # the first layout: gloo would sum in another order, not bitwise the same)
            state["net"] = DistributedDataParallel(
                model, process_group=group, find_unused_parameters=True
            )
            state["opt"] = opt

    else:
        door = sct.ShardState(ckpt)

        def rebuild(group: Any) -> None:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            net = build()  # the same initial values; the restore puts the state back
            mesh = init_device_mesh("cpu", (rec.world_size,))
            for layer in net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(net, mesh=mesh)
            state["net"] = net
            state["opt"] = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
            door.bind(net, state["opt"])
            # the optimizer's momentum buffers exist from the first step on: make them now
            # (zero), so that a restore has somewhere to put them
            for p in net.parameters():
                state["opt"].state[p]["momentum_buffer"] = torch.zeros_like(p)

    def step_fn(step: int) -> None:
        x, y = batch(rank, step)
        opt = state["opt"]
        opt.zero_grad()
        loss = ((state["net"](x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        out(f"STEP {step}")

    try:
        last = rec.run(door, step_fn, total, on_reform=rebuild)
    except sct.RecoveryFailed as exc:
        out(f"FAILED {exc}")
        sys.exit(exc.exit_code)
    net = state["net"]
    if mode == "ddp":
        final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    else:
        final = {k: p.to_local().detach().clone() for k, p in net.named_parameters()}
    torch.save(final, work / f"final.rank{rank}.pt")
    out(
        "DONE "
        + json.dumps({"rank": rank, "last": last, "history": rec.history, "started": rec.started})
    )
    ckpt.close()


if __name__ == "__main__":
    main()
