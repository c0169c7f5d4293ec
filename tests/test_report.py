"""``ckpt-slurm report KEY --png FILE``: a series' life drawn from a real run's ledger.

A laptop-style run (local and warm directories, no site config) saves and flushes three
steps; the report counts them, the steps at risk rise after each commit and fall after
each flush, and the PNG exists, opens as an image and has the stated size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np


def _ckpt_slurm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "slurm_ckpt.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_report_draws_a_series_life(tmp_path: Path) -> None:
    from slurm_ckpt import Checkpointer

    local, warm = tmp_path / "nvme", tmp_path / "pfs"
    ckpt = Checkpointer(local=str(local), warm=str(warm), key="run", interval_steps=1)
    try:
        for step in (1, 2, 3):
            ckpt.save({"w": np.full(4096, step, dtype=np.float32)}, step=step)
            ckpt.wait()
    finally:
        ckpt.close()
    png = tmp_path / "life.png"
    r = _ckpt_slurm(
        "report", "run", "--local", str(local), "--warm", str(warm), "--png", str(png), "--json"
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert (doc["saves"], doc["flushes"], doc["failures"]) == (3, 3, 0), doc
    assert doc["steps_at_risk_now"] == 0 and doc["max_steps_at_risk"] >= 1, doc
    assert doc["png"]["bytes"] == os.path.getsize(png) > 10_000

    import matplotlib.image

    img = matplotlib.image.imread(str(png))
    assert img.shape[:2] == (600, 1000), img.shape  # 10 x 6 inches at 100 dpi

    text = _ckpt_slurm("report", "run", "--local", str(local), "--warm", str(warm))
    assert text.returncode == 0 and "steps at risk" in text.stdout, text.stderr


def test_report_of_an_unknown_series_is_one_line(tmp_path: Path) -> None:
    local = tmp_path / "nvme"
    local.mkdir()
    r = _ckpt_slurm("report", "nosuch", "--local", str(local))
    assert r.returncode == 1, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckpt-slurm: error: "), r.stderr
