#!/usr/bin/env python3
"""Training throughput with the RAM tier replicating vs off, side by side in one run
(issue 30, first block).

Claim: a data-parallel training loop keeps at least 0.98x its steps/s with the RAM tier
on - a snapshot of the state in host memory, hashed, and replicated into the partner
rank's memory over the authenticated partner link (docs/in-job-recovery.md) - against
the same loop with the RAM tier off.

Setup (the machinery of benchmarks/partner_loop.py, reused): two ranks, two processes,
gloo over 127.0.0.1 (``DistributedDataParallel``), each rank a "node" of its own; each
rank's state a small trained network plus ``--size`` bytes of bulk parameters.
``TorchCheckpointer.ram_save()`` is called after every optimizer step in an on window,
not at all in an off window (same Checkpointer, its RAM tier idle). No disk save runs in
a window: this measures the RAM tier alone.

``--every``: ``auto`` (the default: the interval the RAM tier picks at run time to stay
within ``--budget`` of step time) or N (a snapshot and its copy every N steps; 1 is
every step, whatever it costs).

Method (as partner_loop.py): windows of ``--window`` seconds in pairs, on/off in A/B/B/A
order; each pair's ratio is on / off steps/s, the figure is the median of the paired
ratios. Between windows, untimed: both ranks wait until their RAM copies are done, then
train ``--settle`` seconds more. Both ranks take every decision together (one tiny
all-reduce per step). Also reported: snapshots taken and replicated, how many were
superseded before their copy ("cannot keep up"), the interval chosen, and a drift-free
figure (the steps that overlapped a RAM copy against the same window's other steps).

    python benchmarks/ram_tier.py               # 64 MiB per rank, every auto, 10 pairs
    python benchmarks/ram_tier.py --every 1     # every step, whatever it costs
    python benchmarks/ram_tier.py --quick       # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from claims import claim  # noqa: E402
from partner_loop import (  # noqa: E402
    WORLD,
    Net,
    agree,
    free_port,
    open_checkpointer,
    overlap_bounds,
    paired_ratios,
    quartiles,
    run_ranks,
)
from torch import nn  # noqa: E402

from slurm_ckpt import torch as sct  # noqa: E402
from slurm_ckpt.core.units import format_bytes, parse_size  # noqa: E402
from slurm_ckpt.job.checkpointer import Checkpointer  # noqa: E402
from slurm_ckpt.job.options import RamOptions  # noqa: E402

TARGET = 0.98


def settle(ckpt: Checkpointer, step: Any, seconds: float) -> None:
    """Untimed, between windows: this rank's RAM copies done, the other's too, then
    ``seconds`` more training."""
    assert ckpt.ram is not None
    ckpt.ram.wait_idle(120)
    dist.barrier()
    t0 = time.perf_counter()
    while not agree(time.perf_counter() >= t0 + seconds)[0]:
        step()


def window(
    tc: sct.TorchCheckpointer, ckpt: Checkpointer, on: bool, seconds: float, step: Any, n: List[int]
) -> Dict[str, Any]:
    """One timed window; with ``on``, ram_save() after every step."""
    ram = ckpt.ram
    assert ram is not None
    s0 = ram.stats
    dist.barrier()
    durations: List[float] = []
    busy: List[bool] = []
    taken = 0
    t0 = time.perf_counter()
    last, last_busy = t0, False
    while True:
        step()
        n[0] += 1
        if on and tc.ram_save(step=n[0]):
            taken += 1
        now = time.perf_counter()
        b = on and not ram.idle()
        durations.append(now - last)
        busy.append(b or last_busy)
        last, last_busy = now, b
        if agree(now >= t0 + seconds)[0]:
            break
    elapsed = time.perf_counter() - t0
    s1 = ram.stats
    quiet = [d for d, x in zip(durations, busy) if not x]
    base = statistics.median(quiet) if quiet else 0.0
    return {
        "side": "on" if on else "off",
        "steps": len(durations),
        "seconds": elapsed,
        "steps_per_s": len(durations) / elapsed,
        "snapshots_taken": taken,
        "replicated": s1.replicated - s0.replicated,
        "behind": s1.behind - s0.behind,
        "not_taken": s1.not_taken - s0.not_taken,
        "every": s1.every,
        "copy_step_loss_s": sum(d - base for d, x in zip(durations, busy) if x),
    }


def worker(rank: int, cfg: Dict[str, Any]) -> None:
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank, world_size=WORLD
    )
    try:
        torch.manual_seed(0)
        model = Net(cfg["size"])
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = torch.randn(64, 256), torch.randn(64, 256)

        def step() -> None:
            loss = (ddp(x) - y).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

        for _ in range(20):  # warm-up, untimed
            step()
        work = Path(cfg["work"])
        every = cfg["every"]
        ram = RamOptions(every=every if every == "auto" else int(every), budget=cfg["budget"])
        ckpt = open_checkpointer(rank, work, None, ram=ram)
        tc = sct.TorchCheckpointer(ckpt, model, opt, rng=False)
        n = [0]
        # Untimed first window: buffers allocated, the partner found, the interval set.
        window(tc, ckpt, True, cfg["window"], step, n)
        rows: List[Dict[str, Any]] = []
        for p in range(cfg["rounds"]):
            order = [True, False] if p % 2 == 0 else [False, True]
            pair: Dict[str, Any] = {"order": ["on" if o else "off" for o in order]}
            for on in order:
                settle(ckpt, step, cfg["settle"])
                pair["on" if on else "off"] = window(tc, ckpt, on, cfg["window"], step, n)
            pair["ratio"] = pair["on"]["steps_per_s"] / pair["off"]["steps_per_s"]
            rows.append(pair)
            if rank == 0:
                w = pair["on"]
                print(
                    f"  pair {p + 1:2d} [{'/'.join(pair['order'])}]: off "
                    f"{pair['off']['steps_per_s']:.1f} steps/s, on {w['steps_per_s']:.1f} -> "
                    f"ratio {pair['ratio']:.3f}  ({w['snapshots_taken']} snapshots, "
                    f"{w['replicated']} replicated, {w['behind']} behind, every {w['every']})",
                    flush=True,
                )
        settle(ckpt, step, 0.0)
        assert ckpt.ram is not None
        rs = ckpt.ram.stats
        dist.barrier()
        tc.close()
        summary = {
            "snapshots": rs.snapshots,
            "replicated": rs.replicated,
            "behind": rs.behind,
            "not_taken": rs.not_taken,
            "failures": rs.replica_failures + rs.receive_failures + rs.refused,
            "every": rs.every,
            "step_s": rs.step_s,
            "cost_s": rs.cost_s,
            "copy_s": rs.copy_s,
        }
        (work / f"result.rank{rank}.json").write_text(
            json.dumps({"pairs": rows, "summary": summary})
        )
    finally:
        dist.destroy_process_group()


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default=None, help="bulk state per rank (64MiB; --quick 8MiB)")
    ap.add_argument("--every", default="auto", help='"auto" or N steps (default auto)')
    ap.add_argument("--budget", type=float, default=0.02, help="share of step time, auto")
    ap.add_argument("--window", type=float, default=None, help="seconds per window (10)")
    ap.add_argument("--rounds", type=int, default=None, help="pairs of on+off windows (10)")
    ap.add_argument("--settle", type=float, default=1.0, help="untimed training between windows")
    ap.add_argument("--quick", action="store_true", help="smoke run: small and short")
    ap.add_argument("--dir", help="work directory (default: a temp dir under /var/tmp)")
    ap.add_argument("--json", help="write all figures here")
    args = ap.parse_args(argv)
    q = args.quick
    if args.every != "auto" and not (args.every.isdigit() and int(args.every) >= 1):
        print('ram_tier: --every must be "auto" or a whole number >= 1')
        return 2
    cfg: Dict[str, Any] = {
        "size": parse_size(args.size or ("8MiB" if q else "64MiB")),
        "every": args.every,
        "budget": args.budget,
        "window": args.window or (3.0 if q else 10.0),
        "rounds": args.rounds or (2 if q else 10),
        "settle": args.settle,
        "port": free_port(),
    }
    if cfg["window"] <= 0 or cfg["rounds"] < 1 or cfg["settle"] < 0 or not 0 < args.budget <= 1:
        print("ram_tier: --window > 0, --rounds >= 1, --settle >= 0, 0 < --budget <= 1")
        return 2
    load = os.getloadavg()
    print(
        f"RAM tier on vs off: {WORLD} ranks (gloo, 127.0.0.1), {format_bytes(cfg['size'])} "
        f"bulk per rank, every {cfg['every']} (budget {cfg['budget']:.0%}), "
        f"{cfg['rounds']} pairs of {cfg['window']:.0f}s windows (A/B/B/A); {os.cpu_count()} "
        f"CPUs, load average {load[0]:.1f}",
        flush=True,
    )
    docs = run_ranks(worker, cfg, "ckpt-ramtier-", args.dir)
    rows = [d["pairs"] for d in docs]
    n = len(rows[0])
    ratios = paired_ratios(rows)
    overlap = overlap_bounds(rows)
    r0 = rows[0]
    summaries = [d["summary"] for d in docs]
    failures = sum(s["failures"] for s in summaries)
    result: Dict[str, Any] = {
        "config": {k: v for k, v in cfg.items() if k not in ("port", "work")},
        "cpus": os.cpu_count(),
        "loadavg_at_start": load,
        "loadavg_at_end": os.getloadavg(),
        "pairs": rows,
        "summary": summaries,
        "ratio_quartiles": quartiles(ratios),
        "claims": [
            claim(
                "ram_tier_steps_per_s_on_vs_off",
                ratios,
                what=(
                    f"training steps/s, RAM tier replicating every {cfg['every']} "
                    f"({WORLD} ranks, {format_bytes(cfg['size'])} per rank)"
                ),
                baseline="the same loop, RAM tier off",
                target=TARGET,
                cmp=">=",
                ours_s=[x["on"]["steps_per_s"] for x in r0],
                baseline_s=[x["off"]["steps_per_s"] for x in r0],
            ),
            claim(
                "ram_tier_overlap_estimate_on_vs_off",
                overlap,
                what="the same, drift free: 1 - the time lost in the steps that overlapped "
                "a RAM copy (against the same window's other steps) / the window",
                baseline="the on window's own steps outside the copies",
            ),
        ],
    }
    c, o = result["claims"]
    q1, q3 = result["ratio_quartiles"]
    s = summaries[0]
    print(
        f"\nRAM tier on vs off: steps/s ratio median {c['median']:.3f} of {n} pairs "
        f"(quartiles {q1:.3f}-{q3:.3f}, min {c['min']:.3f}, max {c['max']:.3f}; target >= "
        f"{TARGET}) {c['verdict']}; rank 0: {s['snapshots']} snapshots, {s['replicated']} "
        f"replicated, {s['behind']} superseded before their copy, {s['not_taken']} not taken, "
        f"{failures} failures (both ranks); interval every {s['every']} steps (step "
        f"{1000 * (s['step_s'] or 0):.1f} ms, cost {1000 * (s['cost_s'] or 0):.1f} ms, copy "
        f"{1000 * (s['copy_s'] or 0):.1f} ms); drift free: median {o['median']:.3f}",
        flush=True,
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 0 if c["verdict"] == "PASS" and failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
