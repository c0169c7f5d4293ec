"""One rank of a tiny FSDP2 job (CPU, gloo) that saves and loads through the DCP backend.

Started once per rank by tests/test_dcp_fsdp2.py (RANK, WORLD_SIZE, MASTER_ADDR/PORT in
the environment, as torchrun sets them) and by tests/test_cluster_dcp.py under ``srun``
(rank and world size then come from SLURM_PROCID and the step's task count, by the rule
every Checkpointer uses). Lines on stdout for the test:
``RESUMED key=K step=N tiers=<part>:<tier>,...`` / ``NOTHING key=K``, ``SAVED step=N``,
``PREEMPTED step=N``, ``CHILD_DIED ...``, ``DONE digest=...``.

Dumps (rank 0, ``--dump DIR``): ``saved-<key>-<step>.pt`` is every full tensor and value
that a save put into the checkpoint, ``loaded-<key>-<world>.pt`` everything a load put
back; the test compares them with ``torch.equal``.

The guard at the bottom matters: DCP's process mode starts its child with ``spawn``,
which imports this file again.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import time
from typing import Any, Dict

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from slurm_ckpt import Checkpointer, rank_and_world_size

DIM = 16


def build(world: int) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(DIM, 3 * DIM), torch.nn.ReLU(), torch.nn.Linear(3 * DIM, 5)
    )
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def state_of(model: Any, opt: Any, sched: Any, step: int) -> Dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    return {
        "model": msd,
        "optim": osd,
        "sched": sched.state_dict(),
        "rng": torch.get_rng_state(),
        "meta": {"step": step},
    }


def apply(model: Any, opt: Any, sched: Any, state: Dict[str, Any]) -> None:
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    sched.load_state_dict(state["sched"])
    torch.set_rng_state(state["rng"])


def full(obj: Any) -> Any:
    """Every DTensor made whole (collective), recursively; the rest as is."""
    if isinstance(obj, DTensor):
        return obj.full_tensor().clone()
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: full(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(full(v) for v in obj)
    return obj


def digest(model: Any, opt: Any) -> str:
    h = hashlib.sha256()
    msd, osd = get_state_dict(model, opt)
    for name, t in sorted(full(msd).items()):
        h.update(name.encode() + t.numpy().tobytes())
    for pid, st in sorted(full(osd)["state"].items()):
        for k, t in sorted(st.items()):
            h.update(f"{pid}{k}".encode() + t.numpy().tobytes())
    h.update(torch.get_rng_state().numpy().tobytes())
    return h.hexdigest()


def train_step(model: Any, opt: Any, sched: Any, rank: int, world: int) -> None:
    x = torch.randn(4 * world, DIM)[4 * rank : 4 * (rank + 1)]  # same RNG on every rank
    loss = model(x).square().mean() + 0.01 * torch.rand(()).item()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()


def resume(ckpt: Any, model: Any, opt: Any, sched: Any, key: str) -> Any:
    """Load the newest DCP step into the model (None: there is none); what was loaded,
    made whole, for the dumps."""
    reader = ckpt.dcp_reader()
    if reader is None:
        print(f"NOTHING key={key}", flush=True)
        return None
    state = state_of(model, opt, sched, 0)
    dcp.load(state, storage_reader=reader)
    reader.release()
    apply(model, opt, sched, state)
    tiers = ",".join(f"{r}:{t}" for r, t in sorted(reader.read_from.items()))
    print(f"RESUMED key={key} step={reader.step} tiers={tiers}", flush=True)
    return full(state)


def plain_weights(reader: Any, **kw: Any) -> Dict[str, Any]:
    """The model weights of the step ``reader`` chose, loaded whole into a plain (not
    sharded) model's state dict: DCP reshards the FSDP2 shards into full tensors."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(DIM, 3 * DIM), torch.nn.ReLU(), torch.nn.Linear(3 * DIM, 5)
    )
    state = {"model": model.state_dict()}
    dcp.load(state, storage_reader=reader, **kw)
    return state["model"]


