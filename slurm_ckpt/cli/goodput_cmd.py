"""``ckpt-slurm goodput JOB``: what failures cost one job, measured (ops.job_timeline)."""

from __future__ import annotations

from typing import Optional

import click

from slurm_ckpt.cli.output import CliState, pass_state, print_json, print_table
from slurm_ckpt.cli.params import USER
from slurm_ckpt.cli.registry import register
from slurm_ckpt.core.names import current_user
from slurm_ckpt.core.units import format_duration
from slurm_ckpt.ops.job_timeline import job_goodput


def _s(v: Optional[float]) -> str:
    return "-" if v is None else format_duration(v)


@register(
    "goodput",
    examples=(
        "ckpt-slurm goodput 123456",
        "ckpt-slurm goodput 123456 --json",
    ),
    user=True,
)
@click.command("goodput")
@click.argument("job")
@click.option("-u", "--user", type=USER, help="Owner of the job (default: you).")
@click.option("--dir", "directory", metavar="DIR", help="The job's timeline directory.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON.")
@pass_state
def goodput_cmd(
    state: CliState, job: str, user: Optional[str], directory: Optional[str], as_json: bool
) -> int:
    """Measured goodput of a job run under ckpt-srun: productive time against wall time,
    steps recomputed, and per node loss the detection, recovery, restore and
    back-to-training times, from the job's timeline on the warm tier.
    """
    owner = user or current_user()
    cfg = None if directory else state.config
    g = job_goodput(cfg, owner, job, directory)  # type: ignore[arg-type]
    if as_json:
        print_json(g.to_json())
        return 0
    rows = [
        ("wall time", _s(g.wall_s)),
        ("productive", f"{_s(g.productive_s)} ({100 * g.goodput:.1f} % goodput)"),
        ("start-up", _s(g.startup_s)),
        ("node losses", len(g.failures)),
        ("steps recomputed", g.steps_recomputed),
    ]
    for i, f in enumerate(g.failures, 1):
        redo = "-" if f.steps_recomputed is None else str(f.steps_recomputed)
        how = (
            f"spare named {_s(f.recovery_s)} later (in the job), re-form {_s(f.reform_s)}"
            if f.mode == "in_job"
            else f"relaunched {_s(f.recovery_s)} later"
        )
        rows.append(
            (
                f"loss {i}: {','.join(f.nodes)}",
                f"detected {_s(f.detection_s)}, {how}, "
                f"restore {_s(f.restore_s)}, training again {_s(f.training_again_s)} after "
                f"the last heartbeat, {redo} steps recomputed",
            )
        )
    print_table(f"goodput of job {job}", rows)
    return 0
