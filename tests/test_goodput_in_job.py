"""The measured goodput of a job whose node loss was repaired inside the job
(``ckpt-srun --in-job``): ckpt-srun's ``in_job_reform`` and rank 0's ``reform_end``
(core/timeline.py), and ``ckpt-slurm goodput`` showing it."""

from __future__ import annotations

import json
import os
from pathlib import Path

from helpers.cli import ckpt_slurm

from slurm_ckpt.core.timeline import analyze, parse_lines

SRUN = [
    {"t": 0, "event": "start", "job": "7"},
    {"t": 1, "event": "in_job_launch", "epoch": 0, "nodes": ["n1", "n2", "n3"]},
    {"t": 100, "event": "node_lost", "nodes": ["n2"], "by": "heartbeat", "last_heard": 90},
    {"t": 100.5, "event": "in_job_reform", "epoch": 1, "ranks": [1], "nodes": ["n1", "n4", "n3"]},
    {"t": 200, "event": "in_job_end", "epochs": 2},
    {"t": 201, "event": "end", "rc": 0},
]
RANK0 = [
    *({"t": 10 + 10 * i, "event": "progress", "step": 10 * i} for i in range(9)),  # 10..90
    {"t": 95, "event": "reform_start", "epoch": 1, "lost": [1]},
    {
        "t": 103,
        "event": "reform_end",
        "epoch": 1,
        "step": 89,
        "tier": "ram",
        "recomputed": 1,
        "seconds": 8.0,
        "restore_s": 0.5,
    },
    {"t": 104, "event": "progress", "step": 90},
    {"t": 195, "event": "progress", "step": 181},
]


def _lines(recs: list) -> list:
    return [json.dumps(r) for r in recs]


def test_an_in_job_recovery_is_measured_from_the_reform() -> None:
    g = analyze("7", parse_lines(_lines(SRUN)), parse_lines(_lines(RANK0)))
    [f] = g.failures
    assert f.mode == "in_job" and f.nodes == ["n2"] and f.found_by == "heartbeat"
    assert f.detection_s == 10 and f.recovery_s == 0.5  # verdict -> epoch 1 written
    assert f.reform_s == 2.0  # epoch 1 at 100.5 -> agreement at 103, minus the 0.5 s read
    assert f.restore_s == 0.5 and f.restored_step == 89 and f.steps_recomputed == 1
    assert f.training_again_s == 14  # last heartbeat 90 -> first progress after, 104
    assert g.steps_recomputed == 1


def test_a_relaunch_after_a_failed_in_job_recovery_is_a_relaunch() -> None:
    srun = SRUN[:3] + [{"t": 103, "event": "step_start", "relaunch": 1}] + SRUN[-1:]
    rank0 = RANK0[:9] + [{"t": 110, "event": "restored", "step": 80, "seconds": 2.0}]
    [f] = analyze("7", parse_lines(_lines(srun)), parse_lines(_lines(rank0))).failures
    assert f.mode == "relaunch" and f.recovery_s == 3 and f.restored_step == 80


def test_goodput_command_shows_an_in_job_recovery(tmp_path: Path) -> None:
    d = tmp_path / "job"
    d.mkdir(mode=0o700)
    (d / "srun.jsonl").write_text("\n".join(_lines(SRUN)) + "\n")
    (d / "rank0.jsonl").write_text("\n".join(_lines(RANK0)) + "\n")
    os.chmod(d / "srun.jsonl", 0o600)
    out = ckpt_slurm("goodput", "7", "--dir", str(d))
    assert out.returncode == 0, out.stderr
    assert "spare named 500ms later (in the job), re-form 2.0s" in out.stdout, out.stdout
    assert "1 steps recomputed" in out.stdout, out.stdout
    doc = json.loads(ckpt_slurm("goodput", "7", "--dir", str(d), "--json").stdout)
    assert doc["failures"][0]["mode"] == "in_job" and doc["steps_recomputed"] == 1
