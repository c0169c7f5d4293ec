"""The one way tests run the command line tools.

* :func:`ckpt_slurm` runs ``ckpt-slurm`` in a fresh interpreter (what a user's shell does:
  real exit status, real stderr, nothing shared with the test process);
* :func:`run_here` runs an entry point in this process (fast; for tables of many cases and
  monkeypatched SLURM views), returning ``(exit status, stdout, stderr)``.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence, Tuple, Union

REPO = Path(__file__).resolve().parents[2]

PathLike = Union[str, Path]


def ckpt_slurm(
    *args: str,
    config: Optional[PathLike] = None,
    env: Optional[Dict[str, str]] = None,
    cwd: Optional[PathLike] = None,
    columns: Optional[str] = "200",
    timeout: float = 120,
    module: str = "slurm_ckpt.cli.main",
) -> subprocess.CompletedProcess:
    """``python -m slurm_ckpt.cli.main ARGS`` in a fresh interpreter, with this checkout on
    PYTHONPATH; ``config`` sets ``$SLURM_CKPT_CONFIG`` (else it is unset), ``columns`` the
    terminal width (None: leave it)."""
    e = dict(os.environ)
    e.pop("SLURM_CKPT_CONFIG", None)
    if config is not None:
        e["SLURM_CKPT_CONFIG"] = str(config)
    if columns is not None:
        e["COLUMNS"] = columns
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        env=e,
        cwd=str(cwd or REPO),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_here(
    argv: Sequence[str], entry: Optional[Callable[..., object]] = None
) -> Tuple[int, str, str]:
    """Run ``entry(argv)`` (default: ``ckpt-slurm``'s main) in this process."""
    if entry is None:
        from slurm_ckpt.cli.main import main as entry
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            entry(list(argv))
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()
