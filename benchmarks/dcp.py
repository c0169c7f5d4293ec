#!/usr/bin/env python3
"""The DCP backend side by side with DCP's own FileSystemWriter/FileSystemReader.

Two ranks (gloo, CPU) hold ``--size`` in ``--tensors`` DTensors sharded over both ranks
(1 GiB in 8 tensors: 512 MiB per rank), on one disk (``--dir``). Per round, in
alternating order:

* ``dcp.async_save`` (thread mode, each writer with DCP's default stager): the time the
  call blocks (staging), and the time until the checkpoint is durable - ours committed on
  the local tier (every byte hashed, fsync, manifest last), FileSystemWriter's
  ``.metadata`` renamed into place;
* ``dcp.load`` after dropping the page cache: ours through ``ckpt.dcp_reader()`` (the
  agreed step, every byte verified against its manifest) against FileSystemReader (no
  checksum at all).

Claims (ratios ours / DCP's, median over rounds): blocking <= 1.05, durable <= 0.8,
load <= 0.8. Run as root (drops the page cache)::

    python benchmarks/dcp.py --json /tmp/dcp.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def drop_caches() -> None:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
    except OSError:
        pass  # not root: loads then read from the page cache (reported as is)


def rank_main(argv: List[str]) -> int:
    """One rank: every round's figures; rank 0 writes them to ``out``."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from slurm_ckpt import Checkpointer

    warnings.simplefilter("ignore")
    root, size, ntensors, rounds, out = (
        Path(argv[0]),
        int(argv[1]),
        int(argv[2]),
        int(argv[3]),
        argv[4],
    )
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="gloo")  # DCP's thread: not the group of the main thread
    mesh = init_device_mesh("cpu", (world,))
    per = size // ntensors // world // 4
    g = torch.Generator().manual_seed(rank)
    state = {
        f"t{i}": DTensor.from_local(torch.randn(per, generator=g), mesh, [Shard(0)])
        for i in range(ntensors)
    }

    def blank() -> Dict[str, Any]:
        return {k: DTensor.from_local(torch.empty(per), mesh, [Shard(0)]) for k in state}

    (root / "local").mkdir(parents=True, exist_ok=True)
    (root / "pfs").mkdir(parents=True, exist_ok=True)
    ckpt = Checkpointer(
        local=root / "local",
        warm=root / "pfs",
        key="bench",
        install_signals=False,
        end_time_fn=None,
        flush_every=10**6,
        keep_local=1,
    )
    figures: Dict[str, List[float]] = {
        k: []
        for k in ("ours_block", "fs_block", "ours_durable", "fs_durable", "ours_load", "fs_load")
    }

    def save(which: str, step: int) -> None:
        if which == "ours":
            writer = ckpt.dcp_writer(step=step)
        else:
            path = root / "fs" / f"step-{step}"
            writer = dcp.FileSystemWriter(path)
        dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(state, storage_writer=writer, process_group=group)
        t1 = time.perf_counter()
        fut.result()
        t2 = time.perf_counter()
        figures[f"{which}_block"].append(t1 - t0)
        figures[f"{which}_durable"].append(t2 - t0)
        if which == "ours":
            series = ckpt._dcp
            if series is not None:  # the first save's flush: done before the next figure
                series.pipe.wait_flushes()

    def load(which: str, step: int) -> None:
        target = blank()
        if rank == 0:
            drop_caches()
        dist.barrier()
        t0 = time.perf_counter()
        if which == "ours":
            reader = ckpt.dcp_reader()
            assert reader is not None and reader.step == step
        else:
            reader = dcp.FileSystemReader(root / "fs" / f"step-{step}")
        dcp.load(target, storage_reader=reader)
        t1 = time.perf_counter()
        figures[f"{which}_load"].append(t1 - t0)
        for k in state:
            assert torch.equal(target[k].to_local(), state[k].to_local())

    for rnd in range(rounds):
        step = rnd + 1
        order = ("ours", "fs") if rnd % 2 == 0 else ("fs", "ours")
        for which in order:
            save(which, step)
        for which in order:
            load(which, step)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root / "fs" / f"step-{step}", ignore_errors=True)
    ckpt.close()
    # a figure of the slowest rank: what the job waits for
    for k, vals in figures.items():
        t = torch.tensor(vals, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        figures[k] = t.tolist()
    if rank == 0:
        Path(out).write_text(json.dumps(figures))
    dist.destroy_process_group()
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    from claims import claim  # benchmarks/claims.py: the shape benchmarks/report reads

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/slurm-ckpt-dcp-bench"))
    ap.add_argument("--size", type=int, default=2**30, help="bytes over both ranks")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="256 MiB, 2 rounds")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.quick:
        args.size, args.rounds = 2**28, 2
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    out = args.dir / "figures.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    t0 = time.monotonic()
    for r in range(2):
        env = dict(
            os.environ,
            RANK=str(r),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            GLOO_SOCKET_IFNAME="lo",
            PYTHONPATH=str(REPO),
        )
        cmd = [
            sys.executable,
            __file__,
            "rank",
            str(args.dir),
            str(args.size),
            str(args.tensors),
            str(args.rounds),
            str(out),
        ]
        procs.append(subprocess.Popen(cmd, env=env))
    rcs = [p.wait(timeout=3600) for p in procs]
    if any(rcs):
        print(f"dcp benchmark: a rank failed (exit {rcs})", file=sys.stderr)
        return 1
    fig = json.loads(out.read_text())
    shutil.rmtree(args.dir, ignore_errors=True)
    setup = f"{args.size / 2**30:g} GiB in {args.tensors} tensors, 2 ranks, one disk"
    print(f"dcp: {setup}, {args.rounds} rounds ({time.monotonic() - t0:.0f} s)")
    print(f"{'figure (s, median)':34} {'ours':>8} {'DCP fs':>8} {'ratio':>7}")
    ratios: Dict[str, List[float]] = {}
    for label, k in (
        ("async_save blocking", "block"),
        ("until durable (local)", "durable"),
        ("dcp.load (cold cache)", "load"),
    ):
        ours, fs = fig[f"ours_{k}"], fig[f"fs_{k}"]
        ratios[k] = [a / b for a, b in zip(ours, fs) if b > 0]
        print(
            f"{label:34} {statistics.median(ours):8.3f} {statistics.median(fs):8.3f} "
            f"{statistics.median(ratios[k]):7.2f}"
        )
    if args.json:
        claims = [
            claim(
                "dcp-async-save-blocking",
                ratios["block"],
                target=1.05,
                what=f"dcp.async_save blocking time, our writer ({setup})",
                baseline="the same with DCP's FileSystemWriter",
                ours_s=fig["ours_block"],
                baseline_s=fig["fs_block"],
            ),
            claim(
                "dcp-durable-local",
                ratios["durable"],
                target=0.8,
                what="async_save until durable on the local tier (hashed, committed)",
                baseline="FileSystemWriter until its .metadata is in place",
                ours_s=fig["ours_durable"],
                baseline_s=fig["fs_durable"],
            ),
            claim(
                "dcp-load-verified",
                ratios["load"],
                target=0.8,
                what="dcp.load through ckpt.dcp_reader(), every byte verified, cold cache",
                baseline="dcp.load through FileSystemReader (unverified)",
                ours_s=fig["ours_load"],
                baseline_s=fig["fs_load"],
            ),
        ]
        args.json.write_text(
            json.dumps(
                {"figures": fig, "args": vars(args), "claims": claims}, default=str, indent=1
            )
        )
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "rank":
        sys.exit(rank_main(sys.argv[2:]))
    sys.path.insert(0, str(HERE))
    sys.exit(main())
