"""One rank of a job that saves DCP shards and loads them back by range.

Started once per rank by tests/test_dcp_ranged.py (RANK, WORLD_SIZE, MASTER_* as torchrun
sets them). ``save``: every rank saves its row shard (``Shard(0)``) of a few tensors plus
a value, once through our backend (step 1) and once with DCP's own ``FileSystemWriter``
(the reference). ``load``: the same state at this world size loaded through
``dcp_reader(ranged=...)`` and, separately, through ``FileSystemReader``; prints
``LOADED equal=<0|1> needed=N read=M tiers=<part>:<tier>,...`` or ``LOADFAIL <one line>``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from slurm_ckpt import Checkpointer, rank_and_world_size
from slurm_ckpt.core.config import Config

#: Tensor names and shape: 4 MiB each (float32), 16 hash chunks of 64 KiB per shard row
#: block at 4 ranks, so widening a range to whole chunks costs little.
NAMES = ("w0", "w1", "w2", "w3")
SHAPE = (4096, 256)


def full_tensor(name: str) -> torch.Tensor:
    """The saved value of ``name`` (the test rebuilds it to find bytes in a part)."""
    g = torch.Generator().manual_seed(NAMES.index(name) + 1)
    return torch.randn(SHAPE, generator=g)


def state(world: int, names: Any, fill: bool) -> Dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    out: Dict[str, Any] = {}
    for n in names:
        t = full_tensor(n) if fill else torch.zeros(SHAPE)
        out[n] = distribute_tensor(t, mesh, [Shard(0)])
    out["meta"] = {"step": 7 if fill else 0, "note": "ranged" if fill else ""}
    return out


def same(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    for k, v in a.items():
        w = b[k]
        if isinstance(v, DTensor):
            if not torch.equal(v.to_local(), w.to_local()):
                return False
        elif v != w:
            return False
    return True


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["save", "load"])
    ap.add_argument("--config", required=True)
    ap.add_argument("--key", default="rg")
    ap.add_argument("--fsdir", required=True)
    ap.add_argument("--only", default=",".join(NAMES))
    ap.add_argument("--whole", action="store_true", help="load without ranged=True")
    args = ap.parse_args()
    rank, world = rank_and_world_size()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    with open(args.config) as fh:
        cfg = Config.from_dict(json.load(fh))
    ckpt = Checkpointer(config=cfg, key=args.key, end_time_fn=None, install_signals=False)
    names = args.only.split(",")
    if args.cmd == "save":
        st = state(world, names, True)
        dcp.save(st, storage_writer=ckpt.dcp_writer(step=1, tokens=1))
        dcp.save(st, storage_writer=dcp.FileSystemWriter(args.fsdir))
        ckpt.close()
        print("SAVED", flush=True)
    else:
        reader = ckpt.dcp_reader(ranged=not args.whole)
        got = state(world, names, False)
        try:
            dcp.load(got, storage_reader=reader)
        except BaseException as exc:  # noqa: BLE001 - DCP raises a BaseException
            text = " | ".join(ln.strip() for ln in str(exc).splitlines() if "dcp step" in ln)
            print(f"LOADFAIL {text or type(exc).__name__}", flush=True)
        else:
            ref = state(world, names, False)
            dcp.load(ref, storage_reader=dcp.FileSystemReader(args.fsdir))
            rr = reader.ranged_read
            tiers = ",".join(f"{r}:{t}" for r, t in sorted(reader.read_from.items()))
            print(
                f"LOADED equal={int(same(got, ref))} needed={rr.nbytes_needed} "
                f"read={rr.nbytes_read} tiers={tiers}",
                flush=True,
            )
        ckpt.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
