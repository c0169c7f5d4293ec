"""``ckpt-slurm drill KEY``: the recovery drill. The logic is :mod:`slurm_ckpt.ops.drill`
(its docstring says what a drill proves); this module parses options and prints.
"""

from __future__ import annotations

import os
from typing import Optional

import click

from slurm_ckpt.cli.output import CliState, pass_state, print_json, print_table
from slurm_ckpt.cli.params import USER
from slurm_ckpt.cli.progress import ByteProgress
from slurm_ckpt.cli.registry import register
from slurm_ckpt.cli.table import warn
from slurm_ckpt.core.units import format_bytes, format_duration
from slurm_ckpt.errors import NotFound, UsageError
from slurm_ckpt.ops.drill import (
    run_drill,
)
from slurm_ckpt.ops.tier_roots import require_roots


@register(
    "drill",
    examples=(
        "ckpt-slurm drill my-run",
        "ckpt-slurm drill my-run -u alice --json",
    ),
    user=True,
)
@click.command("drill")
@click.argument("key")
@click.option("-u", "--user", type=USER, help="Owner of the checkpoints (default: you).")
@click.option(
    "--scratch",
    metavar="DIR",
    help="Where to put the copy (default: a temporary directory on the tier it comes from).",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON (for CI).")
@pass_state
def drill_cmd(
    state: CliState, key: str, user: Optional[str], scratch: Optional[str], as_json: bool
) -> int:
    """Recovery drill: copy the checkpoint a restart would use into scratch space, verify
    and load it, and report the time to the weights and to the full state.

    Exit status 1 when nothing is restorable.
    """
    if scratch is not None and not os.path.isdir(scratch):
        raise UsageError(f"--scratch {scratch}: not a directory")
    for note in require_roots(state.config):
        warn(note)
    with ByteProgress(f"drill {key}: copy + verify") as bar:
        report = run_drill(state.config, key, user, scratch, progress=bar.advance)
    if as_json:
        print_json(report)
        return 0 if report["ok"] else 1
    for s in report["skipped"]:
        warn(f"skipped {s['tier']} step {s['step']}: {s['error']}")
    if not report["ok"]:
        raise NotFound(f"no restorable checkpoint for {report['user']}/{key}")
    rows = [
        ("step", report["step"]),
        ("from", f"{report['tier']}: {report['path']}"),
        ("size", format_bytes(report["bytes"])),
        ("copy + verify", format_duration(report["copy_s"])),
        ("payload", report["load"]),
    ]
    if report.get("time_to_weights_s") is not None:
        rows.append(("time to weights", format_duration(report["time_to_weights_s"])))
    rows.append(("time to full state", format_duration(report["time_to_full_state_s"])))
    print_table(f"recovery drill {report['user']}/{key}", rows)
    return 0
