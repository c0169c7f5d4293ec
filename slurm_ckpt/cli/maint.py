"""``ckpt-slurm maint`` and ``ckpt-slurm guard``: take nodes out of service without losing a
checkpoint. The logic, and why it is safe, is :mod:`slurm_ckpt.ops.maint`; this module
parses options and shows progress.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import click

from slurm_ckpt.cli.output import CliState, console, pass_state
from slurm_ckpt.cli.params import DURATION, NODE, NODELIST, Duration
from slurm_ckpt.cli.progress import progress_enabled
from slurm_ckpt.cli.registry import register
from slurm_ckpt.cli.safe_text import LINE_LIMIT, safe_text
from slurm_ckpt.ops.maint import NodeWait, action_argv, guard, run_maint
from slurm_ckpt.slurm.env import this_node

__all__ = ["guard_cmd", "maint_cmd"]


@register(
    "maint",
    examples=(
        "ckpt-slurm maint 'gpu-[001-004]' --reason 'firmware' --signal-jobs --reboot",
        "ckpt-slurm maint gpu-007 --reason 'disk swap' --timeout 2h -- /usr/local/sbin/swap",
    ),
    admin=True,
)
@click.command("maint")
@click.argument("nodelist", type=NODELIST)
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.option("--reason", required=True, help="Why (drain reason: 'slurm_ckpt: maint: TEXT').")
@click.option("--signal-jobs", is_flag=True, help="Ask running jobs to checkpoint now (USR1).")
@click.option(
    "--timeout",
    type=DURATION,
    default="1h",
    show_default=True,
    help="Give up (exit 4, nodes left drained) after this long: 90min, 2h, 1:30:00.",
)
@click.option(
    "--poll",
    type=Duration(minimum=0.05),
    default="5s",
    show_default=True,
    help="How often to look again.",
)
@click.option("--reboot", is_flag=True, help="Then: scontrol reboot ASAP nextstate=resume.")
@click.option("--reservation", metavar="NAME", help="Then: create a MAINT reservation NAME.")
@pass_state
def maint_cmd(
    state: CliState,
    nodelist: List[str],
    command: Tuple[str, ...],
    reason: str,
    signal_jobs: bool,
    timeout: float,
    poll: float,
    reboot: bool,
    reservation: Optional[str],
) -> None:
    """Drain NODELIST, wait until its jobs are gone and every checkpoint is flushed to the
    warm tier, then reboot it, reserve it, or run COMMAND (after --, without a shell).

    Exit status 4 (nodes left drained) when that does not happen within --timeout.
    """
    actions = sum([reboot, reservation is not None, bool(command)])
    if actions != 1:
        raise click.UsageError("give exactly one action: --reboot, --reservation NAME or -- CMD")
    if not reason.strip():
        raise click.UsageError("--reason must not be empty")
    nodes = list(nodelist)
    action = action_argv(nodes, reboot, reservation, command)
    out = console(stderr=True)
    with _NodeProgress(nodes) as show:
        run_maint(
            state.config,
            nodes,
            reason,
            action,
            signal_jobs=signal_jobs,
            timeout=timeout,
            poll=poll,
            say=lambda line: out.print(safe_text(line, LINE_LIMIT), markup=False),
            on_poll=show,
        )
    click.echo(f"maint {','.join(nodes)}: done")


class _NodeProgress:
    """One spinner line per node while maint waits (stderr, only on a TTY)."""

    def __init__(self, nodes: List[str]) -> None:
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            TimeElapsedColumn(),
            console=console(stderr=True),
            transient=True,
            disable=not progress_enabled(),
        )
        self.nodes = nodes
        self.tasks: dict = {}

    def __enter__(self) -> _NodeProgress:
        self.progress.__enter__()
        self.tasks = {n: self.progress.add_task(n, total=None) for n in self.nodes}
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def __call__(self, waits: List[NodeWait]) -> None:
        for w in waits:
            self.progress.update(
                self.tasks[w.node],
                description=w.line(),
                total=1 if w.ready else None,
                completed=1 if w.ready else 0,
            )


@register(
    "guard",
    examples=(
        "ckpt-slurm guard",
        "ckpt-slurm guard --wait 5min && /sbin/reboot",
    ),
    admin=True,
)
@click.command("guard")
@click.option(
    "-w",
    "--node",
    type=NODE,
    default=None,
    help="This node's name (default: $SLURMD_NODENAME, else the host name).",
)
@click.option(
    "--wait",
    "wait_s",
    type=DURATION,
    default="0s",
    show_default=True,
    help="Wait up to this long for the backlog to drain: 90s, 5min, 1h.",
)
@click.option("--poll", type=Duration(minimum=0.05), default="2s", hidden=True)
@pass_state
def guard_cmd(state: CliState, node: Optional[str], wait_s: float, poll: float) -> None:
    """Exit 0 when this node has no checkpoint waiting for the warm tier, else exit 4.

    For SLURM's RebootProgram (or a wrapper around it): a reboot must not lose a
    checkpoint that exists only on this node's local tier.
    """
    name = this_node(node)
    click.echo(safe_text(guard(state.config, name, wait_s, poll), LINE_LIMIT))
