"""``ckpt-slurm status``: every job's checkpoints and every node's flush backlog, from a
login node.

Nothing here reads a node's NVMe: the shared tiers' catalogs, the node statuses (on the
PFS, or in the object store without one) and SLURM are enough (see
:mod:`slurm_ckpt.ops.status` for what is computed and for the ``--json`` fields). SLURM
is reached through :data:`slurm_ckpt.ops.status.slurm_query`, a function that tests (or
sites with their own scheduler view) can replace; ``--no-slurm`` skips it.

Key directories are created private to their owner, so a plain user sees their own
series; run it as root (or an account that can read the PFS tree) for the whole cluster.
The node status files are world-readable.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Dict, List, Optional

import click

from slurm_ckpt.cli.output import CliState, pass_state
from slurm_ckpt.cli.params import JOB_ID, NODELIST, USER
from slurm_ckpt.cli.registry import register
from slurm_ckpt.cli.safe_text import JSON_LIMIT, safe_json
from slurm_ckpt.cli.table import (
    Column,
    Listing,
    OutputFormat,
    echo_wrapped,
    output_options,
    plural,
    warn,
)
from slurm_ckpt.core.config import user_config_path
from slurm_ckpt.core.units import format_bytes, format_duration, format_rate
from slurm_ckpt.errors import CkptError
from slurm_ckpt.ops.partner_status import PartnerCopies
from slurm_ckpt.ops.status import (
    SLURM_ABSENT,
    SLURM_UNCONFIGURED,
    SlurmSnapshot,
    StatusReport,
    collect_status,
    no_slurm,
)
from slurm_ckpt.ops.tier_roots import require_roots
from slurm_ckpt.slurm.hostlist import compress

__all__ = ["status_cmd"]


def _dumps(value: Any) -> str:
    """One value as JSON, every string in it cut to :data:`JSON_LIMIT` characters.

    Its encoding is at least as long as any string it holds (quotes and escapes only add
    characters), so a value that encodes within the limit needs no cut and is encoded
    once, in C; only a longer one is walked by :func:`safe_json` in Python.
    """
    text = json.dumps(value, default=str)
    return text if len(text) <= JSON_LIMIT else json.dumps(safe_json(value), default=str)


def write_json(doc: Dict[str, Any]) -> None:
    """The document as JSON with one job (or node) per line.

    Why not :func:`print_json`'s indented layout: on a 1,000-job cluster one entry per
    line is what ``grep`` and ``head`` want, and it keeps encoding in C (indenting every
    field runs json's pure-Python encoder, about a tenth of a second here).
    """
    items = [(safe_json(name), value) for name, value in doc.items()]
    out = ["{"]
    for i, (name, value) in enumerate(items):
        comma = "," if i < len(items) - 1 else ""
        head = f"  {json.dumps(name)}: "
        if isinstance(value, (list, tuple)) and value:
            out.append(head + "[")
            rows = [f"    {_dumps(v)}" for v in value]
            out.append(",\n".join(rows))
            out.append(f"  ]{comma}")
        else:
            out.append(f"{head}{_dumps(value)}{comma}")
    out.append("}")
    sys.stdout.write("\n".join(out) + "\n")
    sys.stdout.flush()


def _nodes_text(nodes: Any) -> str:
    if not nodes:
        return "-"
    try:
        return compress(nodes)
    except CkptError:
        return ",".join(nodes)


def _partner_text(entry: Optional[PartnerCopies]) -> str:
    """A job row's partner cell: ``STEP@NODES`` (a SLURM host list), ``-`` without one
    (the entry: :mod:`slurm_ckpt.ops.partner_status`)."""
    if entry is None:
        return "-"
    nodes = list(entry.nodes)
    return f"{entry.step}@{_nodes_text(nodes)}" if nodes else str(entry.step)


def _series_text(value: Any) -> str:
    """``user/KEY``; a multi-rank job's series grouped under its key with a rank count
    (``user/run (4 ranks)``), or each one (``status --ranks``)."""
    user, keys, groups, detail = value
    if not keys:
        return f"{user}/-"
    if detail or not groups:
        return f"{user}/{','.join(keys)}"
    parts = [f"{g.key} ({plural(g.ranks, 'rank')})" if g.ranks else g.key for g in groups]
    return f"{user}/{', '.join(parts)}"


def _count(value: Any) -> str:
    return "-" if value is None else str(value)


def _tier_columns(names: List[str]) -> List[Column]:
    """The newest step (and its age) on each shared tier: fields named after the tier
    (``pfs_step``, ``object_step``, ``cold_step``: JSON and ``--parsable`` keep them), the
    first headed ``warm`` on a terminal, whatever its kind (colder ones drop first)."""
    out = []
    for i, name in enumerate(names):
        title = "warm" if i == 0 else name
        out.append(Column(f"{name}_step", title, fmt=_count, right=True, drop=8 if i else 0))
        out.append(
            Column(
                f"{name}_age_s",
                f"{title} age",
                fmt=format_duration,
                right=True,
                drop=4 if i == 0 else 9,
            )
        )
    return out


def job_columns(names: List[str]) -> List[Column]:
    """The jobs listing for a site whose shared tiers are ``names`` (warm tier first)."""
    head = [c for c in JOB_COLUMNS if c.key != "_tiers"]
    at = [c.key for c in JOB_COLUMNS].index("_tiers")
    return head[:at] + _tier_columns(names) + head[at:]


JOB_COLUMNS = [
    Column("job", "job"),
    Column("series", "series", fmt=_series_text, parsable=False),
    Column("user", "user", human=False),
    Column("key", "keys", human=False),
    Column("state", "state"),
    # Optional columns go in this order when the width is short: rate, local age, pfs
    # age, nodes (the nodes table below names them too), flush eta.
    Column("nodes", "nodes", fmt=_nodes_text, drop=2),
    Column("local_step", "local", fmt=_count, right=True),
    Column("local_age_s", "local age", fmt=format_duration, right=True, drop=5),
    Column("_tiers", "-"),  # replaced by the shared tiers' columns (job_columns)
    # The newest step with a partner copy on a neighbour node, and where (STEP@NODES).
    Column("partner", "partner", fmt=_partner_text, drop=3, parsable=False),
    Column("partner_step", "partner step", human=False),
    Column("partner_nodes", "partner nodes", human=False),
    Column("steps_at_risk", "at risk", fmt=_count, right=True),
    Column("checkpoints_at_risk", "checkpoints at risk", human=False),
    Column("bytes_at_risk", "size at risk", fmt=format_bytes, right=True),
    Column("flush_eta_s", "flush eta", fmt=format_duration, right=True, drop=1),
    Column("flush_rate_bps", "rate", fmt=format_rate, right=True, drop=6),
    Column("data_version", "data", fmt=lambda v: v or "-", drop=7),
    Column("damaged", "damaged", human=False),
]

NODE_COLUMNS = [
    Column("node", "node"),
    Column("status_age_s", "status age", fmt=format_duration, right=True),
    Column("pending_checkpoints", "pending", right=True),
    Column("pending_bytes", "pending size", fmt=format_bytes, right=True),
    Column("in_flight", "in flight", right=True, drop=2),
    Column("failed", "failed", right=True, drop=1),
    Column("state", "slurm"),
    Column("drain_reason", "our drain", wrap=True),
]


def _job_rows(report: StatusReport, ranks: bool = False) -> List[Dict[str, Any]]:
    rows = []
    names = report.shared_names()
    for j in report.jobs:
        partner = j.partner
        pending = j.bytes_at_risk > 0
        per_tier: Dict[str, Any] = {}
        for name in names:
            t = j.tier(name)
            per_tier[f"{name}_step"] = None if t is None else t.step
            per_tier[f"{name}_age_s"] = None if t is None else t.age_s
        rows.append(
            {
                **per_tier,
                "job": j.job,
                "series": (j.user, j.keys, j.key_groups, ranks),
                "user": j.user,
                "key": list(j.keys),
                "state": j.slurm_state,
                "nodes": list(j.nodes),
                "local_step": None if j.local is None else j.local.step,
                "local_age_s": None if j.local is None else j.local.age_s,
                "partner": partner,
                "partner_step": None if partner is None else partner.step,
                "partner_nodes": None if partner is None else list(partner.nodes),
                "steps_at_risk": j.steps_at_risk,
                "checkpoints_at_risk": j.checkpoints_at_risk,
                "bytes_at_risk": j.bytes_at_risk,
                # Nothing pending: no ETA to show ("0.0s" read as "flushing, done now").
                "flush_eta_s": j.flush_eta_s if pending else None,
                "flush_rate_bps": j.flush_rate_bps,
                "data_version": j.data_version,
                "damaged": j.damaged,
            }
        )
    return rows


def _node_rows(report: StatusReport) -> List[Dict[str, Any]]:
    return [
        {
            "node": n.node,
            "status_age_s": n.status_age_s,
            "pending_checkpoints": n.pending_checkpoints,
            "pending_bytes": n.pending_bytes,
            "in_flight": n.in_flight,
            "failed": n.failed,
            "state": n.slurm_state,
            "drain_reason": n.drain_reason,
        }
        for n in report.nodes
    ]


def print_status(
    report: StatusReport,
    out: Optional[OutputFormat] = None,
    nodes_only: bool = False,
    ranks: bool = False,
) -> None:
    """The status report for people (jobs and nodes tables, totals) or scripts (one
    listing: jobs, or nodes with ``nodes_only``); ``ranks``: each rank's series named."""
    out = out or OutputFormat()
    jobs = Listing(job_columns(report.shared_names()), _job_rows(report, ranks), "jobs")
    nodes = Listing(NODE_COLUMNS, _node_rows(report), "nodes")
    if not out.decorated:
        (nodes if nodes_only else jobs).print(out)
        return
    if not nodes_only:
        if jobs.rows:
            jobs.print(out)
        else:
            click.echo("no jobs with checkpoints")
        click.echo()
    if nodes.rows:
        nodes.print(out)
    elif nodes_only:
        click.echo("no node reports a status")
    t = report.totals
    # a laptop or a workstation outside any cluster: nothing to report as an error
    quiet = report.slurm_available or report.slurm_note in (SLURM_ABSENT, SLURM_UNCONFIGURED)
    note = "" if quiet else f"; SLURM: {report.slurm_note}"
    echo_wrapped(
        f"{plural(t.jobs, 'job')}, {format_bytes(t.bytes_at_risk)} at risk in "
        f"{plural(t.checkpoints_at_risk, 'checkpoint')}, "
        f"{plural(t.in_flight, 'flush', 'flushes')} in flight, "
        f"{plural(t.drained_by_us, 'node')} drained by slurm_ckpt{note}"
    )
    if t.damaged:
        warn(
            f"{plural(t.damaged, 'damaged step directory', 'damaged step directories')} "
            "on the shared tiers (ckpt-slurm verify KEY says which and why)"
        )
    for sq in report.squatted:
        warn(
            f"{sq.path} is owned by uid {sq.owner_uid}, not by {sq.user}: squatted, "
            + ("partner copies off" if sq.partner else "not read")
            + f" (fix, as root: inspect it, then mv {sq.path} "
            f"{sq.path}.squatted-by-{sq.owner_uid})"
        )
    for text in report.notes:
        warn(text)
    for j in report.jobs:
        if j.suspect:
            keys = ", ".join(g.key for g in j.key_groups) or "-"
            warn(f"job {j.job or '-'} ({j.user}) {keys}: newest step {j.suspect}")
        for p in j.problems:
            if p.hold:
                warn(
                    f"job {j.job or '-'} ({j.user}) {p.key} step {p.step}: "
                    f"refused ({p.hold}): {p.reason}"
                )


@register(
    "status",
    examples=(
        "ckpt-slurm status",
        "ckpt-slurm status -u alice",
        "ckpt-slurm status -w 'gpu-[001-004]' --nodes",
        "ckpt-slurm status --parsable --noheader | awk -F'|' '$9 > 0'",
    ),
    user=True,
)
@click.command("status")
@click.option("-u", "--user", type=USER, help="Only this user's jobs.")
@click.option("-j", "--job", type=JOB_ID, help="Only this SLURM job id.")
@click.option("-k", "--key", help="Only jobs writing this key.")
@click.option(
    "-w",
    "--node",
    "nodelist",
    type=NODELIST,
    help="Only jobs on, and the status of, these nodes (a SLURM node list: n[1-3],gpu7).",
)
@click.option("--nodes", "nodes_only", is_flag=True, help="Show the nodes listing only.")
@click.option(
    "--ranks", is_flag=True, help="Name each rank's series (KEY.rankNNNNN), not only KEY."
)
@click.option(
    "--no-slurm", "skip_slurm", is_flag=True, help="Do not ask SLURM (states show 'unknown')."
)
@output_options
@pass_state
def status_cmd(
    state: CliState,
    user: Optional[str],
    job: Optional[str],
    key: Optional[str],
    nodelist: Optional[List[str]],
    nodes_only: bool,
    ranks: bool,
    skip_slurm: bool,
    out: OutputFormat,
) -> None:
    """Checkpoints per job and flush backlog per node, as seen from the shared tiers and
    SLURM.

    Per job: SLURM state, newest step on each tier (local, warm, cold) and its age,
    the data version, steps and bytes not yet safe on the warm tier (the PFS, or the
    object store on a site without one), flush rate and ETA. Per node: pending bytes,
    flushes in flight, and drains set by slurm_ckpt. Reads no node-local storage (on a
    laptop: the directory given with --local). --parsable and --noheader print the jobs
    (or, with --nodes, the nodes) one per line; --json the whole document.
    """
    query = _no_slurm if skip_slurm else None
    node: Any = None
    if nodelist is not None:
        node = nodelist[0] if len(nodelist) == 1 else frozenset(nodelist)
    for note in require_roots(state.config):
        warn(note)
    # A user's own tiers (tier flags or their own config, as on a laptop): no node
    # publishes a status there, so the local tier is read directly.
    own = bool(state.tier_roots) or state.config.source == str(user_config_path())
    report = collect_status(
        state.config, user=user, job=job, key=key, node=node, query=query, local_tier=own
    )
    if out.json:
        write_json(report.to_json())  # the one place the report becomes JSON
    else:
        print_status(report, out, nodes_only, ranks)


def _no_slurm() -> SlurmSnapshot:
    return no_slurm("not asked (--no-slurm)")
