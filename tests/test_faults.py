"""The fault campaign (``python -m tests.faults``) at CI size, and its checker's own test.

CI runs every scenario once with a fixed seed (the full campaign - ``--runs 20`` - is
what the README's figures come from), except those whose fault a dedicated test of the
suite injects the same way (``CI_ELSEWHERE``: CI's 40-minute budget): a run that violates
an invariant or breaks down fails the test with the campaign's own report. Needs root,
FUSE and the dev cluster, like the other cluster tests.

The checker test proves the invariants can fail: a listed checkpoint with a flipped bit,
a verified checkpoint deleted with nothing newer kept, an unflushed one on a node
nobody drained, and a restart after a node loss older than the newest step whose partner
copy was committed must each be reported.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, List

import pytest
from helpers.cluster import DevCluster

from tests.faults.__main__ import campaign
from tests.faults.invariants import Tracker
from tests.faults.scenarios import SCENARIOS
from tests.faults.site import USER, FaultSite

pytestmark = pytest.mark.root

CI_SEED = 20240611
#: Scenarios CI leaves to the test named (same fault, same checks), and that test.
CI_ELSEWHERE = {
    "recovery-partition-fenced": (
        "test_in_job_recovery.py::test_a_stopped_rank_that_was_replaced_is_fenced_when_it_wakes"
    ),
}


@pytest.fixture
def site(slurm_cluster: DevCluster) -> Iterator[FaultSite]:
    s = FaultSite(slurm_cluster.env, slurm_cluster.nodes[-2:], "checker")
    try:
        yield s
    finally:
        s.close()


def _commit(site: FaultSite, tid: str, step: int) -> Path:
    tier = site.tiers()[tid]
    w = tier.writer(USER, "k", step)
    w.write_buffers({"a.bin": os.urandom(4096)})
    w.commit()
    return Path(tier.root) / USER / "k" / f"step-{step:010d}"


def test_the_checker_reports_each_kind_of_violation(site: FaultSite) -> None:
    node = site.add_node("tmpfs", 16)
    site.set_pfs("loop", 16)
    site.configure()
    tr = Tracker(site, "k")
    _commit(site, f"local:{node}", 1)
    sdir = _commit(site, f"local:{node}", 2)
    tr.observe("t0")
    assert tr.violations == []
    # I1: a listed checkpoint that does not verify
    with open(sdir / "a.bin", "r+b") as fh:
        fh.write(b"\xff")
    tr.observe("t1")
    assert [v for v in tr.violations if v.startswith("I1 t1")], tr.violations
    # I2: the newest verified checkpoint gone, nothing newer kept
    tr.violations.clear()
    site.tiers()[f"local:{node}"].delete(USER, "k", 2)
    site.tiers()[f"local:{node}"].delete(USER, "k", 1)
    tr.observe("t2")
    assert [v for v in tr.violations if v.startswith("I2 t2")], tr.violations
    # I3: committed locally, not on the PFS, node not drained by us
    tr.violations.clear()
    _commit(site, f"local:{node}", 3)
    assert not tr.check_flushed(node, "k", {3}, "t3")
    assert [v for v in tr.violations if v.startswith("I3 t3")], tr.violations
    # I5: after a single node loss a restart resumed older than the newest step whose
    # partner copy was committed (step 3 verified on the surviving node); a damaged
    # copy does not count towards that step
    tr.violations.clear()
    tr.observe("t4")
    bound = tr.surviving({f"local:{node}", "pfs"})
    assert bound == 3
    assert tr.check_node_loss(3, bound, 5, "t4") and tr.violations == []
    assert not tr.check_node_loss(1, bound, 5, "t4")
    assert [v for v in tr.violations if v.startswith("I5 t4")], tr.violations
    tr.damaged.add((f"local:{node}", "k", 3))
    assert tr.surviving({f"local:{node}", "pfs"}) is None


def test_the_scenarios_ci_leaves_out_have_their_test() -> None:
    """A scenario is left out of CI's campaign only for a test that exists."""
    here = Path(__file__).parent
    for name, test in CI_ELSEWHERE.items():
        assert name in SCENARIOS, name
        module, func = test.split("::")
        assert f"def {func}(" in (here / module).read_text(), test


def test_fault_campaign_ci_size(slurm_cluster: DevCluster) -> None:
    """Every scenario once but ``CI_ELSEWHERE`` (seed fixed and printed): zero
    violations, zero broken runs."""
    lines: List[str] = []
    names = [n for n in SCENARIOS if n not in CI_ELSEWHERE]
    fig = campaign(1, CI_SEED, list(SCENARIOS), None, say=lines.append, skip=CI_ELSEWHERE)
    report = "\n".join(lines)
    assert fig["runs"] == len(names), report
    assert fig["faults_injected"] >= len(names), report
    assert fig["violations"] == 0 and fig["errors"] == 0, report
    assert fig["restarts"] > 0, report
