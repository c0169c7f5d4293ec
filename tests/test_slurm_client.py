"""slurm_ckpt.slurm: host lists, environment parsing, output parsing (pure), and the
client against the real dev cluster (queries, drain/resume with our reason, refusing to
resume an admin's drain, signal, requeue) plus a missing/failing/hanging SLURM."""

from __future__ import annotations

import os
import sys
import time
import types
import uuid
from pathlib import Path
from typing import Dict, Iterator

import pytest
from helpers.cluster import DevCluster

from slurm_ckpt.errors import CkptError, InvalidName, SlurmError
from slurm_ckpt.slurm import hostlist
from slurm_ckpt.slurm.client import SlurmClient
from slurm_ckpt.slurm.env import hook_env, job_env
from slurm_ckpt.slurm.records import (
    REASON_PREFIX,
    JobNotFound,
    node_from_oneliner,
    parse_duration,
    parse_oneliner,
    parse_time,
)

# --------------------------------------------------------------------------- hostlist


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("n[1-3,5]", ["n1", "n2", "n3", "n5"]),
        ("n1", ["n1"]),
        ("gpu[08-11]", ["gpu08", "gpu09", "gpu10", "gpu11"]),
        ("rack[1-2]-n[1-2],login", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2", "login"]),
        ("n[1-2],n[2-3]", ["n1", "n2", "n3"]),
        ("", []),
        ("(null)", []),
    ],
)
def test_hostlist_expand(text: str, hosts: list) -> None:
    assert hostlist.expand(text) == hosts


@pytest.mark.parametrize(
    "hosts",
    [
        ["n1", "n2", "n3", "n5"],
        ["gpu08", "gpu09", "gpu10"],
        ["n1", "n01", "n2"],
        ["login", "n7", "n8", "a-b.c"],
        [f"node{i:04d}" for i in range(1, 200) if i % 7],
    ],
)
def test_hostlist_compress_roundtrip(hosts: list) -> None:
    text = hostlist.compress(hosts)
    assert sorted(hostlist.expand(text)) == sorted(hosts)


def test_hostlist_compress_is_compact() -> None:
    assert hostlist.compress(["n1", "n2", "n3", "n5"]) == "n[1-3,5]"
    assert hostlist.compress(["n08", "n09", "n10"]) == "n[08-10]"


@pytest.mark.parametrize(
    "bad", ["n[1-", "n]1[", "n[a-b]", "n[5-1]", "n[1-3", "n x", "n[1-2000000]"]
)
def test_hostlist_rejects_malformed(bad: str) -> None:
    with pytest.raises(InvalidName):
        hostlist.expand(bad)


# --------------------------------------------------------------------------- env


def _hook(**over: str) -> Dict[str, str]:
    env = {
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_USER": "root",
        "SLURM_JOB_UID": "0",
        "SLURM_JOB_GID": "0",
        "SLURMD_NODENAME": "n1",
        "SLURM_NODELIST": "n[1-2]",
        "SLURM_JOB_RESTART_COUNT": "2",
        "SLURM_SCRIPT_CONTEXT": "epilog_slurmd",
        "SLURM_JOB_EXIT_CODE": "0",
    }
    env.update(over)
    return {k: v for k, v in env.items() if v is not None}


def test_hook_env_parses_and_validates() -> None:
    e = hook_env(_hook())
    assert (e.job_id, e.user, e.uid, e.gid, e.node) == ("42", "root", 0, 0, "n1")
    assert e.nodes == ["n1", "n2"] and e.restart_count == 2 and e.is_requeue
    assert e.context == "epilog_slurmd" and e.exit_code == 0


@pytest.mark.parametrize(
    ("var", "value", "words"),
    [
        ("SLURM_JOB_ID", "", "not set"),
        ("SLURM_JOB_ID", "12; rm -rf /", "invalid"),
        ("SLURM_JOB_USER", "../etc", "invalid user"),
        ("SLURM_JOB_UID", "abc", "whole number"),
        ("SLURM_JOB_UID", "-1", "out of range"),
        ("SLURM_JOB_UID", "1", "does not match"),
        ("SLURMD_NODENAME", "n1/../x", "invalid node"),
        ("SLURM_NODELIST", "n[1-", "unbalanced"),
        ("SLURM_JOB_RESTART_COUNT", "x", "whole number"),
    ],
)
def test_hook_env_rejects_bad_values(var: str, value: str, words: str) -> None:
    with pytest.raises(SlurmError) as err:
        hook_env(_hook(**{var: value}))
    msg = str(err.value)
    assert words in msg and "\n" not in msg and (var in msg or words == "does not match")


def test_job_env() -> None:
    e = job_env(
        {
            "SLURM_JOB_ID": "7",
            "SLURM_JOB_NODELIST": "n[1-3]",
            "SLURM_RESTART_COUNT": "1",
            "SLURM_JOB_END_TIME": "1800000000",
            "SLURMD_NODENAME": "n2",
        }
    )
    assert e.job_id == "7" and e.nodes == ["n1", "n2", "n3"] and e.restart_count == 1
    assert e.end_time == 1800000000.0 and e.node == "n2"
    with pytest.raises(SlurmError, match="not running inside a SLURM job"):
        job_env({})


