"""The series lease asks the real SLURM whether a holder's job has ended (dev cluster): a
job resubmitted after its predecessor was cancelled takes the key over at once, while a
running holder, and a job SLURM does not know, are no verdict (the heartbeat rule
decides)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from slurm_ckpt.job.lease import _job_ended

if TYPE_CHECKING:
    from helpers.cluster import DevCluster

pytestmark = [pytest.mark.root, pytest.mark.cluster]


def test_the_lease_sees_a_holders_job_end(
    slurm_cluster: DevCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k in ("SLURM_CONF", "PATH"):
        monkeypatch.setenv(k, slurm_cluster.env[k])
    job = slurm_cluster.sbatch("#!/bin/bash\nsleep 300\n", user="ckptuser1")
    try:
        slurm_cluster.wait_job_state(job, "RUNNING", timeout=60)
        assert not _job_ended(job)  # alive: its lease holds
    finally:
        slurm_cluster.run(["scancel", str(job)], check=False)
    slurm_cluster.wait_job_state(job, "CANCELLED", timeout=60, fail_fast=False)
    assert _job_ended(job)  # cancelled: a new job of the series takes over
    assert not _job_ended("99999999")  # unknown to SLURM: no verdict
