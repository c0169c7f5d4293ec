"""``ckpt-slurm gc``: retention on the shared tiers. The logic is :mod:`slurm_ckpt.ops.gc`
(its docstring says what is kept and why); this module parses options and prints.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import click

from slurm_ckpt.cli.output import CliState, pass_state, print_error, print_json
from slurm_ckpt.cli.params import USER
from slurm_ckpt.cli.progress import ByteProgress
from slurm_ckpt.cli.registry import register
from slurm_ckpt.cli.table import (
    Column,
    Listing,
    OutputFormat,
    echo_wrapped,
    output_options,
    plural,
    warn,
)
from slurm_ckpt.core.units import format_bytes
from slurm_ckpt.ops.gc import (
    run_gc,
)

# --------------------------------------------------------------------------- command


def step_ranges(steps: Sequence[int]) -> str:
    """``[1, 2, 3, 5]`` -> ``"1-3,5"``: one token however many steps (``-`` for none)."""
    out: List[str] = []
    ordered = sorted(set(steps))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out) or "-"


def _gc_columns(dry_run: bool) -> List[Column]:
    gone = "delete" if dry_run else "deleted"
    return [
        Column("tier", "tier"),
        Column("series", "series", parsable=False),
        Column("user", "user", human=False),
        Column("key", "key", human=False),
        Column("checkpoints", "checkpoints", right=True, drop=2),
        Column("keep", "keep", fmt=step_ranges),
        Column(gone, "would delete" if dry_run else "deleted", fmt=step_ranges),
        Column("bytes", "size", fmt=format_bytes, right=True),
        Column("corrupt", "corrupt", fmt=step_ranges),
        Column("pinned", "pinned", fmt=step_ranges, drop=1),
        Column(
            "damaged",
            "damaged",
            fmt=lambda v: (
                step_ranges([d["step"] for d in v if d["step"] is not None]) if v else "-"
            ),
            parsable=False,
        ),
        Column("damaged_steps", "damaged", human=False),
        Column(
            "reclaim" if dry_run else "reclaimed",
            "would reclaim" if dry_run else "reclaimed",
            fmt=step_ranges,
        ),
    ]


@register(
    "gc",
    examples=(
        "ckpt-slurm gc --dry-run",
        "ckpt-slurm gc -u alice -k my-run --json",
    ),
    user=True,
)
@click.command("gc")
@click.option("--dry-run", is_flag=True, help="Only report what would be deleted.")
@click.option("-u", "--user", type=USER, help="Only this user's checkpoints (default: everyone's).")
@click.option("-k", "--key", help="Only this key.")
@output_options
@pass_state
def gc_cmd(
    state: CliState, dry_run: bool, user: Optional[str], key: Optional[str], out: OutputFormat
) -> int:
    """Apply retention on the warm (and cold) tiers: keep the newest retention.keep_warm
    checkpoints that verify now, one per retention.keep_warm_every, and pinned ones.

    Damaged step directories (CORRUPT, INCOMPLETE, UNREADABLE, FOREIGN) are reported;
    CORRUPT and INCOMPLETE ones older than a checkpoint that verifies now are reclaimed.
    Exit status 1 if a deletion failed or damaged ones are left. The size column is what
    was (or would be) deleted; steps are shown as ranges (1-3,5).
    """
    with ByteProgress("gc: verify") as bar:
        report = run_gc(state.config, user=user, key=key, dry_run=dry_run, progress=bar.advance)
    for s in report.series:
        for line in s.errors:
            print_error(line)
    for a in report.aged:
        for line in a.errors:
            print_error(line)
    left = sum(s.damaged_left for s in report.series)
    code = 0 if report.ok and not left else 1
    if out.json:
        print_json(report.to_dict())
        return code
    doc = report.to_dict()
    busy = [s for s in report.series if s.delete or s.corrupt or s.errors or s.damaged]
    rows = [
        dict(
            s.to_dict(),
            series=f"{s.user}/{s.key}",
            damaged_steps=[d["step"] for d in s.damaged],
        )
        for s in (report.series if not out.decorated else busy)
    ]
    if rows or not out.decorated:
        Listing(
            _gc_columns(dry_run), rows, "gc (dry run: nothing deleted)" if dry_run else "gc"
        ).print(out)
    if out.decorated:
        t = doc["totals"]
        verb = "would delete" if dry_run else "deleted"
        count = t["delete"] if dry_run else t["deleted"]
        echo_wrapped(
            f"{t['series']} series, {plural(t['checkpoints'], 'checkpoint')}: {verb} {count} "
            f"({format_bytes(t['bytes'])}); verified {t['verified']}, corrupt {t['corrupt']}"
            + (f"; damaged {t['damaged']}, reclaimed {t['reclaimed']}" if t["damaged"] else "")
        )
    if left:
        for s in report.series:
            for d in s.damaged:
                if d["step"] not in s.reclaimed and d["step"] not in (s.reclaim if dry_run else ()):
                    warn(f"{d['path']}: {d['state']}: {d['reason']} (left in place)")
    return code
