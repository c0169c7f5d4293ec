"""A data-parallel (DDP, gloo, CPU) trainer whose replicas compare their digests at every
save (``Checkpointer(replicas=True)``), for tests/test_replicas.py and the cluster test.

    python tests/replica_worker.py --key K --steps N [--local DIR --warm DIR --node NAME]
        [--flip-at STEP --flip-rank R] [--stop-on-suspect] [--restore-only] [--prom DIR]
        [--mesh]

Rank and world come from RANK/WORLD_SIZE (else SLURM's); MASTER_ADDR/MASTER_PORT from
the environment. Without ``--local`` the Checkpointer comes from ``from_env()`` (under
SLURM: the site config); with ``--prom DIR`` (and ``--local``) the node's metrics
textfile goes to DIR, as a site's ``[metrics] textfile_dir`` would send it. ``--mesh``:
HSDP's form, ``replicas=(device_mesh, "replicate")`` on a (world/2 x 2) mesh
("replicate", "shard"): the replica sets are {0, 2, ..} and {1, 3, ..}.
``--flip-at S --flip-rank R``: the test hook - just before the
save of step S, rank R flips one bit of one parameter in memory (silent data corruption
as a GPU would make it). Lines: ``SAVED step=N``, ``SUSPECT step=N ranks=.. nodes=..``
(the ``on_suspect`` callback, on the training thread), ``STOPPED step=N`` (with
``--stop-on-suspect``), ``RESUMED step=N`` / ``START fresh``, ``DONE``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, List


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--key", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--local")
    p.add_argument("--warm")
    p.add_argument("--node")
    p.add_argument("--flip-at", type=int)
    p.add_argument("--flip-rank", type=int, default=0)
    p.add_argument("--stop-on-suspect", action="store_true")
    p.add_argument("--restore-only", action="store_true")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--keep-local", type=int, default=1000)
    p.add_argument("--prom", help="[metrics] textfile_dir (with --local)")
    p.add_argument("--mesh", action="store_true", help='replicas=(mesh, "replicate")')
    p.add_argument("--raise", dest="raise_", action="store_true", help='on_suspect="raise"')
    args = p.parse_args()

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from slurm_ckpt import Checkpointer, SuspectStep, rank_and_world_size
    from slurm_ckpt.core.config import Config

    rank, world = rank_and_world_size()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, args.hidden), torch.nn.ReLU(), torch.nn.Linear(args.hidden, 4)
    )
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    told: List[Any] = []

    def on_suspect(verdict: Any) -> None:
        told.append(verdict)
        print(
            f"SUSPECT step={verdict.step} ranks={','.join(map(str, verdict.ranks))} "
            f"nodes={','.join(verdict.nodes)}",
            flush=True,
        )

    replicas: Any = True
    if args.mesh:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
        replicas = (mesh, "replicate")
    opts = dict(
        replicas=replicas,
        on_suspect="raise" if args.raise_ else on_suspect,
        interval_steps=1,
        install_signals=False,
        keep_local=args.keep_local,
    )
    if args.local and args.prom:
        for d in (args.local, args.warm):  # what local=/warm= would have made
            if d:
                os.makedirs(d, exist_ok=True)
        cfg = Config.standalone(args.local, args.warm, metrics={"textfile_dir": args.prom})
        ckpt = Checkpointer(config=cfg, key=args.key, node=args.node, **opts)
    elif args.local:
        ckpt = Checkpointer(local=args.local, warm=args.warm, key=args.key, node=args.node, **opts)
    else:
        ckpt = Checkpointer.from_env(key=args.key, **opts)
    got = ckpt.restore()
    if got is None:
        print("START fresh", flush=True)
        start = 0
    else:
        print(f"RESUMED step={got.step} tier={got.tier}", flush=True)
        model.load_state_dict(got.state["model"])
        start = got.step + 1
    if args.restore_only:
        ckpt.close()
        dist.destroy_process_group()
        return 0
    gen = torch.Generator().manual_seed(1000 + rank)
    step = start
    for step in range(start, args.steps):
        x = torch.randn(8, 16, generator=gen)
        loss = ddp(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if args.flip_at == step and rank == args.flip_rank:
            with torch.no_grad():
                w = model[0].weight.view(-1).view(torch.int32)
                w[3] ^= 1 << 20  # one bit of one float, in memory
            print(f"FLIPPED step={step}", flush=True)
        try:
            if ckpt.should_save(step=step):
                state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
                ckpt.save(state, step=step)
                print(f"SAVED step={step}", flush=True)
        except SuspectStep as exc:  # on_suspect="raise": the exception the job chose
            told.append(exc.verdict)
            print(f"RAISED step={exc.verdict.step} ranks={exc.verdict.ranks}", flush=True)
        stop = torch.tensor([1 if told and args.stop_on_suspect else 0])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # every rank stops at the same step
        if stop.item():
            print(f"STOPPED step={step}", flush=True)
            break
    try:
        ckpt.close()
    except SuspectStep as exc:  # the last saves' verdicts, after the close's work is done
        told.append(exc.verdict)
    stats = ckpt.stats
    dist.barrier()
    dist.destroy_process_group()
    print(
        f"DONE step={step} saves={stats.saves} checks={stats.replica_checks} "
        f"suspect_steps={stats.suspect_steps} told={len(told)}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
