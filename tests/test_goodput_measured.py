"""The measured goodput of a job from its timeline (core/timeline.py, ops/job_timeline.py,
job/timeline.py); the same on a real node death is in tests/test_cluster_spares.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

from slurm_ckpt.core.timeline import analyze, append_record, parse_lines
from slurm_ckpt.job.timeline import RankTimeline


def _lines(*recs: dict) -> list:
    return [json.dumps(r) for r in recs]


def test_one_node_loss_costs_what_the_timeline_says() -> None:
    srun = parse_lines(
        _lines(
            {"t": 0, "event": "start", "job": "7"},
            {"t": 1, "event": "step_start", "relaunch": 0},
            {"t": 100, "event": "node_lost", "nodes": ["n2"], "by": "heartbeat", "last_heard": 90},
            {"t": 105, "event": "step_start", "relaunch": 1},
            {"t": 200, "event": "end", "rc": 0},
        )
    )
    rank0 = parse_lines(
        _lines(
            *({"t": 10 + 10 * i, "event": "progress", "step": 10 * i} for i in range(9)),  # 10..90
            {"t": 115, "event": "restored", "step": 60, "tier": "partner", "seconds": 2.5},
            {"t": 120, "event": "progress", "step": 61},
            {"t": 190, "event": "progress", "step": 131},
            "not json",
            {"t": "x", "event": "progress", "step": 5},
            {"t": 150, "event": "progress", "step": -1},
        )
    )
    g = analyze("7", srun, rank0)
    assert len(g.failures) == 1
    f = g.failures[0]
    assert f.nodes == ["n2"] and f.found_by == "heartbeat"
    assert (f.detection_s, f.recovery_s, f.restore_s) == (10, 5, 2.5)
    assert f.training_again_s == 30  # last heartbeat 90 -> first progress after the restore 120
    assert f.restored_step == 60 and f.steps_recomputed == 80 - 60  # newest before 90: step 80
    assert g.startup_s == 10 and g.mean_step_s == 1.0
    # wall 200 - start-up 10 - downtime 30 - 20 steps recomputed at 1 s
    assert g.wall_s == 200 and g.productive_s == 140 and round(g.goodput, 3) == 0.7
    doc = g.to_json()
    assert doc["steps_recomputed"] == 20 and doc["failures"][0]["nodes"] == ["n2"]


def test_no_failure_is_start_up_only() -> None:
    srun = parse_lines(_lines({"t": 0, "event": "start"}, {"t": 50, "event": "end"}))
    rank0 = parse_lines(_lines({"t": 5, "event": "progress", "step": 0}))
    g = analyze("1", srun, rank0)
    assert g.failures == [] and g.productive_s == 45 and g.steps_recomputed == 0


def test_rank0_writes_restores_and_throttled_progress(tmp_path: Path) -> None:
    tl = RankTimeline.from_env(0, {"SLURM_CKPT_TIMELINE": str(tmp_path)})
    tl.restored(5, "local", 0.25)
    for step in range(6, 100):
        tl.progress(step)
    recs = parse_lines((tmp_path / "rank0.jsonl").read_text().splitlines())
    assert [r["event"] for r in recs] == ["restored", "progress"], recs  # one per 5 s
    assert (
        recs[1]["step"] == 6 and oct(os.stat(tmp_path / "rank0.jsonl").st_mode & 0o777) == "0o600"
    )
    RankTimeline.from_env(1, {"SLURM_CKPT_TIMELINE": str(tmp_path)}).progress(7)  # rank 1: none
    RankTimeline.from_env(0, {"SLURM_CKPT_TIMELINE": "relative"}).progress(7)  # not absolute
    assert len((tmp_path / "rank0.jsonl").read_text().splitlines()) == 2
    # After a restore (or an in-job re-form) the first step is recorded at once, not up
    # to PROGRESS_S later: it is the "training again" of the failure before it.
    tl.restored(50, "partner", 0.1)
    tl.progress(51)
    tl.event("reform_end", epoch=1, step=60)
    tl.progress(61)
    tl.progress(62)  # throttled again
    recs = parse_lines((tmp_path / "rank0.jsonl").read_text().splitlines())
    assert [(r["event"], r.get("step")) for r in recs[2:]] == [
        ("restored", 50),
        ("progress", 51),
        ("reform_end", 60),
        ("progress", 61),
    ], recs


def test_a_planted_symlink_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("")
    (tmp_path / "srun.jsonl").symlink_to(target)
    try:
        append_record(str(tmp_path / "srun.jsonl"), "start")
    except OSError:
        pass
    else:
        raise AssertionError("followed a symlink")
    assert target.read_text() == ""


def test_goodput_reads_the_timeline_below_the_pfs_without_following_links(tmp_path: Path) -> None:
    """``ckpt-slurm goodput`` (root's too) reads ``<pfs>/<user>/.slurm_ckpt/jobs/<job>``
    component by component: a symlink a user planted on the way is refused, not followed."""
    import pytest

    from slurm_ckpt.core.config import Config
    from slurm_ckpt.errors import UsageError
    from slurm_ckpt.ops.job_timeline import job_goodput, timeline_dir

    (tmp_path / "local").mkdir()
    cfg = Config.standalone(tmp_path / "local", tmp_path / "pfs")
    where = Path(timeline_dir(cfg, "alice", "7"))  # type: ignore[arg-type]
    where.mkdir(parents=True)
    append_record(str(where / "srun.jsonl"), "start", job="7")
    append_record(str(where / "srun.jsonl"), "end", rc=0)
    assert job_goodput(cfg, "alice", "7").failures == []
    elsewhere = tmp_path / "elsewhere" / "jobs" / "8"
    elsewhere.mkdir(parents=True)
    append_record(str(elsewhere / "srun.jsonl"), "start", job="8")
    bob = tmp_path / "pfs" / "bob"
    bob.mkdir()
    (bob / ".slurm_ckpt").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UsageError, match="not followed"):
        job_goodput(cfg, "bob", "8")
