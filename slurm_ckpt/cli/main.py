"""``ckpt-slurm``: the command line entry point (the console script is :func:`main`).

This module is kept small on purpose: an operator's shell, a prolog and a monitoring probe
start ``ckpt-slurm`` often, and ``ckpt-slurm --version`` must answer without importing
click, the command modules or anything they use (torch, boto3, rich). Everything else -
the click group :data:`cli`, the commands, the one-line error handling and exit codes - is
in :mod:`slurm_ckpt.cli.app`, imported on the first use of anything else. ``cli`` and
``COMMANDS`` are still reachable here (``from slurm_ckpt.cli.main import cli``).
"""

from __future__ import annotations

import sys
from typing import Any, NoReturn, Optional, Sequence

from slurm_ckpt import __version__

#: What ``--version``/``-V`` alone print; the same as click's version option in
#: :mod:`slurm_ckpt.cli.app` (``ckpt-slurm --config X --version`` goes there).
VERSION_LINE = f"ckpt-slurm {__version__}"


def main(argv: Optional[Sequence[str]] = None) -> NoReturn:
    """Console-script entry point: run the command and exit with a well-defined status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args in (["--version"], ["-V"]):
        sys.stdout.write(VERSION_LINE + "\n")
        sys.stdout.flush()
        sys.exit(0)
    from slurm_ckpt.cli.app import run

    sys.exit(run(args))


def __getattr__(name: str) -> Any:
    """``cli``, ``COMMANDS`` and the rest of :mod:`slurm_ckpt.cli.app`, loaded on use."""
    if name.startswith("__"):
        raise AttributeError(name)
    from slurm_ckpt.cli import app

    return getattr(app, name)


if __name__ == "__main__":
    main()
