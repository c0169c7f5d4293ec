#!/usr/bin/env python3
"""Run every benchmark of the project, each side by side with its baseline, in one run,
and write BENCHMARKS.md plus a PNG chart of the ratios.

Why one command: a figure in the README is only as good as the run it came from. This
runs them all on one machine, one after the other, records the machine (CPU, cores,
memory, disk, kernel, filesystems), and writes what every benchmark measured: per claim
the median ratio, its spread over the rounds, the target, and the verdict. Nothing in
BENCHMARKS.md is written by hand; rerun this to refresh it.

    benchmarks/report                 # the full run (about an hour on 2 cores)
    benchmarks/report --quick         # small sizes, few rounds: checks the machinery

Each benchmark writes its figures as JSON with a ``claims`` list (benchmarks/claims.py);
a benchmark that fails to run is reported as such, with its last lines of output.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

#: (name, title, argv builder(out_json, quick) -> argv, timeout seconds)
BENCHES = [
    (
        "storage",
        "Storage: commit and copy",
        lambda out, q: [
            "storage.py",
            "--json",
            out,
            "--size",
            "256MiB" if q else "1GiB",
            "--rounds",
            "1" if q else "9",
        ],
        3600,
    ),
    (
        "in_job",
        "In the job: save, restore, training loop",
        lambda out, q: (
            ["in_job.py", "--json", out]
            + (
                ["--quick"]
                if q
                else ["--rounds", "5", "--restore-rounds", "9", "--loop-rounds", "2"]
            )
        ),
        7200,
    ),
    (
        "status",
        "Operator: ckpt-slurm status",
        lambda out, q: [
            "status.py",
            "--out",
            out,
            "--sizes",
            "100" if q else "250,500,1000",
            "--rounds",
            "3" if q else "9",
        ],
        3600,
    ),
    (
        "s3",
        "Object tier: upload and download vs boto3",
        lambda out, q: ["s3.py", "--json", out] + (["--quick"] if q else []),
        3600,
    ),
    (
        "load",
        "Load: many jobs saving at once",
        lambda out, q: ["load.py", "--json", out] + (["--quick"] if q else []),
        3600,
    ),
    (
        "dcp",
        "torch.distributed.checkpoint: our backend vs FileSystemWriter/Reader",
        lambda out, q: ["dcp.py", "--json", out] + (["--quick"] if q else []),
        1800,
    ),
    (
        "partner",
        "Partner copies: a lost rank's restore from its partner vs a capped PFS",
        lambda out, q: ["partner.py", "--json", out] + (["--quick"] if q else []),
        1800,
    ),
    (
        "restore_scale",
        "Restore at scale: read once per replica group vs one rank alone and dcp.load",
        lambda out, q: ["restore_scale.py", "--json", out] + (["--quick"] if q else []),
        1800,
    ),
    (
        "fleet_sim",
        "Fleet: 10,000 nodes flushing to one PFS (simulation)",
        lambda out, q: (
            ["fleet_sim.py", "--json", out, "--png", str(HERE / "fleet_sim.png")]
            + (["--nodes", "1000"] if q else [])
        ),
        1800,
    ),
    (
        "partner_loop",
        "Partner copies: training throughput on vs off",
        lambda out, q: ["partner_loop.py", "--json", out] + (["--quick"] if q else []),
        1800,
    ),
    (
        "replicas_loop",
        "Replicas agree: training throughput with the digest check on vs off",
        lambda out, q: ["replicas_loop.py", "--json", out] + (["--quick"] if q else []),
        1800,
    ),
]


def sh(argv: List[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine() -> Dict[str, Any]:
    """What the figures were measured on."""
    cpu = ""
    for line in sh(["lscpu"]).splitlines():
        if line.startswith("Model name:"):
            cpu = line.split(":", 1)[1].strip()
    mem = 0
    try:
        with open("/proc/meminfo") as fh:
            mem = int(fh.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    src = sh(["findmnt", "-no", "SOURCE,FSTYPE", "--target", "/var/tmp"])
    dev = src.split()[0] if src else ""
    disk = sh(["lsblk", "-dno", "NAME,SIZE,ROTA,MODEL", dev]) if dev.startswith("/dev/") else ""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "cpu": cpu or platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "memory_bytes": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "scratch_fs": src,
        "disk": disk or "unknown (virtual disk)",
        "gpu": sh(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]) or None,
        "loadavg_at_start": os.getloadavg(),
    }


def run_bench(name: str, argv: List[str], timeout: int, python: str) -> Dict[str, Any]:
    script = HERE / argv[0]
    if not script.exists():
        return {"status": "not run", "why": f"benchmarks/{argv[0]} is not in this tree"}
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            [python, str(script), *argv[1:]],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO,
        )
    except subprocess.TimeoutExpired:
        return {"status": "timed out", "why": f"after {timeout}s"}
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
    return {"status": "ran", "rc": proc.returncode, "seconds": time.monotonic() - t0, "tail": tail}


def gpu_section(python: str) -> Dict[str, Any]:
    """benchmarks/gpu_check.py when a GPU is present; "not run: no GPU" otherwise."""
    probe = subprocess.run(
        [python, "-c", "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 3)"],
        capture_output=True,
    )
    if probe.returncode == 3:
        return {"status": "not run: no GPU"}
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        out = tmp.name
    res = run_bench("gpu", ["gpu_check.py", "--json", out], 1800, python)
    with contextlib.suppress(OSError, ValueError):
        res["figures"] = json.loads(Path(out).read_text())
    return res


# --------------------------------------------------------------------------- writing


def fmt(x: Optional[float], digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def write_markdown(doc: Dict[str, Any], path: Path, chart: Optional[str]) -> None:
    m = doc["machine"]
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `benchmarks/report{' --quick' if doc['quick'] else ''}` on "
        f"{m['date']}; do not edit by hand, rerun it. Every figure is a ratio of our time to "
        "a baseline's, measured side by side in the same run, round by round (sides "
        "alternating, page cache dropped before each timed operation): the median over "
        "the rounds and the spread (min-max).",
        "",
        "## Machine",
        "",
        f"- CPU: {m['cpu']}, {m['cores']} cores; memory {m['memory_bytes'] / 2**30:.1f} GiB",
        f"- kernel {m['kernel']}, Python {m['python']}",
        f"- scratch filesystem (`/var/tmp`): {m['scratch_fs'] or 'unknown'}; disk: {m['disk']}",
        f"- load average at start: {', '.join(f'{x:.1f}' for x in m['loadavg_at_start'])}",
        "",
        "## Claims",
        "",
        "| benchmark | claim | against | target | median | spread | rounds | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, _title, _argv, _t in BENCHES:
        res = doc["runs"].get(name, {})
        for c in res.get("claims", []):
            target = "-" if c["target"] is None else f"{c['cmp']} {c['target']}"
            lines.append(
                f"| {name} | {c['what']} | {c['baseline']} | {target} | {fmt(c['median'])} | "
                f"{fmt(c['min'])}-{fmt(c['max'])} | {len(c['rounds'])} | {c['verdict']} |"
            )
    below_floor = [
        (name, c)
        for name, _t, _a, _x in BENCHES
        for c in doc["runs"].get(name, {}).get("claims", [])
        if "floor" in c["baseline"] and c["median"] is not None and c["median"] < 1.0
    ]
    for name, c in below_floor:
        lines += [
            "",
            f"Note: {name}'s {c['what']} took {c['median']:.2f}x the time of its floor "
            f"({c['baseline']}). A floor that is slower than what it bounds is not the "
            "device's limit on this machine (a virtual disk whose host may cache recent "
            "writes, and a floor read that pays for its own requests); the ratio is "
            "reported, not claimed.",
        ]
    lines += ["", "## Runs", ""]
    for name, title, _argv, _t in BENCHES:
        res = doc["runs"].get(name, {})
        status = res.get("status", "not run")
        detail = f" in {res['seconds']:.0f}s (exit {res['rc']})" if status == "ran" else ""
        why = f": {res['why']}" if res.get("why") else ""
        lines.append(f"- **{title}** (`benchmarks/{name}.py`): {status}{detail}{why}")
        if status == "ran" and res.get("rc") and res.get("tail"):
            lines += ["", "  ```", *("  " + t for t in res["tail"].splitlines()), "  ```"]
    fleet = doc["runs"].get("fleet_sim", {}).get("figures")
    if fleet:
        lines += [
            "",
            "## Fleet simulation",
            "",
            "The same admission code on a simulated clock; 1 TB/s PFS; other tenants ask for "
            "40% of it.",
            "",
            "| nodes | mode | peak checkpoint demand / PFS | p50 node flush | p99 node flush "
            "| data at risk (mean) | other tenants' least share |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for row in fleet:
            s = row["sim"]
            lines.append(
                f"| {s['nodes']:,} | {s['mode']} | {s['peak_demand'] / s['pfs_bw']:.0%} | "
                f"{s['node_flush_p50']:.1f}s | {s['node_flush_p99']:.1f}s | "
                f"{s['at_risk_mean'] / 2**30:.0f}GiB | {s['tenant_min_share']:.0%} |"
            )
    gpu = doc.get("gpu", {})
    lines += ["", "## GPU", ""]
    fig = gpu.get("figures")
    if fig:
        lines += [
            f"- {fig['gpu']}, {fig['size_bytes'] / 2**30:.1f} GiB of CUDA tensors, "
            f"{len(fig['rounds'])} rounds (`benchmarks/gpu_check.py`)",
            "- the checkpoint holds the values of the moment of save() in every round: "
            f"{fig['all_rounds_hold_save_time_values']}",
            f"- save() stall {fig['stall_median_s']:.3f}s (median) against a pinned "
            f"device-to-host copy of the same bytes {fig['d2h_median_s']:.3f}s",
        ]
    else:
        lines.append(f"- {gpu.get('status', 'not run: no GPU')}")
    if chart:
        lines += ["", "## Chart", "", f"![ratios against targets]({chart})"]
    path.write_text("\n".join(lines) + "\n")


def write_chart(doc: Dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    claims = [c for r in doc["runs"].values() for c in r.get("claims", []) if c["median"]]
    claims = [c for c in claims if c["baseline"] != "an absolute time (seconds), not a ratio"]
    if not claims:
        return False
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(claims) + 1.2))
    ys = range(len(claims))
    med = [c["median"] for c in claims]
    lo = [c["median"] - c["min"] for c in claims]
    hi = [c["max"] - c["median"] for c in claims]
    colors = [
        "tab:green"
        if c["verdict"] == "PASS"
        else "tab:red"
        if c["verdict"] == "FAIL"
        else "tab:gray"
        for c in claims
    ]
    ax.barh(list(ys), med, xerr=[lo, hi], color=colors, alpha=0.8)
    for y, c in zip(ys, claims):
        if c["target"] is not None:
            ax.plot([c["target"]] * 2, [y - 0.4, y + 0.4], color="black", lw=2)
    ax.set_yticks(list(ys))
    ax.set_yticklabels([c["name"] for c in claims], fontsize=8)
    ax.axvline(1.0, color="gray", ls=":", lw=1)
    ax.set_xlabel("ratio to the baseline (median, min-max; black: target)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes and few rounds")
    ap.add_argument("--only", action="append", choices=[b[0] for b in BENCHES])
    ap.add_argument("--out", default=str(REPO / "BENCHMARKS.md"))
    ap.add_argument("--python", default=sys.executable, help="the interpreter to run them with")
    args = ap.parse_args(argv)
    doc: Dict[str, Any] = {"machine": machine(), "quick": args.quick, "runs": {}}
    work = Path(tempfile.mkdtemp(prefix="bench-report-"))
    try:
        for name, title, build, timeout in BENCHES:
            if args.only and name not in args.only:
                continue
            out = str(work / f"{name}.json")
            print(f"[report] {title} ...", flush=True)
            res = run_bench(name, build(out, args.quick), timeout, args.python)
            try:
                figures = json.loads(Path(out).read_text())
            except (OSError, ValueError):
                figures = None
            if figures is not None:
                res["figures"] = figures
                if isinstance(figures, dict):
                    res["claims"] = figures.get("claims", [])
            doc["runs"][name] = res
            print(f"[report]   {res['status']}", flush=True)
        doc["gpu"] = gpu_section(args.python)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = Path(args.out)
    chart = out.with_name("BENCHMARKS.png")
    has_chart = write_chart(doc, chart)
    write_markdown(doc, out, chart.name if has_chart else None)
    (out.with_name("BENCHMARKS.json")).write_text(json.dumps(doc, indent=1, default=str))
    print(f"[report] wrote {out}" + (f" and {chart}" if has_chart else ""))
    bad = [c for r in doc["runs"].values() for c in r.get("claims", []) if c["verdict"] == "FAIL"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
