"""FSDP2 training that checkpoints through torch.distributed.checkpoint into slurm_ckpt.

Runs on CPU (gloo) as well as on GPUs (NCCL for training, gloo for checkpointing)::

    torchrun --nproc-per-node 2 examples/dcp_fsdp2.py --local-root /tmp/l --warm-root /tmp/p
    # under SLURM: srun ... python examples/dcp_fsdp2.py   (site config, key = job id)

Kill it (SIGTERM: the preemption save at the next step; SIGKILL: nothing) and start it
again: it resumes from the newest step every rank finds whole and verified, on any tier,
also at another world size (``--nproc-per-node 3``): DCP's planner reshards.

The ``if __name__ == "__main__"`` guard is required: ``--mode process`` makes DCP start its
checkpoint process with ``spawn``, which imports this file again.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Dict

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from slurm_ckpt import Checkpointer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--local-root", help="node-local tier (default: the site config)")
    ap.add_argument(
        "--warm-root", "--pfs-root", dest="warm_root", help="warm tier (default: the site config)"
    )
    ap.add_argument("--key", default="dcp-example")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10, help="save every N steps")
    ap.add_argument("--mode", choices=["thread", "process"], default="thread")
    args = ap.parse_args()

    gpu = torch.cuda.is_available()
    dist.init_process_group("cpu:gloo,cuda:nccl" if gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if gpu else None
    if device is not None:
        torch.cuda.set_device(device)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    if device is not None:
        model = model.to(device)
    mesh = init_device_mesh("cuda" if gpu else "cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    if args.local_root:
        ckpt = Checkpointer(local=args.local_root, warm=args.warm_root, key=args.key)
    else:
        ckpt = Checkpointer.from_env(key=args.key)

    def state() -> Dict[str, Any]:
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd, "rng": torch.get_rng_state(), "step": 0}

    step = 0
    reader = ckpt.dcp_reader()  # collective: every rank calls it
    if reader is not None:
        sd = state()
        dcp.load(sd, storage_reader=reader)
        reader.release()
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        torch.set_rng_state(sd["rng"])
        step = sd["step"]
        if rank == 0:
            print(f"resumed at step {step} (parts read from {reader.read_from})", flush=True)

    # On a CPU-only job DCP's thread mode must not share the training's gloo group.
    group = dist.new_group(backend="gloo") if args.mode == "thread" else None
    stager = DefaultStager(StagingOptions(gpu, args.mode == "process", True, False))
    kind = AsyncCheckpointerType[args.mode.upper()]
    pending: Any = None
    while step < args.steps:
        x = torch.randn(32, 64, device=device)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        # Any rank's signal stops all: agree before deciding (a collective per step).
        flag = torch.tensor([int(ckpt.signal_received is not None)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        preempt = bool(flag.item())
        if step % args.every == 0 or preempt or step == args.steps:
            if pending is not None:  # one save in flight at a time
                getattr(pending, "upload_completion", pending).result()
            sd = state()
            sd["step"] = step
            writer = ckpt.dcp_writer(step=step, tokens=step * 32, preemption=preempt)
            pending = dcp.async_save(
                sd,
                storage_writer=writer,
                async_checkpointer_type=kind,
                async_stager=stager,
                process_group=group,
            )
            if rank == 0:
                print(f"step {step}: checkpoint started (loss {loss.item():.4f})", flush=True)
            if preempt:
                break
    if pending is not None:
        getattr(pending, "upload_completion", pending).result()
    stager.close()
    ckpt.close()  # flushes the newest parts to the PFS (or leaves them to the epilog)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
