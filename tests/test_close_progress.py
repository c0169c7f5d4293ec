"""``close()`` that waits says so (issue 31): a bar on a terminal, the log line otherwise.

A real Checkpointer whose flush to the warm tier is capped (``warm_bandwidth``) makes
``close()`` wait a few seconds for 160 MiB (the copy reports per 64 MiB chunk); run in a
fresh interpreter whose stderr is a pipe, with ``$SLURM_CKPT_PROGRESS=1`` (what a
terminal gets) it draws the bar - redrawn in place, the bytes moving to the total, erased
at the end - and with ``=0`` (a batch job's output file) only the two log lines, no
carriage return.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

from slurm_ckpt.job.close_progress import CloseProgress, render

SCRIPT = r"""
import logging, sys
import numpy as np
from slurm_ckpt import Checkpointer
logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
root = sys.argv[1]
ck = Checkpointer(local=root + "/l", warm=root + "/w", key="slow", install_signals=False,
                  warm_bandwidth="40MiB/s", flush_every=1000)
ck.save({"model": {"w": np.ones(160 * 2**20 // 4, dtype=np.float32)}}, step=1)
ck.close()  # flushes the newest: 3 chunks of up to 64 MiB, 4 s at 40 MiB/s
print("CLOSED", flush=True)
"""


def _close(tmp: Path, progress: str) -> str:
    env = dict(os.environ, SLURM_CKPT_PROGRESS=progress)
    r = subprocess.run(  # bytes: text mode would turn the bar's "\r" into newlines
        [sys.executable, "-c", SCRIPT, str(tmp)],
        env=env,
        capture_output=True,
        timeout=300,
    )
    err = r.stderr.decode()
    assert r.returncode == 0 and b"CLOSED" in r.stdout, err
    return err


def test_close_draws_a_bar_on_a_terminal(tmp_path: Path) -> None:
    err = _close(tmp_path, "1")
    frames = [f for f in err.split("\r") if f.startswith("[ckpt] close(): [")]
    assert len(frames) >= 2, err  # redrawn while it waited
    pcts = [int(re.search(r"\]\s+(\d+)%", f).group(1)) for f in frames]  # type: ignore[union-attr]
    assert pcts == sorted(pcts) and pcts[-1] > pcts[0], pcts  # it moved forward
    assert re.search(r"/ (160|320)\.0MiB", frames[-1]), frames[-1]  # (local write +) flush
    assert re.search(r"close\(\): done waiting after \d+\.\ds", err), err
    assert "waiting for the local write and the flushes" not in err  # the bar says it


def test_close_writes_the_log_line_elsewhere(tmp_path: Path) -> None:
    err = _close(tmp_path, "0")
    assert "\r" not in err, err
    assert "[ckpt] close(): waiting for the local write and the flushes" in err, err
    assert re.search(r"close\(\): done waiting after \d+\.\ds", err), err


def test_a_short_wait_shows_nothing_and_the_bar_is_erased() -> None:
    out = io.StringIO()
    with CloseProgress(lambda: (0, 10), stream=out, enabled=True):
        pass  # no wait at all
    assert out.getvalue() == ""
    out = io.StringIO()
    done = threading.Event()
    with CloseProgress(lambda: (5, 10), stream=out, enabled=True, note_after_s=0.0) as p:
        while p.frames < 2:
            done.wait(0.05)
    text = out.getvalue()
    assert render(5, 10, 0.0).split("  ")[0] in text  # "[ckpt] close(): [####....]  50%"
    assert text.endswith("\r") and text.rstrip("\r").split("\r")[-1].strip() == ""  # erased
