"""``ckpt-slurm flush``: flush this node's checkpoints to the warm tier now (root: every user's,
as that user; otherwise your own). The work is :mod:`slurm_ckpt.ops.flush_cmd`; this module
parses the arguments and prints the summary. Exit status 1 when anything failed."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

import click

from slurm_ckpt.cli.output import CliState, pass_state, print_json
from slurm_ckpt.cli.params import JOB_ID, NODE
from slurm_ckpt.cli.progress import ByteProgress
from slurm_ckpt.cli.registry import register
from slurm_ckpt.cli.table import (
    Column,
    Listing,
    OutputFormat,
    echo_wrapped,
    output_options,
    plural,
)
from slurm_ckpt.core.units import format_bytes, format_duration
from slurm_ckpt.errors import CkptError, UsageError
from slurm_ckpt.ops.flush_cmd import FlushSummary, flush_node, flush_own
from slurm_ckpt.slurm.env import this_node
from slurm_ckpt.tiers.registry import warm_tiers

__all__ = ["flush_cmd"]

Ident = Tuple[str, str, int]


# --------------------------------------------------------------------------- command


FLUSH_COLUMNS = [
    Column("series", "series", parsable=False),
    Column("user", "user", human=False),
    Column("key", "key", human=False),
    Column("step", "step", right=True),
    Column("state", "result"),
    Column("bytes", "size", fmt=format_bytes, right=True),
    Column("seconds", "time", fmt=format_duration, right=True),
    Column("error", "detail", wrap=True),
]


def _rows(summary: FlushSummary) -> List[Dict[str, Any]]:
    def row(ident: Ident, state: str, **kw: Any) -> Dict[str, Any]:
        u, k, s = ident
        return dict({"series": f"{u}/{k}", "user": u, "key": k, "step": s, "state": state}, **kw)

    rows = [row(i, "flushed", bytes=n, seconds=round(t, 3)) for i, n, t in summary.flushed]
    rows += [row(i, "FAILED", error=e) for i, e in summary.failed]
    rows += [
        row(i, "busy", error="another process is flushing it (use --wait)") for i in summary.busy
    ]
    return rows


def _print(summary: FlushSummary, out: OutputFormat) -> None:
    rows = _rows(summary)
    if rows or not out.decorated:
        Listing(FLUSH_COLUMNS, rows, "flush").print(out)
    if not out.decorated:
        return
    total = sum(n for _i, n, _t in summary.flushed)
    line = (
        f"flushed {plural(len(summary.flushed), 'checkpoint')} ({format_bytes(total)}), "
        f"{len(summary.failed)} failed, {len(summary.busy)} busy"
    )
    if summary.left_to_jobs:
        line += f", {summary.left_to_jobs} left to jobs still running here"
    if summary.left_to_owners:
        line += f", {summary.left_to_owners} partner copies left to their owners' nodes"
    echo_wrapped(line)


@register(
    "flush",
    examples=(
        "ckpt-slurm flush",
        "ckpt-slurm flush -j 123456 --wait",
    ),
    user=True,
)
@click.command("flush")
@click.option("-j", "--job", type=JOB_ID, default=None, help="Only checkpoints of this job.")
@click.option("--wait", is_flag=True, help="Wait for copies other processes are running.")
@click.option(
    "-w",
    "--node",
    type=NODE,
    default=None,
    help="This node's name (default: $SLURMD_NODENAME, else the host name).",
)
@output_options
@pass_state
def flush_cmd(
    state: CliState, job: Optional[str], wait: bool, node: Optional[str], out: OutputFormat
) -> int:
    """Flush this node's checkpoints to the warm tier now (root: every user's, as that user;
    otherwise your own).

    Exit status 1 when anything failed.
    """
    from slurm_ckpt.core.names import current_user

    cfg = state.config
    if not warm_tiers(cfg):  # --local DIR alone (or with --cold: an archive, never flushed to)
        raise UsageError(
            "flush copies to the warm tier, and none is given: add --warm DIR "
            "(or a [tiers.pfs] section to your config)"
        )
    name = this_node(node)
    with ByteProgress("flush") as bar:
        if os.geteuid() == 0:
            client = None
            try:
                from slurm_ckpt.slurm.client import SlurmClient

                client = SlurmClient(backend="cli", timeout=15.0)
            except CkptError:
                client = None
            summary = flush_node(cfg, name, job, wait, client, progress=bar.advance)
        else:
            summary = flush_own(cfg, current_user(), name, job, wait, progress=bar.advance)
    if out.json:
        print_json(summary.to_dict())
    else:
        _print(summary, out)
    return 1 if summary.failed else 0
