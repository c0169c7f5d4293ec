"""``ckpt-slurm status`` groups a key's rank series under the key (issue 31).

A multi-rank job writes one series per rank (``KEY.rank00000``...) and, with DCP, one
per part (``KEY.dcp.rank00000``). The operator asks about ``KEY``: status shows one row
for it with a rank count (``run (4 ranks)``), ``--ranks`` names every series, ``-k KEY``
finds the job, and ``--json`` carries both the series and the grouping. Real
Checkpointers write the series on a laptop's two directories; the command runs in a
fresh interpreter.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List

import numpy as np
from helpers.cli import ckpt_slurm

from slurm_ckpt import Checkpointer


def _write(tmp: Path) -> List[str]:
    flags = ["--local", str(tmp / "l"), "--warm", str(tmp / "w")]
    for rank in range(4):
        ck = Checkpointer(
            local=str(tmp / "l"),
            warm=str(tmp / "w"),
            key="run",
            rank=rank,
            world_size=4,
            install_signals=False,
        )
        ck.save({"model": {"w": np.full(8, rank, dtype=np.float32)}}, step=10)
        ck.close()
    solo = Checkpointer(local=str(tmp / "l"), warm=str(tmp / "w"), key="solo")
    solo.save({"model": {"w": np.zeros(4, dtype=np.float32)}}, step=3)
    solo.close()
    return flags


def test_status_shows_one_row_per_key_with_its_rank_count(tmp_path: Path) -> None:
    flags = _write(tmp_path)
    r = ckpt_slurm("status", "--no-slurm", *flags)
    assert r.returncode == 0, r.stderr
    rows = [ln for ln in r.stdout.splitlines() if "/run" in ln or "/solo" in ln]
    assert len(rows) == 2, r.stdout  # one for run (its 4 ranks), one for solo
    assert any("/run (4 ranks)" in ln for ln in rows), r.stdout
    assert "rank00001" not in r.stdout
    # detail on demand: every rank's series
    r = ckpt_slurm("status", "--no-slurm", "--ranks", *flags)
    assert r.returncode == 0, r.stderr
    assert "run.rank00000,run.rank00001,run.rank00002,run.rank00003" in r.stdout, r.stdout
    # the user's key finds the job; JSON has the series and the grouping
    r = ckpt_slurm("status", "--no-slurm", "--json", "-k", "run", *flags)
    assert r.returncode == 0, r.stderr
    jobs = json.loads(r.stdout)["jobs"]
    assert len(jobs) == 1, jobs
    assert jobs[0]["keys"] == [f"run.rank{r:05d}" for r in range(4)]
    assert [(g["key"], g["ranks"]) for g in jobs[0]["key_groups"]] == [("run", 4)]
    assert jobs[0]["tiers"]["pfs"]["step"] == 10 and jobs[0]["suspect"] is None
