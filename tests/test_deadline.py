"""The job knows its deadline: the Checkpointer reads the job's end time from SLURM
(``SLURM_JOB_END_TIME``, else ``squeue -h -o %e``; the cluster test asks the real
controller) and takes its last save early enough before it, without any ``--signal``."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import List

import numpy as np

from slurm_ckpt.job.checkpointer import Checkpointer
from slurm_ckpt.slurm.client import job_end_time_provider


def _make(tmp_path: Path, end: List[float]) -> Checkpointer:
    for d in ("local", "pfs"):
        os.makedirs(tmp_path / d, exist_ok=True)
    return Checkpointer(
        local=tmp_path / "local",
        warm=tmp_path / "pfs",
        key="run",
        interval_steps=10**9,  # no interval save in this test
        install_signals=False,
        end_time_fn=lambda: end[0],
    )


def test_the_last_save_comes_before_the_end_time_without_a_signal(tmp_path: Path) -> None:
    end = [time.time() + 3600.0]
    ck = _make(tmp_path, end)
    try:
        assert not ck.should_save(step=1)
        ck.save({"x": np.arange(1000)}, step=1, preemption=False)  # measures a save
        ck.wait(flush=True)
        assert not ck.should_save(step=2) and not ck.preempted
        end[0] = time.time() + 5.0  # less than 1.5 x (save + flush) + margin away
        assert ck.should_save(step=3)
        rec = ck.save({"x": np.arange(1000)}, step=3)
        assert rec.preemption  # always flushed, like the answer to a warning signal
        assert ck.preempted  # the training loop stops after it
        ck.wait(flush=True)
        assert ck.stats.last_flushed_step == 3
        assert not ck.should_save(step=4)  # once
    finally:
        ck.close()


def test_end_time_from_the_environment_first() -> None:
    env = {"SLURM_JOB_END_TIME": "2000000000"}
    assert job_end_time_provider("123", environ=env)() == 2_000_000_000.0
    assert job_end_time_provider(None, environ={})() is None
