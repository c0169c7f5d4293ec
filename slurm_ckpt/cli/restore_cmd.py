"""``ckpt-slurm restore KEY [--tier T] [--step N] --to DIR``: bring a checkpoint back
from any tier (the cold archive included), verified (:mod:`slurm_ckpt.ops.restore`).

``--to`` is checked before anything is read: DIR, or the nearest part of it that exists,
must be a directory the caller can create entries in. Whatever is wrong with it (a file
on the way, a parent that does not exist and cannot be made, no permission) is one usage
error, exit status 2, as for every other malformed value: the same code for
``--to /nonexistent/dir`` as for ``--to afile/x``.
"""

from __future__ import annotations

import os
from typing import Optional

import click

from slurm_ckpt.cli.catalog import tier_role
from slurm_ckpt.cli.output import CliState, pass_state, print_json
from slurm_ckpt.cli.params import USER
from slurm_ckpt.cli.progress import ByteProgress
from slurm_ckpt.cli.registry import register
from slurm_ckpt.cli.table import (
    Column,
    Listing,
    OutputFormat,
    echo_wrapped,
    output_options,
    warn,
)
from slurm_ckpt.core.units import format_bytes, format_duration
from slurm_ckpt.errors import UsageError
from slurm_ckpt.ops.restore import restore_to
from slurm_ckpt.ops.tier_roots import require_roots
from slurm_ckpt.tiers.registry import ORDER

RESTORE_COLUMNS = [
    Column("user", "user"),
    Column("key", "key"),
    Column("step", "step", right=True),
    Column("tier", "from"),
    Column("bytes", "size", fmt=format_bytes, right=True),
    Column("seconds", "time", fmt=format_duration, right=True),
    Column("path", "path", wrap=True),
]


def check_destination(to: str) -> str:
    """``to`` made absolute, once it is known that a restore can be put there (see the
    module docstring); UsageError (exit 2) with the reason otherwise."""
    path = os.path.abspath(to)
    probe = path
    while not os.path.lexists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if probe != path and not os.path.isdir(probe):
        raise UsageError(f"--to {to}: {probe} is not a directory")
    if os.path.islink(path):
        raise UsageError(f"--to {to}: a symbolic link (give the directory it points to)")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise UsageError(f"--to {to}: not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        what = "cannot write in it" if probe == path else f"cannot create it in {probe}"
        raise UsageError(f"--to {to}: {what} (permission denied)")
    return path


@register(
    "restore",
    examples=(
        "ckpt-slurm restore my-run --to /scratch/alice/restore",
        "ckpt-slurm restore my-run --tier cold --step 4000 --to /scratch/alice/3-days-ago",
        "ckpt-slurm restore my-run --local ./ckpt/local --warm ./ckpt/pfs --to ./back",
    ),
    user=True,
)
@click.command("restore")
@click.argument("key")
@click.option(
    "--tier",
    type=click.Choice(["warm", *ORDER]),
    help="Only from this tier (warm: the PFS, or the object store without one).",
)
@click.option("--step", type=click.IntRange(min=0), help="This step (default: the newest).")
@click.option(
    "--lineage",
    metavar="NAME",
    help="Of this lineage (see list; a rollback's retired steps are restored so).",
)
@click.option(
    "--to",
    "to",
    required=True,
    metavar="DIR",
    help="Directory to put it in (as DIR/<user>/<key>/step-N; made when missing).",
)
@click.option("-u", "--user", type=USER, help="Owner of the checkpoint (default: you).")
@output_options
@pass_state
def restore_cmd(
    state: CliState,
    key: str,
    tier: Optional[str],
    step: Optional[int],
    lineage: Optional[str],
    to: str,
    user: Optional[str],
    out: OutputFormat,
) -> None:
    """Copy a checkpoint of KEY from the fastest tier holding it (or --tier) into DIR,
    every byte checked against its manifest; a copy that does not verify is skipped for
    the next tier. Exit status 1 when none verifies, 2 when DIR cannot take it."""
    cfg = state.config
    if tier == "warm":
        tier = cfg.tiers.warm
    for note in require_roots(cfg, tier):
        warn(note)
    dest = check_destination(to)
    with ByteProgress(f"restore {key}: copy + verify") as bar:
        doc = restore_to(
            cfg,
            key,
            dest,
            user=user,
            tier=tier,
            step=step,
            lineage=lineage,
            progress=bar.advance,
            sized=lambda n: bar.set_total(bar.done + n),  # + a skipped copy's bytes
        )
    for note in doc["skipped"]:
        if note.startswith("passing over step "):  # suspect, or after the last healthy pin
            warn(note)
    if out.json:
        print_json(doc)
        return
    if out.parsable or not out.decorated:
        Listing(RESTORE_COLUMNS, [doc], "restore").print(out)
        return
    echo_wrapped(
        f"restored {doc['user']}/{doc['key']} step {doc['step']} (lineage {doc['lineage']}"
        f"{', retired' if doc['retired'] else ''}) from the {tier_role(doc['tier'], cfg)} tier "
        f"({format_bytes(doc['bytes'])}, verified) to {doc['path']}"
    )
