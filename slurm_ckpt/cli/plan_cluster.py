"""``ckpt-slurm plan --cluster``: parsing the site's jobs and printing the cluster plan.

The model is :mod:`slurm_ckpt.core.fleet_plan`; this module reads the jobs file (TOML or
JSON) and the ``--job`` flags, and prints a table (or ``--json``). The click options live
on the ``plan`` command in :mod:`slurm_ckpt.cli.plan`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from slurm_ckpt.cli.output import print_json
from slurm_ckpt.cli.table import Column, Listing, OutputFormat, warn
from slurm_ckpt.core.fleet_plan import (
    ClusterPlan,
    FleetJob,
    job_from_flag,
    jobs_from_doc,
    plan_cluster,
)
from slurm_ckpt.core.planner import PlanInputError
from slurm_ckpt.core.units import format_bytes, format_duration

if sys.version_info >= (3, 11):  # pragma: no cover - depends on the interpreter
    import tomllib as _toml
else:  # pragma: no cover
    import tomli as _toml

__all__ = ["load_jobs", "parse_share", "run_cluster_plan"]


def parse_share(text: Optional[str]) -> float:
    """``"70%"``, ``"0.7"`` or ``"70"`` -> 0.7."""
    if text is None:
        return 0.7
    raw = str(text).strip()
    try:
        value = float(raw.rstrip("%"))
    except ValueError:
        raise PlanInputError(f"--share: expected a percentage such as 70%, got {text!r}") from None
    if raw.endswith("%") or value > 1:
        value /= 100.0
    if not 0 < value <= 1:
        raise PlanInputError(f"--share: must be between 0% and 100%, got {text!r}")
    return value


def load_jobs(path: Optional[str], flags: Sequence[str]) -> List[FleetJob]:
    """The jobs of ``--jobs FILE`` (TOML ``[[jobs]]`` tables or JSON) and ``--job`` flags."""
    jobs: List[FleetJob] = []
    if path is not None:
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise PlanInputError(f"--jobs {path}: {exc.strerror or exc}") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise PlanInputError(f"--jobs {path}: not UTF-8 text") from None
        if path.endswith(".json"):
            try:
                doc = json.loads(text)
            except ValueError as exc:
                raise PlanInputError(f"--jobs {path}: JSON syntax error: {exc}") from None
        else:  # TOML, or JSON in a file not named .json
            try:
                doc = _toml.loads(text)
            except _toml.TOMLDecodeError as exc:
                try:
                    doc = json.loads(text)
                except ValueError:
                    raise PlanInputError(f"--jobs {path}: TOML syntax error: {exc}") from None
        jobs.extend(jobs_from_doc(doc, f"--jobs {path}"))
    jobs.extend(job_from_flag(f) for f in flags)
    if not jobs:
        raise PlanInputError(
            "plan --cluster: give the jobs with --jobs FILE or --job "
            "nodes=64,size=20GB,interval=30min (repeatable)"
        )
    return jobs


def _bw(bps: float) -> str:
    return f"{bps / 1e12:g} TB/s" if bps >= 1e12 else f"{bps / 1e9:g} GB/s"


FIGURE_COLUMNS = [
    Column("figure", "figure"),
    Column("value", "value", right=True),
    Column("note", "note", wrap=True, drop=1),
]
JOB_COLUMNS = [
    Column("job", "job"),
    Column("nodes", "nodes", right=True),
    Column("bytes_per_node", "per node", fmt=format_bytes, right=True),
    Column("interval_s", "interval", fmt=format_duration, right=True),
    Column("job_flush", "job flush", right=True, parsable=False),
    Column("job_flush_s", "job flush", human=False),
    Column("fits", "fits", human=False),
    Column("at_risk_bytes", "at risk", fmt=format_bytes, right=True),
    Column("at_risk_work_s", "work at risk", fmt=format_duration, right=True),
]


def _print(plan: ClusterPlan, out: OutputFormat) -> None:
    """The plan as two listings of the one table library (:mod:`.table`): the figures
    and the 20 biggest jobs' data at risk."""
    verdict = "fit" if plan.fits else "do NOT fit"
    if out.human and not out.noheader:
        print(
            f"{plan.jobs} jobs on {plan.nodes:,} nodes, PFS {_bw(plan.pfs_bw)}: "
            f"the checkpoint flushes {verdict} within {plan.share:.0%} of the PFS"
        )
    figures = [
        ("checkpoint traffic", f"{format_bytes(plan.bytes_per_hour)}/h", "all jobs together"),
        ("PFS utilisation", f"{plan.utilisation:.1%}", f"target share {plan.share:.0%}"),
        (
            "peak demand, no admission",
            f"{plan.peak_demand_uncapped / plan.pfs_bw:.0%}",
            f"biggest job at {_bw(plan.node_bw)} per node",
        ),
        ("[admission] max_nodes", str(plan.cap), plan.cap_basis),
        ("or [admission] max_bandwidth", _bw(plan.max_bandwidth), f"{plan.share:.0%} of the PFS"),
        (
            "peak demand, with the cap",
            f"{plan.peak_demand_capped / plan.pfs_bw:.0%}",
            f"{plan.cap} x {_bw(plan.node_bw)}",
        ),
        ("[admission] jitter", format_duration(plan.jitter_s), plan.jitter_basis),
        (
            "jitter without a cap",
            format_duration(plan.jitter_without_cap_s),
            "to keep the biggest burst under the share alone",
        ),
        ("wait for a slot", format_duration(plan.mean_wait_s), "mean over node flushes"),
        ("node flush", format_duration(plan.mean_flush_s), "mean: save -> on the PFS"),
        ("job flush", format_duration(plan.mean_job_flush_s), "mean: save -> last node done"),
        ("worst job flush", format_duration(plan.worst_job_flush_s), "the slowest job"),
    ]
    rows = [{"figure": f, "value": v, "note": n} for f, v, n in figures]
    Listing(FIGURE_COLUMNS, rows, "cluster plan").print(out)
    jobs = sorted(plan.per_job, key=lambda f: -f.checkpoint_bytes)[:20]
    job_rows = [
        {
            "job": f.name if f.count == 1 else f"{f.name} (x{f.count})",
            "nodes": f.nodes,
            "bytes_per_node": f.bytes_per_node,
            "interval_s": f.interval_s,
            "job_flush": format_duration(f.job_flush_s) + ("" if f.fits else " !"),
            "job_flush_s": f.job_flush_s,
            "fits": f.fits,
            "at_risk_bytes": f.at_risk_bytes,
            "at_risk_work_s": f.at_risk_work_s,
        }
        for f in jobs
    ]
    if out.human and not out.noheader:
        print()
    Listing(JOB_COLUMNS, job_rows, "per job: worst-case data at risk").print(out)
    if len(plan.per_job) > 20 and out.human and not out.noheader:
        print(f"({len(plan.per_job) - 20} smaller jobs not shown; --json has all)")
    for w in plan.warnings:
        warn(w)


def run_cluster_plan(
    *,
    jobs_file: Optional[str],
    job_flags: Sequence[str],
    pfs_bw: Optional[str],
    node_bw: Optional[str],
    share: Optional[str],
    tenants: Optional[str],
    cap: Optional[str],
    jitter: Optional[str],
    out: OutputFormat,
) -> None:
    """Parse, plan, print. Raises :class:`PlanInputError` for bad input (exit code 2)."""
    if pfs_bw is None:
        raise PlanInputError("--pfs-bw is required (the PFS's total bandwidth, e.g. 1TB/s)")
    if node_bw is None:
        raise PlanInputError("--node-bw is required (one node's flush rate, e.g. 5GB/s)")
    cap_n: Optional[int] = None
    if cap is not None:
        try:
            cap_n = int(cap)
        except ValueError:
            raise PlanInputError(f"--cap: expected a whole number >= 1, got {cap!r}") from None
    jobs = load_jobs(jobs_file, job_flags)
    plan = plan_cluster(
        jobs,
        pfs_bw,
        node_bw,
        share=parse_share(share),
        tenants=tenants,
        cap=cap_n,
        jitter=jitter,
    )
    if out.json:
        print_json(plan.to_dict())
    else:
        _print(plan, out)