# --------------------------------------------------------------------------- parsing


def test_parse_oneliner_keeps_values_with_spaces() -> None:
    line = (
        "NodeName=n3 Arch=x86_64 State=IDLE+DRAIN ThreadsPerCore=1 "
        "Reason=slurm_ckpt: flushing 3 checkpoints (1.2 GiB) [root@2026-11-29T08:46:54] "
        "Comment=x=y z"
    )
    f = parse_oneliner(line)
    assert f["State"] == "IDLE+DRAIN"
    node = node_from_oneliner(f)
    assert node.drained and node.reason_is_ours and node.reason_user == "root"
    assert node.reason == "slurm_ckpt: flushing 3 checkpoints (1.2 GiB)"
    assert f["Comment"] == "x=y z"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("00:05:00", 300.0),
        ("1-00:00:00", 86400.0),
        ("2-03", 2 * 86400.0 + 3 * 3600),
        ("10:30", 630.0),
        ("UNLIMITED", None),
        ("Partition_Limit", None),
    ],
)
def test_parse_duration(text: str, seconds: object) -> None:
    assert parse_duration(text) == seconds


def test_parse_time() -> None:
    t = parse_time("2026-11-29T08:52:04")
    assert t is not None and time.localtime(t).tm_hour == 8
    assert parse_time("Unknown") is None and parse_time("None") is None


# --------------------------------------------------------------------------- no SLURM


def test_missing_slurm_is_one_clear_line(tmp_path: Path) -> None:
    client = SlurmClient(backend="cli", path=str(tmp_path))
    with pytest.raises(SlurmError) as err:
        client.node("n1")
    assert "'scontrol' not found" in str(err.value)
    assert err.value.exit_code == 3


def test_failing_slurm_is_one_clear_line(tmp_path: Path, slurm_cluster: DevCluster) -> None:
    broken = tmp_path / "slurm.conf"
    broken.write_text("ClusterName=x\nNoSuchOption=1\n")
    env = dict(slurm_cluster.env, SLURM_CONF=str(broken))
    client = SlurmClient(backend="cli", env=env, timeout=20)
    with pytest.raises(SlurmError) as err:
        client.job(1)
    msg = str(err.value)
    assert msg.startswith("'scontrol show job -o 1' failed:") and "\n" not in msg


def test_hanging_slurm_times_out(tmp_path: Path) -> None:
    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/sh\nexec /bin/sleep 30\n")
    fake.chmod(0o755)
    client = SlurmClient(backend="cli", path=str(tmp_path), timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(SlurmError, match="timed out after 0.5s"):
        client.node("n1")
    assert time.monotonic() - t0 < 5


def test_pyslurm_absent_or_mismatched_falls_back_to_cli(
    monkeypatch: pytest.MonkeyPatch, slurm_cluster: DevCluster
) -> None:
    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.conf))
    # PyPI's pyslurm does not build for 22.05: it is absent here.
    monkeypatch.setitem(sys.modules, "pyslurm", None)
    client = SlurmClient()
    assert client.backend == "cli" and "unavailable" in client.backend_note
    # A pyslurm built for another SLURM must not be used.
    fake = types.ModuleType("pyslurm")
    fake.version = lambda: "25.11.0"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pyslurm", fake)
    client = SlurmClient()
    assert client.backend == "cli" and "does not match SLURM 22.05" in client.backend_note
    with pytest.raises(SlurmError, match="does not match"):
        SlurmClient(backend="pyslurm")


# --------------------------------------------------------------------------- cluster


@pytest.fixture
def client(slurm_cluster: DevCluster, monkeypatch: pytest.MonkeyPatch) -> SlurmClient:
    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.conf))
    return SlurmClient(backend="cli", env=slurm_cluster.env, timeout=30)


@pytest.fixture
def free_node(slurm_cluster: DevCluster) -> Iterator[str]:
    """n3, resumed afterwards whatever a test did to it."""
    node = slurm_cluster.nodes[-1]
    yield node
    slurm_cluster.run(["scontrol", "update", f"nodename={node}", "state=resume"], check=False)


def test_job_queries(slurm_cluster: DevCluster, client: SlurmClient) -> None:
    c = slurm_cluster
    jobid = c.sbatch(
        "sleep 120\n", user="ckptuser1", extra_args=["-t", "5", "-J", "probe-q", "-w", "n1"]
    )
    try:
        c.wait_job_state(jobid, "RUNNING", timeout=30)
        info = client.job(jobid)
        assert info.job_id == jobid and info.state == "RUNNING" and info.user == "ckptuser1"
        assert info.name == "probe-q" and info.nodes == ["n1"] and info.restarts == 0
        assert info.time_limit == 300.0 and info.requeue is True
        assert info.end_time is not None and info.start_time is not None
        assert abs(info.end_time - info.start_time - 300) <= 1
        left = info.seconds_left()
        assert left is not None and 200 < left <= 300
        assert client.job_state(jobid) == ("RUNNING", None)
        assert client.end_time(jobid) == info.end_time
        assert client.restart_count(jobid) == 0
        assert (jobid, "ckptuser1", "RUNNING") in client.jobs_on_node("n1")
        assert any(j.job_id == jobid for j in client.jobs(user="ckptuser1", node="n1"))
        # Providers for the in-job Checkpointer: time limit vs running.
        near = client.checkpointer_providers(jobid, warn_window=400)
        far = client.checkpointer_providers(jobid, warn_window=10)
        assert near["job_state_fn"]() == "TIME_LIMIT" and far["job_state_fn"]() == "RUNNING"
        assert near["end_time_fn"]() == info.end_time
    finally:
        c.scancel(jobid)
    with pytest.raises(JobNotFound):
        client.job(999999)
    with pytest.raises(SlurmError, match="invalid job id"):
        client.job("12; reboot")


