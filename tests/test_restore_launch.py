"""Ranks without an agreement function resume at the same step, whichever starts first.

Plain processes (no torch.distributed) agree on a restart step by each evaluating the same
rule: the newest step whose every rank's shard is committed. Found by the fault campaign
(partner-node-loss, seed 20261202): after a node loss, the requeued rank 0 resumed at the
newest complete step (15) and, on a busy machine, saved step 20 before rank 1 had looked;
rank 1 then found both shards of step 20 (its own from before the loss, rank 0's just
written) and resumed there - the ranks diverged. A multi-rank save records its launch
(``meta["launch"]``: job, requeue count, job step, relaunch), and a restore leaves out the
steps another rank of its own launch has already saved.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict

import pytest
from test_checkpointer import assert_state_equal, sample_state

from slurm_ckpt import Checkpointer
from slurm_ckpt.tiers.posix import PosixTier

KEY, JOB = "run", "4242"


def rank(tmp: Path, r: int) -> Checkpointer:
    """Rank ``r`` on a node of its own (local tier and ledger), the PFS shared."""
    name = f"n{r}"
    for d in (tmp / name / "local", tmp / name / "ledger", tmp / "pfs"):
        d.mkdir(parents=True, exist_ok=True)
    os.chmod(tmp / name / "ledger", 0o700)
    return Checkpointer(
        local=tmp / name / "local",
        warm=tmp / "pfs",
        key=KEY,
        rank=r,
        world_size=2,
        node=name,
        job=JOB,
        ledger_dir=tmp / name / "ledger",
        install_signals=False,
        end_time_fn=None,
        flush_every=1,
        keep_local=5,
    )


def launch(monkeypatch: pytest.MonkeyPatch, restart: int) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", JOB)
    monkeypatch.setenv("SLURM_RESTART_COUNT", str(restart))
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    monkeypatch.delenv("SLURM_CKPT_RELAUNCH", raising=False)


def test_a_rank_that_starts_late_does_not_resume_at_a_step_its_peer_just_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    st: Dict[int, Any] = {s: sample_state(s) for s in (5, 10, 15)}
    launch(monkeypatch, 0)
    r0, r1 = rank(tmp_path, 0), rank(tmp_path, 1)
    try:
        for step in (5, 10):
            for r in (r0, r1):
                r.save(st[step], step=step)
            for r in (r0, r1):
                assert r.wait(flush=True)
    finally:
        r0.close()
        r1.close()
    # Rank 0's step 10 is lost with its node; rank 1's is safe on the PFS.
    PosixTier("pfs", str(tmp_path / "pfs")).delete("root", f"{KEY}.rank00000", 10)
    PosixTier("local", str(tmp_path / "n0" / "local")).delete("root", f"{KEY}.rank00000", 10)
    # The requeued job: rank 0 starts first, resumes at 5, and saves 10 again at once.
    launch(monkeypatch, 1)
    r0 = rank(tmp_path, 0)
    try:
        got = r0.restore()
        assert got is not None and got.step == 5
        r0.save(st[10], step=10)
        assert r0.wait(flush=True)
        # Rank 1, late: both shards of step 10 are there, but rank 0's is of this launch.
        r1 = rank(tmp_path, 1)
        try:
            got = r1.restore()
            assert got is not None and got.step == 5, got and got.step
            assert_state_equal(st[5], got.state)
            r1.save(st[10], step=10)
            assert r1.wait(flush=True)
        finally:
            r1.close()
    finally:
        r0.close()
    # The next launch: step 10 of both ranks counts again (each written before it).
    launch(monkeypatch, 2)
    for r in (0, 1):
        ck = rank(tmp_path, r)
        try:
            got = ck.restore()
            assert got is not None and got.step == 10
            assert_state_equal(st[10], got.state)
        finally:
            ck.close()
