#!/usr/bin/env python3
"""Training throughput with the replicas' digest check on vs off, side by side (issue 34).

Claim (issue 34, "Must show"): a data-parallel training loop that checkpoints often keeps
at least 0.995x its steps/s when the replicas compare their digests at every save
(``Checkpointer(replicas=True)``: docs/user-guide.md, "Replicas agree"), against the same
loop without the check.

Setup: two ranks, two processes, gloo over 127.0.0.1, ``DistributedDataParallel`` over a
small network plus ``--size`` bytes of never-stepped bulk parameters. Each rank holds two
Checkpointers, identical but for ``replicas=`` (one with the check, one without; their
own keys, local tiers and staging memory), and saves the model's state dict through the
one of the window's side every ``--save-every`` seconds (5 saves in a 10 s window: a job
that checkpoints far more often than any real one).

Method, as benchmarks/partner_loop.py: windows of ``--window`` seconds come in pairs,
one with the check and one without, in A/B/B/A order, so a drift of the shared machine's
speed hits both sides alike; each pair's ratio is on / off steps/s, and the figure is the
median of the paired ratios (with min and max). Between windows, untimed: both ranks
wait for their local writes, then train ``--settle`` seconds. Both ranks take every
decision together (one tiny all-reduce per step), so they save the same steps - which
the check needs anyway.

After the windows, each rank also times 200 digest exchanges on their own (CPU and wall
per exchange): the check's own price, which bounds what it can take from the steps/s.

    python benchmarks/replicas_loop.py               # 32 MiB/rank, save every 2 s, 8 pairs
    python benchmarks/replicas_loop.py --quick       # smoke run
    python benchmarks/replicas_loop.py --json out.json
    python benchmarks/replicas_loop.py --control     # A/A: no check on either side
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

from slurm_ckpt.core.units import format_bytes, parse_size  # noqa: E402
from slurm_ckpt.job.checkpointer import Checkpointer  # noqa: E402
from slurm_ckpt.job.replicas import ReplicaCheck  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from claims import claim  # noqa: E402

TARGET = 0.995
WORLD = 2


class Net(nn.Module):
    """A small trained network plus the checkpoint's bulk as never-stepped parameters."""

    def __init__(self, bulk_bytes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128))
        self.bulk = nn.Parameter(torch.randn(max(1, bulk_bytes // 4)), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def agree(*flags: bool) -> List[bool]:
    """Every rank's flags OR-ed: both ranks save and end the window at the same step."""
    t = torch.tensor([int(f) for f in flags], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def exchange_cost(rank: int, n: int) -> Dict[str, float]:
    """The mechanism's own price, measured apart from the noisy steps/s: the CPU time
    (this process, every thread: gloo's included) and wall time of one digest exchange
    as a save makes it (8 files), averaged over ``n`` exchanges on an otherwise idle
    pair of ranks. On CPUs the training saturates, the steps/s the check can take is
    about this CPU time times the saves per second: a figure the side-by-side ratio,
    whose noise on a shared machine is about 1 %, cannot resolve by itself."""
    check = ReplicaCheck(True, rank, f"n{rank}")
    digests = {f"blob{i}": f"{i:032x}" for i in range(8)}
    for i in range(10):  # warm up the group's connections
        check.exchange(i, digests)
    dist.barrier()
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for i in range(n):
        check.exchange(10 + i, digests)
    r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return {"cpu_ms": 1e3 * cpu / n, "wall_ms": 1e3 * (t1 - t0) / n, "n": float(n)}


def worker(rank: int, cfg: Dict[str, Any]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    net = Net(cfg["size"])
    ddp = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=1e-3)
    work = Path(cfg["work"])
    ckpts = {}
    for side in ("on", "off"):  # the same Checkpointer but for replicas=
        ckpts[side] = Checkpointer(
            local=work / f"n{rank}" / side,
            key=f"bench-replicas-{side}",
            rank=rank,
            world_size=WORLD,
            node=f"n{rank}",
            ledger_dir=work / f"n{rank}" / f"ledger-{side}",
            install_signals=False,
            end_time_fn=None,
            keep_local=2,
            replicas=True if side == "on" and not cfg["control"] else None,
        )
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 128, generator=gen)
    counter = [0]

    def step() -> None:
        loss = ddp(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        counter[0] += 1

    def run(side: str, seconds: float, timed: bool) -> Dict[str, Any]:
        ck = ckpts[side]
        dist.barrier()
        t0 = time.perf_counter()
        due = t0 + cfg["save_every"]
        steps = saves = 0
        while True:
            now = time.perf_counter()
            end, save = agree(now - t0 >= seconds, now >= due)
            if end:
                break
            step()
            steps += 1
            if save:
                ck.save({"model": net.state_dict()}, step=counter[0])
                saves += 1
                due += cfg["save_every"]
        took = time.perf_counter() - t0
        ck.wait(flush=False)
        st = ck.stats
        return {
            "steps": steps,
            "saves": saves,
            "seconds": took,
            "steps_per_s": steps / took,
            "stall_s_total": st.stall_s,
            "last_local_s": st.last_local_s,
        }

    run("on", 2.0, False)  # warm up both sides (staging buffers, the gloo group)
    run("off", 2.0, False)
    pairs: List[Dict[str, Any]] = []
    for i in range(cfg["rounds"]):
        order = ("on", "off") if i % 2 == 0 else ("off", "on")
        got: Dict[str, Any] = {}
        for side in order:
            run(side, cfg["settle"], False)  # untimed
            got[side] = run(side, cfg["window"], True)
        got["ratio"] = got["on"]["steps_per_s"] / got["off"]["steps_per_s"]
        pairs.append(got)
        if rank == 0:
            print(
                f"pair {i + 1}/{cfg['rounds']}: on {got['on']['steps_per_s']:.1f} steps/s "
                f"({got['on']['saves']} saves), off {got['off']['steps_per_s']:.1f} "
                f"-> {got['ratio']:.4f}",
                flush=True,
            )
    stats = {side: ck.close() for side, ck in ckpts.items()}
    summary = {
        "checks": stats["on"].replica_checks,
        "suspect": stats["on"].suspect_steps,
        "checks_off": stats["off"].replica_checks,
        "exchange": exchange_cost(rank, cfg["exchanges"]),
    }
    (work / f"result.rank{rank}.json").write_text(json.dumps({"pairs": pairs, "summary": summary}))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default=None, help="bulk state per rank (32MiB; --quick 4MiB)")
    ap.add_argument("--window", type=float, default=None, help="timed window, s (10)")
    ap.add_argument("--rounds", type=int, default=None, help="pairs of windows (8)")
    ap.add_argument(
        "--save-every", type=float, default=None, help="s between saves (2; --quick 0.5)"
    )
    ap.add_argument("--settle", type=float, default=1.0, help="untimed training between windows")
    ap.add_argument("--quick", action="store_true", help="smoke run: small and short")
    ap.add_argument(
        "--control",
        action="store_true",
        help="A/A control: neither side checks (the machine's noise and any bias of the method)",
    )
    ap.add_argument("--dir", help="work directory (default: a temp dir under /var/tmp)")
    ap.add_argument("--json", help="write all figures here")
    args = ap.parse_args(argv)
    q = args.quick
    cfg: Dict[str, Any] = {
        "size": parse_size(args.size or ("4MiB" if q else "32MiB")),
        "window": args.window or (2.0 if q else 10.0),
        "rounds": args.rounds or (2 if q else 8),
        "save_every": args.save_every or (0.5 if q else 2.0),
        "settle": args.settle,
        "control": args.control,
        "exchanges": 20 if q else 200,
        "port": free_port(),
    }
    if cfg["window"] <= 0 or cfg["rounds"] < 1 or cfg["save_every"] <= 0 or cfg["settle"] < 0:
        print("replicas_loop: --window > 0, --rounds >= 1, --save-every > 0, --settle >= 0")
        return 2
    work = Path(tempfile.mkdtemp(prefix="ckpt-replicasloop-", dir=args.dir or "/var/tmp"))
    os.chmod(work, 0o700)
    cfg["work"] = str(work)
    load_start = os.getloadavg()
    print(
        f"replica digest check on vs off: {WORLD} ranks (DDP, gloo, 127.0.0.1), "
        f"{format_bytes(cfg['size'])} per rank, a save every {cfg['save_every']:g}s, "
        f"{cfg['rounds']} pairs of {cfg['window']:.0f}s windows (A/B/B/A); "
        f"{os.cpu_count()} CPUs, load average {load_start[0]:.1f}",
        flush=True,
    )
    try:
        mp.start_processes(worker, args=(cfg,), nprocs=WORLD, join=True, start_method="spawn")
        docs = [json.loads((work / f"result.rank{r}.json").read_text()) for r in range(WORLD)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [d["pairs"] for d in docs]
    n = len(rows[0])
    ratios = [statistics.mean(rows[k][i]["ratio"] for k in range(WORLD)) for i in range(n)]
    r0 = rows[0]
    result: Dict[str, Any] = {
        "config": {k: v for k, v in cfg.items() if k not in ("port", "work")},
        "cpus": os.cpu_count(),
        "loadavg_at_start": load_start,
        "loadavg_at_end": os.getloadavg(),
        "pairs": rows,
        "summary": [d["summary"] for d in docs],
        "claims": [
            claim(
                "replicas_steps_per_s_on_vs_off",
                ratios,
                what=(
                    f"training steps/s, replicas compare digests at every save ({WORLD} "
                    f"ranks, {format_bytes(cfg['size'])}, a save every {cfg['save_every']:g}s)"
                ),
                baseline="the same loop, no replica check",
                target=TARGET,
                cmp=">=",
                ours_s=[x["on"]["steps_per_s"] for x in r0],
                baseline_s=[x["off"]["steps_per_s"] for x in r0],
            )
        ],
    }
    c = result["claims"][0]
    checks = [d["summary"]["checks"] for d in docs]
    print(
        f"steps/s with the check / without: median {c['median']:.4f} "
        f"(min {c['min']:.4f}, max {c['max']:.4f}; target >= {TARGET}): {c['verdict']}; "
        f"saves compared per rank {checks}, suspect "
        f"{[d['summary']['suspect'] for d in docs]}; load average at end "
        f"{result['loadavg_at_end'][0]:.1f}",
        flush=True,
    )
    ex = [d["summary"]["exchange"] for d in docs]
    cpu_ms = max(e["cpu_ms"] for e in ex)
    print(
        f"one exchange (8 files): {cpu_ms:.2f} ms CPU, "
        f"{max(e['wall_ms'] for e in ex):.2f} ms wall per rank; at a save every "
        f"{cfg['save_every']:g}s that is {100 * cpu_ms / 1e3 / cfg['save_every']:.3f} % of one "
        "core: the most the check itself can take from the steps/s above",
        flush=True,
    )
    result["exchange"] = {"per_rank": ex, "cpu_share_of_one_core": cpu_ms / 1e3 / cfg["save_every"]}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if args.control or all(x > 0 for x in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
