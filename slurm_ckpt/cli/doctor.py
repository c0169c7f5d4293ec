"""``ckpt-slurm doctor``: one line per finding, with the fix; exit 1 on a serious one.

The checks are :mod:`slurm_ckpt.ops.doctor`; this module parses options and prints.
"""

from __future__ import annotations

from typing import Optional

import click

from slurm_ckpt.cli.output import CliState, pass_state, print_json
from slurm_ckpt.cli.registry import register
from slurm_ckpt.cli.safe_text import LINE_LIMIT, safe_text
from slurm_ckpt.core.units import parse_duration
from slurm_ckpt.errors import CkptError, ConfigError, SlurmError

__all__ = ["doctor_cmd"]

_STYLE = {"ok": "green", "warn": "yellow", "error": "red"}


@register(
    "doctor",
    examples=(
        "ckpt-slurm doctor",
        "ckpt-slurm doctor --signal-lead 300s --json",
    ),
    admin=True,
)
@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable findings.")
@click.option("--node", default=None, metavar="NAME", help="Whose measurements to read.")
@click.option(
    "--signal-lead",
    default=None,
    metavar="DURATION",
    help="The --signal lead time your jobs use (e.g. 300s), to check against p99 save+flush.",
)
@click.option("--quiet", "-q", is_flag=True, help="Print only what is not ok.")
@pass_state
def doctor_cmd(
    state: CliState,
    as_json: bool,
    node: Optional[str],
    signal_lead: Optional[str],
    quiet: bool,
) -> int:
    """Check SLURM and site settings against this node's measured save and flush times:
    signal lead, KillWait, PrologEpilogTimeout, preemption signals and requeue, USR1,
    free space, the hook scripts, the tier roots. Exit 1 if anything is serious."""
    from slurm_ckpt.ops.doctor import run_doctor
    from slurm_ckpt.slurm.client import SlurmClient

    lead = None
    if signal_lead is not None:
        try:
            lead = parse_duration(signal_lead, "--signal-lead")
        except CkptError as exc:
            raise ConfigError(str(exc)) from None
    cfg = state.config
    try:
        client: object = SlurmClient(backend="cli", timeout=20.0)
    except SlurmError:
        client = None
    report = run_doctor(cfg, client, node, signal_lead=lead)
    if as_json:
        print_json(report.to_dict())
    else:
        for f in report.findings:
            if quiet and f.severity == "ok":
                continue
            click.secho(safe_text(f.line(), LINE_LIMIT), fg=_STYLE.get(f.severity))
        bad = sum(f.severity == "error" for f in report.findings)
        warn = sum(f.severity == "warn" for f in report.findings)
        click.echo(f"doctor on {report.node}: {bad} serious, {warn} warnings")
    return 1 if report.serious else 0
