"""``ckpt-srun``: the ``srun`` wrapper for checkpointing training jobs (options and error
reporting; the wrapper itself is :mod:`slurm_ckpt.ops.srun`, whose docstring says what it
does and why).

Use it as the last line of a batch script, with ``exec`` so that it *is* the batch shell::

    #SBATCH --signal=B:USR1@120        # optional: ckpt-srun sends the warning itself too
    exec ckpt-srun --key my-run -- python train.py --config big.yaml

Exit status: the step's (so SLURM's accounting shows the training's result).
"""

from __future__ import annotations

import logging
import sys
from typing import NoReturn, Optional, Sequence

import click

from slurm_ckpt import __version__
from slurm_ckpt.cli.params import DURATION
from slurm_ckpt.errors import EXIT_INTERRUPTED, EXIT_USAGE, CkptError
from slurm_ckpt.ops.srun import SrunOptions, run_wrapper

__all__ = ["main"]

PROG = "ckpt-srun"
log = logging.getLogger(__name__)
_FORWARDED = ("SIGUSR1", "SIGUSR2", "SIGTERM", "SIGINT", "SIGCONT", "SIGHUP")
#: How often the end time is asked again (an admin may extend the limit).
END_TIME_REFRESH_S = 300.0


def _say(msg: str) -> None:
    sys.stderr.write(f"{PROG}: {msg}\n")
    sys.stderr.flush()


@click.command(
    PROG,
    context_settings={
        "ignore_unknown_options": True,
        "allow_interspersed_args": False,
        "help_option_names": ["-h", "--help"],
        "max_content_width": 100,
    },
)
@click.option(
    "--config",
    "config_path",
    default=None,
    metavar="FILE",
    help="Site config (default: $SLURM_CKPT_CONFIG, else /etc/slurm-ckpt/config.toml).",
)
@click.option(
    "--key", default=None, help="Checkpoint series (default: $SLURM_CKPT_KEY, job name, job id)."
)
@click.option(
    "--warn",
    "warn_s",
    type=DURATION,
    default="2min",
    show_default=True,
    help="Send the warning signal this long before the time limit: 90s, 2min (0: never).",
)
@click.option(
    "--signal",
    "sig_name",
    default="USR1",
    show_default=True,
    help="Warning signal for the training processes.",
)
@click.option(
    "--requeue/--no-requeue",
    default=True,
    show_default=True,
    help="Requeue the job after a time-limit warning.",
)
@click.option("--max-requeues", type=click.IntRange(min=0), default=100, show_default=True)
@click.option(
    "--flush/--no-flush",
    default=True,
    show_default=True,
    help="Flush local checkpoints to the PFS after the step.",
)
@click.option(
    "--flush-timeout",
    type=DURATION,
    default="5min",
    show_default=True,
    help="Longest flush after the step; the epilog flushes what is left.",
)
@click.version_option(
    __version__, "--version", "-V", prog_name=PROG, message="%(prog)s %(version)s"
)
@click.option(
    "--spares",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Spare nodes the job holds (submit N+K nodes with --no-kill): a step that loses "
    "a node is relaunched on a spare, without a requeue.",
)
@click.option(
    "--node-wait",
    "node_wait_s",
    type=DURATION,
    default="1min",
    show_default=True,
    help="With --spares: how long a failed step waits for SLURM to declare a node dead.",
)
@click.option(
    "--node-timeout",
    "node_timeout_s",
    type=DURATION,
    default="10s",
    show_default=True,
    help="With --spares: a node whose heartbeats stop for this long is lost; the step is "
    "stopped and relaunched without it (no wait for SLURM's SlurmdTimeout).",
)
@click.option(
    "--in-job",
    is_flag=True,
    help="With --spares: recover inside the job. The spares run the same command as hot "
    "spares (SLURM_CKPT_SPARE=1); on a lost node the survivors keep their processes and a "
    "spare takes the lost rank (docs/spares.md). Falls back to the relaunch.",
)
@click.option("--srun", "srun_path", default="srun", show_default=True, help="The srun to run.")
@click.option("--flush-local", is_flag=True, hidden=True)
@click.argument("srun_args", nargs=-1, type=click.UNPROCESSED)
def cli(
    config_path: Optional[str],
    key: Optional[str],
    warn_s: float,
    sig_name: str,
    requeue: bool,
    max_requeues: int,
    flush: bool,
    flush_timeout: float,
    spares: int,
    node_wait_s: float,
    node_timeout_s: float,
    in_job: bool,
    srun_path: str,
    flush_local: bool,
    srun_args: Sequence[str],
) -> int:
    """Run SRUN_ARGS (srun options, then the training command) as a checkpointing step.

    ckpt-srun's own options come first; everything from the first other argument (or
    after "--") goes to srun unchanged. --help and --version are ckpt-srun's own.

    \b
    Examples (last line of a batch script):
      exec ckpt-srun --key my-run -- python train.py
      exec ckpt-srun --key my-run --warn 5min -- -n 8 python train.py --big
      exec ckpt-srun --key my-run --spares 1 -- python train.py   # sbatch -N5 --no-kill
      exec ckpt-srun --key my-run --spares 1 --in-job -- python train.py
    """
    opts = SrunOptions(
        config_path=config_path,
        key=key,
        warn_s=warn_s,
        sig_name=sig_name,
        requeue=requeue,
        max_requeues=max_requeues,
        flush=flush,
        flush_timeout=flush_timeout,
        srun_path=srun_path,
        flush_local=flush_local,
        spares=spares,
        node_wait_s=node_wait_s,
        node_timeout_s=node_timeout_s,
        in_job=in_job,
    )
    return run_wrapper(opts, srun_args, _say)


def main(argv: Optional[Sequence[str]] = None) -> NoReturn:
    """Console script: one-line errors, the step's exit status."""
    try:
        rv = cli.main(
            args=list(argv) if argv is not None else None, prog_name=PROG, standalone_mode=False
        )
        code = rv if isinstance(rv, int) and not isinstance(rv, bool) else 0
    except CkptError as exc:
        _say(f"error: {' '.join(str(exc).split())}")
        code = exc.exit_code
    except click.ClickException as exc:
        hint = " (see 'ckpt-srun --help')" if isinstance(exc, click.UsageError) else ""
        _say(f"error: {' '.join(exc.format_message().split())}{hint}")
        code = EXIT_USAGE if isinstance(exc, click.UsageError) else exc.exit_code
    except (click.exceptions.Abort, KeyboardInterrupt):
        _say("interrupted")
        code = EXIT_INTERRUPTED
    sys.exit(code)


if __name__ == "__main__":
    main()
