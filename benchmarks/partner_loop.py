#!/usr/bin/env python3
"""Training throughput with partner copies on vs off, side by side in one run (issue 21).

Claim (issue 21, "Must show"): a data-parallel training loop that checkpoints often keeps
at least 0.98x its steps/s when every committed checkpoint is also copied to the partner
node's local tier (docs/partner.md), against the same loop with partner copies off.

Setup: two ranks, two processes, gloo over 127.0.0.1 (``DistributedDataParallel``), each
rank a "node" of its own: its own local tier and ledger under the work directory; the
partner copies travel over real TCP between the two processes, authenticated with the
job's secret, and are committed on the other rank's local tier, as on a cluster. Each
rank's state is a small trained network plus ``--size`` bytes of bulk held as parameters
the optimizer owns but never steps (the lazy snapshot defers them, the next optimizer
step waits for the copy), saved through ``TorchCheckpointer`` once per window.

Method. A window is one save interval (``--every`` seconds) of training with one save
at a third of it, so the save's local write and, when copies are on, its partner copy
end inside the window (checked: a window whose copy was still running at its end is
counted and reported). Windows come in pairs, one with partner copies on and one off,
in A/B/B/A order (on/off, off/on, ...), so a drift of the shared machine's speed hits
both sides alike; each pair's ratio is on / off steps/s and the figure is the median of
the paired ratios (with min, max and quartiles). Adjacent windows of 15 s pair far more
tightly than phases of minutes: this VM's speed drifts by 5-15 % over a minute.

Between windows, untimed: both ranks wait until their local writes and partner copies
are done, then train ``--settle`` seconds more, so no window inherits the previous one's
work. Both ranks take every decision together (one tiny all-reduce per step: save now,
end the window now), so they save at the same step.

On and off use one Checkpointer per rank with partner copies switched on; in an off
window its saves are simply not offered to the partner link (the link's threads then
sleep; its accept loop wakes twice a second). Everything else is the same on both
sides: the Checkpointer, its ``flush_every`` (high: the warm tier is touched by the
untimed first save only), the model, the step, the save interval and size. On a machine
with as many cores as ranks, the partner sender, receiver and the local writers compete
with training for the same cores: the hard case; on a GPU node the training's compute
is not on these cores.

Reported next to the ratio: the same claim estimated from CPU accounting. Per window,
each rank's CPU time outside its training thread (the kernel counts it per thread,
whatever the machine's speed that minute); the partner copy's extra (on minus off, both
ranks) taken from the two ranks' cores gives ``1 - extra / (ranks x window)``.

And a drift-free figure: within each on window, the steps that ran while the copy was
under way against the median of the same window's other steps; ``1 - that time lost /
window``. It counts only the copy's own interval, so it bounds the ratio from above, but
it does not move with the machine's speed from one window to the next.

    python benchmarks/partner_loop.py               # 64 MiB per rank, every 15 s, 12 pairs
    python benchmarks/partner_loop.py --quick       # smoke run
    python benchmarks/partner_loop.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

from slurm_ckpt import torch as sct  # noqa: E402
from slurm_ckpt.core.units import format_bytes, parse_size  # noqa: E402
from slurm_ckpt.job.checkpointer import Checkpointer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from claims import claim  # noqa: E402

TARGET = 0.98
WORLD = 2
KEY = "bench-partner"


class Net(nn.Module):
    """A small trained network plus the checkpoint's bulk as never-stepped parameters."""

    def __init__(self, bulk_bytes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
        n = max(1, bulk_bytes // (16 * 2**20))
        per = max(1, bulk_bytes // n // 4)
        self.bulk = nn.ParameterList(
            nn.Parameter(torch.randn(per), requires_grad=False) for _ in range(n)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def agree(*flags: bool) -> List[bool]:
    """Every rank's flags OR-ed: both ranks save and stop at the same step."""
    t = torch.tensor([int(f) for f in flags], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def open_checkpointer(
    rank: int, work: Path, bandwidth: Optional[str], **extra: Any
) -> Checkpointer:
    """This rank's Checkpointer, partner copies on (off windows withhold the offer);
    ``extra``: more options (benchmarks/ram_tier.py turns the RAM tier on)."""
    node = f"n{rank}"
    root = work / node
    for d in (root / "local", root / "ledger", work / "warm", work / "rendezvous"):
        d.mkdir(parents=True, exist_ok=True)
    os.chmod(root / "ledger", 0o700)
    ckpt = Checkpointer(
        local=root / "local",
        warm=work / "warm",
        key=KEY,
        rank=rank,
        world_size=WORLD,
        node=node,
        job="bench",
        ledger_dir=root / "ledger",
        install_signals=False,
        end_time_fn=None,
        flush_every=1000,
        keep_local=2,
        partner=True,
        keep_partner=2,
        partner_dir=work / "rendezvous",
        partner_host="127.0.0.1",
        partner_bandwidth=bandwidth,
        **extra,
    )
    if ckpt.partner is None:
        raise RuntimeError("partner copies did not start")
    return ckpt


class Gate:
    """Offers a committed step to the partner link only while ``on`` (the off windows)."""

    def __init__(self, offer: Any) -> None:
        self.offer, self.on = offer, True

    def __call__(self, step: int) -> None:
        if self.on:
            self.offer(step)


def settle(ckpt: Checkpointer, step: Any, seconds: float, partner_timeout: float = 120.0) -> None:
    """Untimed, between windows: this rank's writes and partner copy done, then the other
    rank's too (its receiver must stay up), then ``seconds`` more training."""
    ckpt.wait(flush=True)
    assert ckpt.partner is not None
    ckpt.partner.wait_idle(partner_timeout)
    dist.barrier()
    t0 = time.perf_counter()
    while not agree(time.perf_counter() >= t0 + seconds)[0]:
        step()


def window(
    tc: sct.TorchCheckpointer,
    ckpt: Checkpointer,
    gate: Gate,
    on: bool,
    every: float,
    step: Any,
    counter: List[int],
) -> Dict[str, Any]:
    """One timed window of ``every`` seconds with one save at a third of it."""
    assert ckpt.partner is not None
    gate.on = on
    sent0 = ckpt.partner.stats.sent
    load0 = os.getloadavg()[0]
    dist.barrier()
    steps, saves, stall = 0, 0, 0.0
    t0 = time.perf_counter()
    cpu0, main0 = time.process_time(), time.thread_time()
    save_at = t0 + every / 3
    saved = False
    link = ckpt.partner
    # Per step: its wall time and whether this rank's partner copy was under way (the
    # other rank's copy runs at the same time), for the drift-free estimate below.
    durations: List[float] = []
    busy: List[bool] = []
    last, last_busy = t0, False
    while True:
        step()
        steps += 1
        counter[0] += 1
        now = time.perf_counter()
        b = on and not link.idle()
        durations.append(now - last)
        busy.append(b or last_busy)
        last, last_busy = now, b
        save, stop = agree(not saved and now >= save_at, now >= t0 + every)
        if stop:
            break
        if save:
            saved = True
            s0 = time.perf_counter()
            tc.save(step=counter[0])
            stall += time.perf_counter() - s0
            saves += 1
    elapsed = time.perf_counter() - t0
    # CPU time of this rank's threads other than the training thread, in the window:
    # the local writer, the partner sender and receiver, gloo's own threads (the same on
    # both sides). Counted by the kernel per thread, so unlike steps/s it does not move
    # with the speed of the machine from one window to the next.
    background_cpu = (time.process_time() - cpu0) - (time.thread_time() - main0)
    # Did this window's copy end inside it (sent, nothing queued or on the wire)?
    spill = bool(on and not (ckpt.partner.idle() and ckpt.partner.stats.sent > sent0))
    # Drift free: the steps that overlapped the copy against the median of the same
    # window's other steps (the machine's speed cannot change much within seconds). It
    # counts only the time lost while the copy ran: a lower bound on its cost.
    quiet = [d for d, x in zip(durations, busy) if not x]
    base = statistics.median(quiet) if quiet else 0.0
    copy_loss = sum(d - base for d, x in zip(durations, busy) if x)
    return {
        "side": "on" if on else "off",
        "background_cpu_s": background_cpu,
        "steps": steps,
        "seconds": elapsed,
        "steps_per_s": steps / elapsed,
        "saves": saves,
        "save_block_s": stall,
        "copy_not_done_at_end": spill,
        "copy_steps": sum(busy),
        "copy_step_loss_s": copy_loss,
        "loadavg_1m_before": load0,
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
        x = torch.randn(64, 256)
        y = torch.randn(64, 256)

        def step() -> None:
            loss = (ddp(x) - y).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

        for _ in range(20):  # warm-up, untimed
            step()
        work = Path(cfg["work"])
        ckpt = open_checkpointer(rank, work, cfg["bandwidth"])
        assert ckpt.partner is not None
        # The benchmark's switch between on and off windows: the pipeline's hook that
        # hands each committed step to the partner link (job/checkpointer.py).
        gate = Gate(ckpt._pipeline.after_commit)
        ckpt._pipeline.after_commit = gate
        tc = sct.TorchCheckpointer(ckpt, model, opt, rng=False)
        counter = [0]
        # Untimed first window: the first save (the warm tier's), the partner found.
        window(tc, ckpt, gate, True, cfg["every"], step, counter)
        rows: List[Dict[str, Any]] = []
        for p in range(cfg["rounds"]):
            order = [True, False] if p % 2 == 0 else [False, True]
            pair: Dict[str, Any] = {"order": ["on" if o else "off" for o in order]}
            for on in order:
                settle(ckpt, step, cfg["settle"])
                pair["on" if on else "off"] = window(
                    tc, ckpt, gate, on, cfg["every"], step, counter
                )
            pair["ratio"] = pair["on"]["steps_per_s"] / pair["off"]["steps_per_s"]
            rows.append(pair)
            if rank == 0:
                on_w, off_w = pair["on"], pair["off"]
                print(
                    f"  pair {p + 1:2d} [{'/'.join(pair['order'])}]: off "
                    f"{off_w['steps_per_s']:.1f} steps/s, on {on_w['steps_per_s']:.1f} -> "
                    f"ratio {pair['ratio']:.3f}  (load average "
                    f"{pair['on']['loadavg_1m_before']:.1f})",
                    flush=True,
                )
        settle(ckpt, step, 0.0)
        ps = ckpt.partner.stats
        dist.barrier()
        stats = tc.close()
        summary = {
            "partner_sent": ps.sent,
            "partner_received": ps.received,
            "partner_failures": ps.send_failures + ps.receive_failures + ps.refused,
            "partner_skipped": ps.send_skipped,
            "committed": stats.committed,
            "failures": stats.failures + stats.flush_failures,
            "step_wait_s": stats.snapshot_wait_s,
        }
        Path(work / f"result.rank{rank}.json").write_text(
            json.dumps({"pairs": rows, "summary": summary})
        )
    finally:
        dist.destroy_process_group()


def quartiles(xs: List[float]) -> List[float]:
    """First and third quartile (the spread of the paired ratios, besides min and max)."""
    if len(xs) < 2:
        return [xs[0], xs[0]] if xs else []
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return [q[0], q[2]]


def run_ranks(worker: Any, cfg: Dict[str, Any], prefix: str, base: Optional[str]) -> List[Any]:
    """Run ``worker`` on every rank in a fresh private work directory (``cfg["work"]``) and
    return each rank's ``result.rankN.json``; the directory goes either way."""
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=base or "/var/tmp"))
    os.chmod(work, 0o700)
    cfg["work"] = str(work)
    try:
        mp.start_processes(worker, args=(cfg,), nprocs=WORLD, join=True, start_method="spawn")
        return [json.loads((work / f"result.rank{r}.json").read_text()) for r in range(WORLD)]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def paired_ratios(rows: List[Any]) -> List[float]:
    """Each pair's on/off steps/s, the mean over the ranks (both run the same steps; their
    ratios differ by the spread of their clocks)."""
    return [statistics.mean(rows[k][i]["ratio"] for k in range(WORLD)) for i in range(len(rows[0]))]


def overlap_bounds(rows: List[Any]) -> List[float]:
    """The drift-free lower bound on the cost, as a ratio: 1 - the on window's time lost in
    the steps that overlapped its copy / the window (mean of the ranks)."""
    return [
        1.0
        - statistics.mean(
            rows[k][i]["on"]["copy_step_loss_s"] / rows[k][i]["on"]["seconds"] for k in range(WORLD)
        )
        for i in range(len(rows[0]))
    ]


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default=None, help="bulk state per rank (64MiB; --quick 8MiB)")
    ap.add_argument("--every", type=float, default=None, help="save period = window, s (15)")
    ap.add_argument("--rounds", type=int, default=None, help="pairs of on+off windows (12)")
    ap.add_argument("--settle", type=float, default=2.0, help="untimed training between windows, s")
    ap.add_argument("--bandwidth", default=None, help="partner copy cap, e.g. 200MB/s (none)")
    ap.add_argument("--quick", action="store_true", help="smoke run: small and short")
    ap.add_argument("--dir", help="work directory (default: a temp dir under /var/tmp)")
    ap.add_argument("--json", help="write all figures here")
    args = ap.parse_args(argv)
    q = args.quick
    cfg: Dict[str, Any] = {
        "size": parse_size(args.size or ("8MiB" if q else "64MiB")),
        "every": args.every or (3.0 if q else 15.0),
        "rounds": args.rounds or (2 if q else 12),
        "settle": args.settle,
        "bandwidth": args.bandwidth,
        "port": free_port(),
    }
    if cfg["every"] <= 0 or cfg["rounds"] < 1 or cfg["settle"] < 0:
        print("partner_loop: --every must be above 0, --rounds at least 1, --settle >= 0")
        return 2
    load_start = os.getloadavg()
    print(
        f"partner copies on vs off: {WORLD} ranks (gloo, 127.0.0.1), "
        f"{format_bytes(cfg['size'])} bulk per rank, one save per {cfg['every']:.0f}s window, "
        f"{cfg['rounds']} pairs of windows (A/B/B/A), {cfg['settle']:.0f}s settling; "
        f"{os.cpu_count()} CPUs, partner cap {args.bandwidth or 'none'}; load average "
        f"{load_start[0]:.1f}",
        flush=True,
    )
    docs = run_ranks(worker, cfg, "ckpt-partnerloop-", args.dir)
    rows = [d["pairs"] for d in docs]
    n = len(rows[0])
    ratios = paired_ratios(rows)
    # The same claim estimated from CPU accounting: the partner copy's extra CPU time
    # (on minus off, both ranks, in the window), taken from cores that the two ranks
    # otherwise keep busy: 1 - extra / (ranks x window). Robust to the machine's drift
    # between windows; it assumes every extra CPU-second is one training loses.
    cpu_ratios = [
        1.0
        - sum(
            rows[k][i]["on"]["background_cpu_s"] - rows[k][i]["off"]["background_cpu_s"]
            for k in range(WORLD)
        )
        / (WORLD * cfg["every"])
        for i in range(n)
    ]
    overlap_ratios = overlap_bounds(rows)
    r0 = rows[0]
    pooled = (sum(x["on"]["steps"] for x in r0) / sum(x["on"]["seconds"] for x in r0)) / (
        sum(x["off"]["steps"] for x in r0) / sum(x["off"]["seconds"] for x in r0)
    )
    summary = docs[0]["summary"]
    failures = sum(d["summary"]["partner_failures"] for d in docs)
    spills = sum(x["on"]["copy_not_done_at_end"] for rk in rows for x in rk)
    # the untimed first window sends one copy; every on window one more
    sent_ok = all(d["summary"]["partner_sent"] == n + 1 for d in docs)
    result: Dict[str, Any] = {
        "config": {k: v for k, v in cfg.items() if k not in ("port", "work")},
        "cpus": os.cpu_count(),
        "loadavg_at_start": load_start,
        "loadavg_at_end": os.getloadavg(),
        "pairs": rows,
        "summary": [d["summary"] for d in docs],
        "pooled_ratio": pooled,
        "ratio_quartiles": quartiles(ratios),
        "copies_not_done_at_window_end": spills,
        "claims": [
            claim(
                "partner_steps_per_s_on_vs_off",
                ratios,
                what=(
                    f"training steps/s, partner copies on ({WORLD} ranks, "
                    f"{format_bytes(cfg['size'])} per rank every {cfg['every']:.0f}s)"
                ),
                baseline="the same loop, partner copies off",
                target=TARGET,
                cmp=">=",
                ours_s=[x["on"]["steps_per_s"] for x in r0],
                baseline_s=[x["off"]["steps_per_s"] for x in r0],
            ),
            claim(
                "partner_cpu_estimate_on_vs_off",
                cpu_ratios,
                what="the same, estimated from the partner copies' extra CPU time "
                "(1 - extra CPU-s of both ranks / (ranks x window))",
                baseline="the same loop, partner copies off",
                ours_s=[
                    sum(rows[k][i]["on"]["background_cpu_s"] for k in range(WORLD))
                    for i in range(n)
                ],
                baseline_s=[
                    sum(rows[k][i]["off"]["background_cpu_s"] for k in range(WORLD))
                    for i in range(n)
                ],
            ),
            claim(
                "partner_overlap_estimate_on_vs_off",
                overlap_ratios,
                what="the same, drift free: 1 - the time lost in the steps that overlapped "
                "the copy (against the same window's other steps) / the window; counts "
                "only the copy's own interval, so an upper bound on the ratio",
                baseline="the on window's own steps outside the copy",
            ),
        ],
    }
    c = result["claims"][0]
    q1, q3 = result["ratio_quartiles"]
    print(
        f"\npartner copies on vs off: steps/s ratio median {c['median']:.3f} of {n} pairs "
        f"(quartiles {q1:.3f}-{q3:.3f}, min {c['min']:.3f}, max {c['max']:.3f}; pooled "
        f"{pooled:.3f}; target >= {TARGET}) {c['verdict']}; partner copies sent "
        f"{summary['partner_sent']} per rank, {failures} failed, {spills} not done at "
        f"their window's end; load average {load_start[0]:.1f} at start, "
        f"{result['loadavg_at_end'][0]:.1f} at end",
        flush=True,
    )
    e = result["claims"][1]
    print(
        f"estimated from CPU time: median {e['median']:.3f} (min {e['min']:.3f}, max "
        f"{e['max']:.3f}); background CPU-s per window, both ranks: on "
        f"{e['ours_median_s']:.2f}, off {e['baseline_median_s']:.2f}",
        flush=True,
    )
    o = result["claims"][2]
    print(
        f"drift free, the steps that overlapped a copy against the rest of their window: "
        f"median {o['median']:.3f} (min {o['min']:.3f}, max {o['max']:.3f}; an upper bound "
        f"on the ratio)",
        flush=True,
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    ok = c["verdict"] == "PASS" and failures == 0 and sent_ok and spills == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