def test_signal_and_requeue(slurm_cluster: DevCluster, client: SlurmClient) -> None:
    c = slurm_cluster
    tok = uuid.uuid4().hex[:8]
    script = (
        f"trap 'echo \"{tok} got USR1 restart=${{SLURM_RESTART_COUNT:-0}}\"' USR1\n"
        f"echo '{tok} trap set'\n"
        "for i in $(seq 600); do sleep 0.1; done\n"
    )
    jobid = c.sbatch(script, user="ckptuser1", extra_args=["--requeue", "-w", "n1"])
    try:
        c.wait_job_state(jobid, "RUNNING", timeout=30)
        # RUNNING comes before the script runs (prolog, launch): a USR1 before the trap
        # is set would kill the shell, so wait for the script to say it is ready.
        c.wait_until(lambda: f"{tok} trap set" in c.job_output(jobid), timeout=30)
        # The batch shell only (what #SBATCH --signal=B:USR1@T does at the time limit).
        client.signal(jobid, "USR1", batch=True)
        c.wait_until(lambda: f"{tok} got USR1 restart=0" in c.job_output(jobid), timeout=30)
        client.requeue(jobid)
        info = c.wait_job_state(
            jobid, lambda s: s in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING"), timeout=30
        )
        c.wait_until(lambda: client.restart_count(jobid) == 1, timeout=30, what="restart 1")
        assert info["Restarts"] in ("0", "1")
    finally:
        c.scancel(jobid)
    with pytest.raises(SlurmError, match="invalid signal"):
        client.signal(jobid, "USR1; reboot")


def test_drain_and_resume_with_our_reason(
    slurm_cluster: DevCluster, client: SlurmClient, free_node: str
) -> None:
    c = slurm_cluster
    c.wait_node_state(free_node, ["idle", "mix", "alloc"], timeout=60)
    reason = client.drain(free_node, "flushing 3 checkpoints (1.2 GiB)")
    assert reason == f"{REASON_PREFIX} flushing 3 checkpoints (1.2 GiB)"
    c.wait_node_state(free_node, lambda s: "DRAIN" in s, timeout=30)
    info = client.node(free_node)
    assert info.drained and info.reason_is_ours and info.reason == reason
    assert client.resume_if_ours(free_node) is True
    c.wait_node_state(free_node, lambda s: "DRAIN" not in s, timeout=30)
    assert client.resume_if_ours(free_node) is False  # not drained: nothing to do


def test_never_resumes_or_overwrites_an_admin_drain(
    slurm_cluster: DevCluster, client: SlurmClient, free_node: str
) -> None:
    c = slurm_cluster
    c.run(["scontrol", "update", f"nodename={free_node}", "state=drain", "reason=disk swap"])
    c.wait_node_state(free_node, lambda s: "DRAIN" in s, timeout=30)
    assert client.resume_if_ours(free_node) is False
    assert client.drain(free_node, "slurm_ckpt: flushing 1 checkpoint (1 B)") is None
    info = client.node(free_node)
    assert info.drained and info.reason == "disk swap" and not info.reason_is_ours


def test_a_maint_drain_is_neither_overwritten_nor_resumed_by_flush_drains(
    slurm_cluster: DevCluster, client: SlurmClient, free_node: str
) -> None:
    """``ckpt-slurm maint`` holds a node for the admin: the epilog's and the stager's own
    drains (flush in progress / done) must leave it as it is."""
    c = slurm_cluster
    c.wait_node_state(free_node, ["idle", "mix", "alloc"], timeout=60)
    held = client.drain(free_node, "slurm_ckpt: maint: firmware")
    try:
        c.wait_node_state(free_node, lambda s: "DRAIN" in s, timeout=30)
        assert client.drain(free_node, "slurm_ckpt: flushing 1 checkpoint (1 B)") is None
        assert client.resume_if_ours(free_node) is False
        info = client.node(free_node)
        assert info.drained and info.held_for_maint and info.reason == held
    finally:
        client.resume(free_node)
        c.wait_node_state(free_node, lambda s: "DRAIN" not in s, timeout=30)


def test_client_errors_are_ckpt_errors() -> None:
    assert issubclass(SlurmError, CkptError) and issubclass(JobNotFound, SlurmError)
    assert os.environ.get("SLURM_CKPT_SLURM_BACKEND") in (None, "", "auto", "cli")
