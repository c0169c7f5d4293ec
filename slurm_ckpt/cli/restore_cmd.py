"""``ckpt-slurm restore KEY [--tier T] [--step N] --to DIR``: bring a checkpoint back
from any tier (the cold archive included), verified (:mod:`slurm_ckpt.ops.restore`)."""

from __future__ import annotations

from typing import Optional

import click

from slurm_ckpt.cli.output import CliState, pass_state
from slurm_ckpt.cli.table import OutputFormat, echo_wrapped, output_options, print_json_doc
from slurm_ckpt.core.units import format_bytes
from slurm_ckpt.ops.restore import restore_to
from slurm_ckpt.tiers.registry import ORDER


@click.command("restore")
@click.argument("key")
@click.option("--tier", type=click.Choice(list(ORDER)), help="Only from this tier.")
@click.option("--step", type=click.IntRange(min=0), help="This step (default: the newest).")
@click.option(
    "--to",
    "to",
    required=True,
    type=click.Path(file_okay=False),
    help="Directory to put it in (as DIR/<user>/<key>/step-N).",
)
@click.option("-u", "--user", help="Owner of the checkpoint (default: you).")
@output_options
@pass_state
def restore_cmd(
    state: CliState,
    key: str,
    tier: Optional[str],
    step: Optional[int],
    to: str,
    user: Optional[str],
    out: OutputFormat,
) -> None:
    """Copy a checkpoint of KEY from the fastest tier holding it (or --tier) into DIR,
    every byte checked against its manifest; a copy that does not verify is skipped for
    the next tier. Exit status 1 when none verifies."""
    doc = restore_to(state.config, key, to, user=user, tier=tier, step=step)
    if out.json:
        print_json_doc(doc)
        return
    echo_wrapped(
        f"restored {doc['user']}/{doc['key']} step {doc['step']} from {doc['tier']} "
        f"({format_bytes(doc['bytes'])}, verified) to {doc['path']}"
    )