def alone(args: Any, rank: int, world: int) -> int:
    """DCP's other ways to load, beside a process group of ``world`` ranks: rank 0 alone
    (``no_dist=True``: no collective at all, every part read by this one process), then
    ranks 0 and 1 as a subgroup (``process_group=``) while rank 2 takes no part."""
    import datetime

    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    sub = dist.new_group([0, 1], backend="gloo")  # collective: every rank makes it
    ckpt = Checkpointer(
        local=args.local, warm=args.pfs, key=args.key, end_time_fn=None, install_signals=False
    )
    dump = args.dump
    if rank == 0:  # the others wait at the barrier below: any collective here would hang
        reader = ckpt.dcp_reader(no_dist=True)
        got = plain_weights(reader, no_dist=True)
        torch.save(got, os.path.join(dump, f"alone-{args.key}.pt"))
        print(f"ALONE step={reader.step} parts={sorted(reader.read_from)}", flush=True)
    if rank in (0, 1):
        reader = ckpt.dcp_reader(process_group=sub)
        got = plain_weights(reader, process_group=sub)
        torch.save(got, os.path.join(dump, f"sub-{args.key}-{rank}.pt"))
        print(f"SUBGROUP step={reader.step}", flush=True)
    ckpt.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["train", "load", "alone"])
    ap.add_argument("--local", required=True)
    ap.add_argument("--pfs", required=True)
    ap.add_argument("--key", default="run")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--mode", choices=["sync", "thread", "process"], default="thread")
    ap.add_argument("--term-at", type=int, default=0)
    ap.add_argument("--kill-at", type=int, default=0)
    ap.add_argument("--child-term-at", type=int, default=0)
    ap.add_argument("--dump", default="")
    ap.add_argument(
        "--sleep", type=float, default=0.0, help="per step, first run only (cluster tests)"
    )
    args = ap.parse_args()

    rank, world = rank_and_world_size()  # torchrun's RANK/WORLD_SIZE, else srun's task
    if args.cmd == "alone":
        return alone(args, rank, world)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if args.cmd == "load":  # every key given, one after the other (one launch, several checks)
        for key in args.key.split(","):
            ckpt = Checkpointer(local=args.local, warm=args.pfs, key=key, end_time_fn=None)
            model, opt, sched = build(world)
            got = resume(ckpt, model, opt, sched, key)
            if got is not None and rank == 0 and args.dump:
                torch.save(got, os.path.join(args.dump, f"loaded-{key}-{world}.pt"))
            ckpt.close()
        dist.destroy_process_group()
        return 0
    key = args.key
    ckpt = Checkpointer(local=args.local, warm=args.pfs, key=key, end_time_fn=None)
    model, opt, sched = build(world)
    got = resume(ckpt, model, opt, sched, key)
    start = 0 if got is None else got["meta"]["step"]

    # DCP's thread mode runs its collectives from a background thread: on a CPU-only job
    # they must not share the gloo group that FSDP uses from the training thread.
    save_group = dist.new_group(backend="gloo") if args.mode == "thread" else None
    stager = None
    if args.mode == "process":  # CPU only: no pinned memory, no non-blocking copies
        stager = DefaultStager(StagingOptions(False, True, True, False))
    pending: Any = None

    def wait_pending() -> None:
        nonlocal pending
        if pending is not None:
            fut = getattr(pending, "upload_completion", pending)
            fut.result()
            pending = None

    # Slow enough for a cluster test to preempt the first run mid-way; a requeued run
    # (SLURM_RESTART_COUNT > 0) is preempted no more, so it goes at full speed.
    sleep = args.sleep if os.environ.get("SLURM_RESTART_COUNT", "0") == "0" else 0.0
    step = start
    while step < args.steps:
        train_step(model, opt, sched, rank, world)
        step += 1
        if sleep:
            time.sleep(sleep)
        if args.term_at == step:
            os.kill(os.getpid(), signal.SIGTERM)  # as SLURM would, to every rank
        got_signal = ckpt.signal_received is not None
        flags = torch.tensor([int(got_signal)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        preempt = bool(flags.item())
        if step % args.every == 0 or preempt or step == args.steps:
            try:
                wait_pending()
            except RuntimeError as exc:
                print(f"CHILD_DIED {exc}", flush=True)
                break
            state = state_of(model, opt, sched, step)
            if args.dump:
                snap = full(state)
                if rank == 0:
                    torch.save(snap, os.path.join(args.dump, f"saved-{key}-{step}.pt"))
            writer = ckpt.dcp_writer(step=step, tokens=step * 64, preemption=preempt)
            if args.child_term_at == step:
                os.environ["SLURM_CKPT_DCP_SIGTERM_AT"] = "before_part_commit"
            if args.mode == "sync":
                dcp.save(state, storage_writer=writer, process_group=save_group)
            else:
                kind = AsyncCheckpointerType[args.mode.upper()]
                pending = dcp.async_save(
                    state,
                    storage_writer=writer,
                    async_checkpointer_type=kind,
                    async_stager=stager,
                    process_group=save_group,
                )
            if args.kill_at == step:
                os.kill(os.getpid(), signal.SIGKILL)  # while the save is in flight
            print(f"SAVED step={step}", flush=True)
            if preempt:
                wait_pending()
                print(f"PREEMPTED step={step}", flush=True)
                break
    else:
        try:
            wait_pending()
            print(f"DONE digest={digest(model, opt)}", flush=True)
        except RuntimeError as exc:
            print(f"CHILD_DIED {exc}", flush=True)
    try:
        wait_pending()
    except RuntimeError as exc:
        print(f"CHILD_DIED {exc}", flush=True)
    if stager is not None:
        stager.close()
    ckpt.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
