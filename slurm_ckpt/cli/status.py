"""``ckpt-slurm status``: every job's checkpoints and every node's flush backlog, from a
login node.

Nothing here reads a node's NVMe: the PFS catalog, the node status files on the PFS and
SLURM are enough (see :mod:`slurm_ckpt.cli.status_model` for what is computed and for
the ``--json`` fields). SLURM is reached through :data:`slurm_query`, a function that
tests (or sites with their own scheduler view) can replace; ``--no-slurm`` skips it.

Key directories are created private to their owner, so a plain user sees their own
series; run it as root (or an account that can read the PFS tree) for the whole cluster.
The node status files are world-readable.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Dict, List, Optional

import click

from slurm_ckpt.cli.output import CliState, console, pass_state, print_table
from slurm_ckpt.cli.status_model import (
    SlurmQuery,
    SlurmSnapshot,
    build_status,
    no_slurm,
    query_slurm,
    scan_catalog,
)
from slurm_ckpt.core.config import Config
from slurm_ckpt.core.names import validate_key, validate_node, validate_user
from slurm_ckpt.core.units import format_bytes, format_duration
from slurm_ckpt.ledger.node_status import read_node_statuses

__all__ = ["collect_status", "slurm_query", "status_cmd"]

#: The SLURM view ``status`` uses; replace it to run without (or with another) SLURM.
slurm_query: SlurmQuery = query_slurm


def collect_status(
    cfg: Config,
    *,
    user: Optional[str] = None,
    job: Optional[str] = None,
    key: Optional[str] = None,
    node: Optional[str] = None,
    query: Optional[SlurmQuery] = None,
    now: Optional[float] = None,
) -> Dict[str, Any]:
    """Read the catalog(s), the node status files and SLURM; return the status document.

    ``query`` defaults to :data:`slurm_query`. ``--user``/``--key`` narrow the catalog
    walk itself; ``--job``/``--node`` filter the joined rows.
    """
    if user is not None:
        validate_user(user)
    if key is not None:
        validate_key(key)
    if node is not None:
        validate_node(node)
    pfs_root = str(cfg.tiers.pfs.root)
    pfs = scan_catalog(pfs_root, user=user, key=key)
    cold = None
    if cfg.tiers.cold is not None:
        cold = scan_catalog(str(cfg.tiers.cold.root), user=user, key=key)
    statuses = read_node_statuses(cfg.tiers.pfs.root)
    snapshot = (query or slurm_query)()
    return build_status(
        now=time.time() if now is None else now,
        pfs_root=pfs_root,
        pfs=pfs,
        cold=cold,
        node_statuses=statuses,
        slurm=snapshot,
        user=user,
        job=job,
        key=key,
        node=node,
    )


def write_json(doc: Dict[str, Any]) -> None:
    """The document as JSON with one job (or node) per line.

    Why not :func:`print_json`'s indented layout: on a 1,000-job cluster one entry per
    line is what ``grep`` and ``head`` want, and it keeps encoding in C (indenting every
    field runs json's pure-Python encoder, about a tenth of a second here).
    """
    items = list(doc.items())
    out = ["{"]
    for i, (name, value) in enumerate(items):
        comma = "," if i < len(items) - 1 else ""
        head = f"  {json.dumps(name)}: "
        if isinstance(value, list) and value:
            out.append(head + "[")
            rows = [f"    {json.dumps(v, default=str)}" for v in value]
            out.append(",\n".join(rows))
            out.append(f"  ]{comma}")
        else:
            out.append(f"{head}{json.dumps(value, default=str)}{comma}")
    out.append("}")
    sys.stdout.write("\n".join(out) + "\n")
    sys.stdout.flush()


def _step_age(entry: Optional[Dict[str, Any]]) -> str:
    if entry is None:
        return "-"
    age = entry.get("age_s")
    return (
        f"{entry['step']} ({format_duration(max(age, 0.0))})"
        if age is not None
        else str(entry["step"])
    )


def _rate(bps: Optional[float]) -> str:
    return "-" if bps is None else format_bytes(bps) + "/s"


def _eta(seconds: Optional[float]) -> str:
    return "?" if seconds is None else format_duration(seconds)


def print_status(doc: Dict[str, Any]) -> None:
    """The status document for people: a jobs table and a nodes table."""
    rows: List[List[Any]] = []
    for j in doc["jobs"]:
        risk = "-" if j["steps_at_risk"] is None else f"{j['steps_at_risk']} steps"
        rows.append(
            [
                j["job"] or "-",
                f"{j['user']}/{','.join(j['keys'])}",
                j["slurm_state"],
                ",".join(j["nodes"]) or "-",
                _step_age(j["tiers"]["local"]),
                _step_age(j["tiers"]["pfs"]),
                f"{risk}, {format_bytes(j['bytes_at_risk'])}",
                f"{_eta(j['flush_eta_s'])} @ {_rate(j['flush_rate_bps'])}",
            ]
        )
    headers = ["job", "series", "state", "nodes", "local", "pfs", "at risk", "flush eta"]
    if rows:
        print_table("jobs", rows, headers)
    else:
        console().print("no jobs with checkpoints", markup=False)
    console().print()
    nrows = [
        [
            n["node"],
            "-" if n["status_age_s"] is None else format_duration(max(n["status_age_s"], 0.0)),
            f"{n['pending_checkpoints']} ({format_bytes(n['pending_bytes'])})",
            n["in_flight"],
            n["failed"],
            n["slurm_state"],
            n["drain_reason"] or "-",
        ]
        for n in doc["nodes"]
    ]
    if nrows:
        print_table(
            "nodes",
            nrows,
            ["node", "status age", "pending", "in flight", "failed", "slurm", "our drain"],
        )
    t = doc["totals"]
    note = "" if doc["slurm"]["available"] else f"; SLURM: {doc['slurm']['note']}"
    console().print(
        f"{t['jobs']} jobs, {format_bytes(t['bytes_at_risk'])} at risk in "
        f"{t['checkpoints_at_risk']} checkpoints, {t['in_flight']} flushes in flight, "
        f"{t['drained_by_us']} nodes drained by slurm_ckpt{note}",
        markup=False,
    )


@click.command("status")
@click.option("--user", help="only this user's jobs")
@click.option("--job", help="only this SLURM job id")
@click.option("--key", help="only jobs writing this key")
@click.option("--node", help="only jobs on, and the status of, this node")
@click.option(
    "--no-slurm", "skip_slurm", is_flag=True, help="do not ask SLURM (states show 'unknown')"
)
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@pass_state
def status_cmd(
    state: CliState,
    user: Optional[str],
    job: Optional[str],
    key: Optional[str],
    node: Optional[str],
    skip_slurm: bool,
    as_json: bool,
) -> None:
    """Checkpoints per job and flush backlog per node, as seen from the PFS and SLURM.

    Per job: SLURM state, newest step on each tier and its age, steps and bytes not yet
    safe on the PFS, flush rate and ETA. Per node: pending bytes, flushes in flight, and
    drains set by slurm_ckpt. Reads no node-local storage.
    """
    query = _no_slurm if skip_slurm else None
    doc = collect_status(state.config, user=user, job=job, key=key, node=node, query=query)
    if as_json:
        write_json(doc)
    else:
        print_status(doc)


def _no_slurm() -> SlurmSnapshot:
    return no_slurm("not asked (--no-slurm)")
