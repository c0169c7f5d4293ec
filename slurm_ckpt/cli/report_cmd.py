"""``ckpt-slurm report KEY [--png FILE]``: a series' life on this node (ops.report)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Optional

import click

from slurm_ckpt.cli.output import CliState, pass_state, print_json, print_table
from slurm_ckpt.cli.params import USER
from slurm_ckpt.cli.registry import register
from slurm_ckpt.core.names import current_user
from slurm_ckpt.core.units import format_bytes
from slurm_ckpt.ops.report import plot_png, series_life


@register(
    "report",
    examples=(
        "ckpt-slurm report my-run --png my-run.png",
        "ckpt-slurm report my-run --local ./ckpt/local --json   (no site config)",
    ),
    user=True,
)
@click.command("report")
@click.argument("key")
@click.option("-u", "--user", type=USER, help="Owner of the series (default: you).")
@click.option("--png", "png", metavar="FILE", help="Also draw the series' life into FILE (PNG).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON.")
@pass_state
def report_cmd(
    state: CliState, key: str, user: Optional[str], png: Optional[str], as_json: bool
) -> int:
    """A series' life on this node: saves, flushes to the warm tier, failures, and the
    steps at risk over time (what a node loss would have cost at each moment).

    From this node's ledger and event log; --png draws it (needs the plot extra).
    """
    owner = user or current_user()
    life = series_life(state.config, owner, key)
    written = plot_png(life, png) if png else None
    doc = life.to_json()
    if as_json:
        if png:
            doc["png"] = {"path": png, "bytes": written}
        print_json(doc)
        return 0

    def when(t: float) -> str:
        return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")

    rows = [
        ("series", f"{owner}/{key}"),
        (
            "saves",
            f"{doc['saves']} (first {when(life.commits[0][0])}, last {when(life.commits[-1][0])})",
        ),
        ("flushed to the warm tier", doc["flushes"]),
        ("failures", doc["failures"]),
        ("steps at risk: most, now", f"{doc['max_steps_at_risk']}, {doc['steps_at_risk_now']}"),
    ]
    if png:
        rows.append(("picture", f"{png} ({format_bytes(written or 0)})"))
    print_table(f"report {owner}/{key}", rows)
    return 0
