"""Operator commands on the real dev cluster: ``ckpt-slurm maint --reboot`` waits for the
stager's flush, then reboots the node through SLURM's RebootProgram and SLURM returns it
to service; ``ckpt-slurm status --json`` reports a job's checkpoints and a node's backlog
while the job runs, while its flush is owed, and once it is on the PFS.

Reuses the ``E2E`` helpers of test_cluster_e2e (hooks installed from the venv, a private
config and local/PFS subtree). Every wait polls SLURM, the process or the files.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any, Dict, Iterator

import pytest
from helpers.cluster import SCRIPT, DevCluster
from test_cluster_e2e import CKPT_SLURM, E2E, PY, hooked_site

pytestmark = pytest.mark.root

USER = "ckptuser1"
MAINT = "slurm_ckpt: maint:"
FLUSHING = "slurm_ckpt: flushing "


@pytest.fixture(scope="module")
def e2e(slurm_cluster: DevCluster) -> Iterator[E2E]:
    with hooked_site(E2E(slurm_cluster)) as e:  # also takes any RebootProgram off at the end
        yield e


@pytest.fixture(autouse=True)
def _hooks_on(e2e: E2E) -> Iterator[None]:
    e2e.ensure_hooks()
    yield
    e2e.configure()


def _stager_until_flushed(e: E2E, node: str, tries: int = 5) -> str:
    out = ""
    for _ in range(tries):
        res = e.stager(node)
        out += res.stdout + res.stderr
        if res.returncode == 0 and "0 still owed" in res.stdout:
            return out
    raise AssertionError(f"stager did not finish the flush on {node}:\n{out}")


def _handed_to_stager(e: E2E, node: str, jobid: str) -> None:
    e.c.wait_job_state(jobid, "COMPLETED", timeout=60)
    line = e.wait_hook("epilog", jobid, node)
    assert "handed" in line and "to the stager" in line, line
    e.c.wait_node_state(node, lambda s: "DRAIN" in s, timeout=30)
    assert e.node_reason(node).startswith(FLUSHING), e.node_reason(node)


def _cleanup_node(e: E2E, node: str) -> None:
    e.configure()
    if e.node_reason(node).startswith("slurm_ckpt:"):
        _stager_until_flushed(e, node)
        e.resume(node)


# --------------------------------------------------------------------------- maint --reboot


def test_maint_reboot_waits_for_the_flush_then_reboots_and_resumes(e2e: E2E) -> None:
    e, c = e2e, e2e.c
    node, key = "n2", f"reboot-{e.tok}"
    log = c.jobs_dir / f"reboot-{e.tok}.log"
    hook = c.jobs_dir / f"reboot-{e.tok}.sh"
    hook.write_text(
        f'#!/bin/sh\necho "reboot $(date +%s.%N) node=${{SLURMD_NODENAME:-?}}" >> {log}\n'
        f"exec {SCRIPT} reboot-node\n"
    )
    hook.chmod(0o755)
    # 1.5 MB at 250 kB/s: ~6 s, far over the 1 s hook budget.
    e.configure(tiers_pfs={"bandwidth_limit": "250kB/s"}, hooks={"budget": "1s"})
    proc = None
    try:
        c.up(
            prolog=str(e.hooks / "prolog"),
            epilog=str(e.hooks / "epilog"),
            reboot_program=str(hook),
        )
        assert f"RebootProgram={hook}" in c.conf.read_text()
        jobid = e.write_job(node, key, 1_500_000, 1)
        _handed_to_stager(e, node, jobid)
        assert not e.verified_on_pfs(USER, key, 1)
        started = c.node_info(node)["SlurmdStartTime"]
        env = dict(c.env, SLURM_CKPT_CONFIG=str(e.config))
        proc = subprocess.Popen(
            [str(CKPT_SLURM), "maint", node, "--reason", "r", "--timeout", "90s"]
            + ["--poll", "1s", "--reboot"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        c.wait_until(
            lambda: e.node_reason(node).startswith(MAINT) or proc.poll() is not None,
            timeout=30,
            what="maint to drain the node",
        )
        assert proc.poll() is None, proc.communicate()
        assert not log.exists()  # no reboot while the flush is owed
        _stager_until_flushed(e, node)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, out + err
        assert f"maint {node}: done" in out, out
        assert "running: scontrol reboot ASAP nextstate=resume" in " ".join(err.split()), err
        assert e.verified_on_pfs(USER, key, 1)  # flushed before the reboot was asked for
        # The RebootProgram ran on the node, slurmd came back from a fresh boot and
        # nextstate=resume returned the node to service.
        c.wait_until(
            lambda: log.exists() and log.read_text().startswith("reboot "),
            timeout=60,
            what="the RebootProgram to run",
        )
        c.wait_until(
            lambda: (
                c.node_info(node)["SlurmdStartTime"] != started and c.node_state(node) == "IDLE"
            ),
            timeout=60,
            what=f"{node} to come back from its reboot, idle",
        )
        assert len(log.read_text().splitlines()) == 1, log.read_text()
        assert not e.node_reason(node).startswith("slurm_ckpt:"), e.node_reason(node)
        assert e.verified_on_pfs(USER, key, 1)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.communicate()
        # Back to the module's configuration: hooks on, no RebootProgram.
        c.up(prolog=str(e.hooks / "prolog"), epilog=str(e.hooks / "epilog"))
        _cleanup_node(e, node)
        if "DOWN" in c.node_state(node) or "DRAIN" in c.node_state(node):
            e.resume(node)
        hook.unlink(missing_ok=True)
        log.unlink(missing_ok=True)
    assert "RebootProgram=" not in c.conf.read_text()


# --------------------------------------------------------------------------- status --json


def _status(e: E2E, key: str) -> Dict[str, Any]:
    env = dict(e.c.env, SLURM_CKPT_CONFIG=str(e.config))
    proc = subprocess.run(
        [str(CKPT_SLURM), "status", "--json", "--key", key],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["format"] == "slurm_ckpt.status" and doc["version"] == 1, doc
    assert doc["slurm"]["available"], doc["slurm"]
    assert doc["pfs_root"] == str(e.pfs_root), doc["pfs_root"]
    return doc


def _job_row(doc: Dict[str, Any], jobid: str) -> Dict[str, Any]:
    rows = [j for j in doc["jobs"] if j["job"] == jobid]
    assert len(rows) == 1, doc["jobs"]
    return rows[0]


def _node_row(doc: Dict[str, Any], node: str) -> Dict[str, Any]:
    rows = [n for n in doc["nodes"] if n["node"] == node]
    assert len(rows) == 1, doc["nodes"]
    return rows[0]


def test_status_json_while_running_while_owed_and_once_flushed(e2e: E2E) -> None:
    e, c = e2e, e2e.c
    node, key = "n1", f"status-{e.tok}"
    go = e.dir / f"go-{e.tok}"
    # 1.5 MB at 250 kB/s: ~6 s, far over the 1 s hook budget.
    e.configure(tiers_pfs={"bandwidth_limit": "250kB/s"}, hooks={"budget": "1s"})
    jobid = None
    try:
        body = (
            f"{PY} {e.dir / 'writer.py'} {key} 1500000 1\nwhile [ ! -e {go} ]; do sleep 0.2; done\n"
        )
        jobid = e.job(body, args=["-w", node])
        c.wait_job_state(jobid, "RUNNING", timeout=60)
        c.wait_until(
            lambda: "WROTE 1" in c.job_output(jobid), timeout=60, what="the checkpoint write"
        )
        nbytes = e.tier("local", node).manifest(USER, key, 1).total_bytes
        assert nbytes >= 1_500_000

        # (a) running: a stager pass picks the checkpoint up and publishes the node status
        # (it leaves a running job's checkpoint to the job).
        e.stager(node)
        doc = _status(e, key)
        row = _job_row(doc, jobid)
        assert row["slurm_state"] == "RUNNING", row
        assert row["user"] == USER and row["keys"] == [key], row
        assert node in row["nodes"], row
        assert row["tiers"]["local"]["step"] == 1, row
        assert row["tiers"]["pfs"] is None, row
        assert row["steps_at_risk"] == 1, row
        assert _node_row(doc, node)["status_age_s"] is not None, doc["nodes"]

        # (b) the job ends; the epilog hands the slow flush to the stager and drains.
        go.touch()
        _handed_to_stager(e, node, jobid)
        doc = _status(e, key)
        row = _job_row(doc, jobid)
        assert row["bytes_at_risk"] == nbytes, (row, nbytes)
        assert row["checkpoints_at_risk"] == 1 and row["steps_at_risk"] == 1, row
        assert row["tiers"]["local"]["step"] == 1, row
        assert doc["totals"]["bytes_at_risk"] == nbytes, doc["totals"]
        n = _node_row(doc, node)
        assert n["pending_checkpoints"] == 1 and n["pending_bytes"] > 0, n
        assert n["drained_by_us"], n
        assert n["drain_reason"] is not None and n["drain_reason"].startswith(FLUSHING), n
        assert n["drain_reason"] == e.node_reason(node), n
        assert "DRAIN" in n["slurm_state"], n
        assert doc["totals"]["drained_by_us"] >= 1, doc["totals"]

        # (c) the stager finishes the flush and resumes the node.
        _stager_until_flushed(e, node)
        assert e.verified_on_pfs(USER, key, 1)
        c.wait_node_state(node, lambda s: "DRAIN" not in s, timeout=30)
        doc = _status(e, key)
        row = _job_row(doc, jobid)
        assert row["slurm_state"] in ("COMPLETED", "gone"), row
        assert row["bytes_at_risk"] == 0 and row["checkpoints_at_risk"] == 0, row
        assert row["steps_at_risk"] == 0, row
        assert row["flush_eta_s"] == 0, row
        assert row["tiers"]["pfs"]["step"] == 1, row
        assert row["tiers"]["pfs"]["bytes"] == nbytes, row
        assert doc["totals"]["bytes_at_risk"] == 0, doc["totals"]
        n = _node_row(doc, node)
        assert n["pending_checkpoints"] == 0 and n["pending_bytes"] == 0, n
        assert not n["drained_by_us"] and n["drain_reason"] is None, n
    finally:
        go.touch()
        if jobid is not None and c.job_state(jobid) in ("RUNNING", "PENDING"):
            c.wait_job_state(
                jobid, lambda s: s not in ("RUNNING", "PENDING"), timeout=30, fail_fast=False
            )
        _cleanup_node(e, node)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([__file__, "-v"]))
