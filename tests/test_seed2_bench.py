"""The pure parts of ``benchmarks/seed2.py`` (no cluster): the fault trace from its seed,
the Young/Daly interval of arms (b) and (c), and the figures and verdicts the table
prints, from the ranks' time-stamped lines."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from slurm_ckpt.core.planner import daly_interval

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import seed2  # noqa: E402


def test_the_trace_is_a_function_of_its_seed() -> None:
    a = seed2.make_trace(2, 300, 5)
    assert a == seed2.make_trace(2, 300, 5)
    assert a.at_steps != seed2.make_trace(3, 300, 5).at_steps
    assert len(a.at_steps) == len(a.victims) == 5
    assert a.at_steps == sorted(a.at_steps)
    assert all(30 <= s <= 270 for s in a.at_steps), a  # not in the first or last 10 %
    assert all(b - x >= 15 for x, b in zip(a.at_steps, a.at_steps[1:])), a
    assert set(a.victims) <= {1, 2}
    assert set(seed2.make_trace(7, 300, 5, victims=[0]).victims) == {0}
    assert seed2.make_trace(2, 300, 0).at_steps == []


def test_a_trace_that_cannot_fit_is_refused() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        seed2.make_trace(2, 50, 5, min_gap=15)


def test_young_daly_interval_in_whole_steps() -> None:
    yd = seed2.young_daly(save_cost_s=0.05, step_s=0.25, steps=400, failures=5)
    assert yd["mtbi_s"] == pytest.approx(400 * 0.25 / 5)
    assert yd["interval_s"] == pytest.approx(daly_interval(0.05, 20.0))
    assert yd["interval_steps"] == round(yd["interval_s"] / 0.25)
    # a save that costs nothing still checkpoints at least every step
    assert seed2.young_daly(0.0, 10.0, 100, 5)["interval_steps"] == 1


def _stamped(rank_lines: dict) -> list:
    return seed2.parse_lines({r: [f"{w} t={t}" for w, t in ls] for r, ls in rank_lines.items()})


def test_failure_figures_from_the_ranks_lines() -> None:
    # rank 1 dies at t=100.5 after step 10; the survivors finish step 10 (in flight),
    # re-form, resume from step 9 (one step redone) and step again at 104 / 105.
    lines = _stamped(
        {
            0: [("REFORM", 1.0), ("STEP 9", 99.0), ("STEP 10", 100.0), ("STEP 10", 100.6),
                ("REFORM", 103.0), ("STEP 10", 104.0), ("STEP 11", 104.5)],
            1: [("REFORM", 1.0), ("STEP 9", 99.0), ("STEP 10", 100.0),
                ("REFORM", 103.2), ("STEP 10", 105.0)],
            2: [("REFORM", 1.0), ("STEP 9", 99.0), ("STEP 10", 100.0),
                ("REFORM", 103.1), ("STEP 10", 104.2)],
        }
    )  # fmt: skip
    [f] = seed2.failure_figures(lines, [100.5], marker="REFORM")
    assert f["reached"] == 10 and f["resumed"] == 9 and f["recomputed"] == 1
    assert f["again_s"] == pytest.approx(4.5)  # the last rank's first step again
    # a rank that never stepped again: no figure, and the table counts it as unrecovered
    [g] = seed2.failure_figures(lines[:-1], [100.5], marker="REFORM")
    assert g["again_s"] is None and g["recomputed"] is None
    row = seed2.arm_summary(50.0, 20, 1.0, [f, g])
    assert (row["failures"], row["recovered"], row["recomputed"]) == (2, 1, 1)
    assert row["again_median_s"] == pytest.approx(4.5) and row["goodput"] == pytest.approx(0.4)


def test_targets_and_table() -> None:
    fig = {"again_s": 6.0, "recomputed": 1}
    rows = {
        "a": seed2.arm_summary(100.0, 100, 0.9, []),
        "b": seed2.arm_summary(400.0, 100, 0.9, [{"again_s": 150.0, "recomputed": 3}]),
        "d": seed2.arm_summary(110.0, 100, 0.9, [fig, dict(fig, again_s=12.0)]),
    }
    checks = {c["target"]: c for c in seed2.targets(rows)}
    assert checks["(d) steps lost per failure (max)"]["verdict"] == "PASS"
    assert checks["(d) wall / (a) wall"]["value"] == pytest.approx(1.1)
    assert checks["(d) wall / (a) wall"]["verdict"] == "PASS"
    assert checks["(d) wall / (b) wall"]["verdict"] == "PASS"  # 0.275
    assert checks["(d) median node death -> training again"]["value"] == pytest.approx(9.0)
    rows["d"] = seed2.arm_summary(200.0, 100, 0.9, [fig, dict(fig, recomputed=2)])
    checks = {c["target"]: c for c in seed2.targets(rows)}
    assert checks["(d) steps lost per failure (max)"]["verdict"] == "short"
    assert checks["(d) wall / (b) wall"]["verdict"] == "PASS"  # exactly 0.5
    assert checks["(d) wall / (a) wall"]["verdict"] == "short"
    text = seed2.table(rows, seed2.targets(rows))
    assert "(b) requeue, warm tier" in text and "short (d) wall / (a) wall: 2.000 x" in text
    # an arm whose recoveries were not all seen is never a PASS on per-failure figures
    rows["d"] = seed2.arm_summary(100.0, 100, 0.9, [fig, {"again_s": None, "recomputed": None}])
    checks = {c["target"]: c for c in seed2.targets(rows)}
    assert checks["(d) median node death -> training again"]["verdict"] == "short"
