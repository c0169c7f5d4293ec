"""scripts/dev-cluster really gives a working multi-node SLURM cluster on one machine.

Runs as root (like CI). Order matters only for the last test, which takes the cluster
down and brings it back up (it leaves it up for later tests of the session).
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # a plain import here would defeat pytest's assert rewriting of it
    from helpers.cluster import DevCluster

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "dev-cluster"

# Registers the session-scoped `slurm_cluster` fixture (tests/helpers/cluster.py).
pytestmark = pytest.mark.root


def _token() -> str:
    return uuid.uuid4().hex[:12]


def _daemon_pids(cluster: DevCluster) -> dict:
    run = cluster.state_dir / "run"
    return {p.name: p.read_text().strip() for p in sorted(run.glob("*.pid"))}


def test_up_gives_idle_nodes_in_both_partitions(slurm_cluster: DevCluster) -> None:
    c = slurm_cluster
    # 3 nodes unless DEV_CLUSTER_NODES chose otherwise; these tests use n1..n3.
    assert len(c.nodes) >= 3 and c.nodes == [f"n{i}" for i in range(1, len(c.nodes) + 1)]
    assert c.conf.is_file() and c.env["SLURM_CONF"] == str(c.conf)
    out = c.run(["sinfo", "-h", "-N", "-o", "%N %P %t"]).stdout.split("\n")
    rows = [line.split() for line in out if line.strip()]
    seen = {(node, part.rstrip("*")): state for node, part, state in rows}
    for node in c.nodes:
        for part in ("low", "high"):
            assert seen.get((node, part)) == "idle", f"{node}/{part}: {seen}"
    # `low` is the default partition; `high` outranks it.
    parts = c.run(["scontrol", "-o", "show", "partition"]).stdout
    assert re.search(r"PartitionName=low .*Default=YES.*PriorityTier=1 ", parts)
    assert re.search(r"PartitionName=high .*PriorityTier=10 ", parts)
    status = c.status()
    assert status.returncode == 0, status.stdout + status.stderr


def test_up_is_idempotent(slurm_cluster: DevCluster) -> None:
    before = _daemon_pids(slurm_cluster)
    slurm_cluster.up()
    after = _daemon_pids(slurm_cluster)
    assert before == after, "a second `up` with the same settings must not restart anything"
    assert "restarting" not in slurm_cluster.last_up_output


def test_jobs_run_as_the_submitting_user_on_each_node(slurm_cluster: DevCluster) -> None:
    c = slurm_cluster
    jobs = {
        node: c.sbatch(
            'echo "user=$(id -un) node=$SLURMD_NODENAME home=$HOME"\n',
            user="ckptuser2" if node == "n3" else "ckptuser1",
            extra_args=["-w", node, "-J", f"whoami-{node}"],
        )
        for node in c.nodes
    }
    for node, jobid in jobs.items():
        c.wait_job_state(jobid, "COMPLETED", timeout=30)
        user = "ckptuser2" if node == "n3" else "ckptuser1"
        out = c.job_output(jobid)
        assert f"user={user} node={node} home=/home/{user}" in out, out


def test_node_local_path_is_private_to_each_node(slurm_cluster: DevCluster) -> None:
    c = slurm_cluster
    tok = _token()
    script = f"""
set -eu
f="$DEV_CLUSTER_LOCAL_PATH/local-{tok}.txt"
echo "{tok} from $SLURMD_NODENAME" > "$f"
stat -c 'owner=%U' "$f"
# the backing dirs of all nodes are hidden inside a node
echo "hidden=[$(ls -A {c.state_dir}/nodes)]"
echo "local_dev=$(stat -c %d "$DEV_CLUSTER_LOCAL_PATH")" \
     "pfs_dev=$(stat -c %d "$DEV_CLUSTER_PFS_PATH")"
"""
    jobid = c.sbatch(script, user="ckptuser1", extra_args=["-w", "n2"])
    c.wait_job_state(jobid, "COMPLETED", timeout=30)
    out = c.job_output(jobid)
    assert "owner=ckptuser1" in out and "hidden=[]" in out, out
    local_dev, pfs_dev = re.search(r"local_dev=(\d+) pfs_dev=(\d+)", out).groups()
    assert local_dev != pfs_dev, "node-local path and PFS must be different filesystems"

    name = f"local-{tok}.txt"
    assert (c.local_root("n2") / name).read_text() == f"{tok} from n2\n"
    for other in c.nodes:
        if other != "n2":
            assert not (c.local_root(other) / name).exists(), f"file leaked to {other}"
    # Nothing on the host side of the common path either: only n2's namespace has it.
    assert not (c.local_path / name).exists()

    # A job on n1 does not see n2's file at the same path.
    probe = c.sbatch(
        f'test -e "$DEV_CLUSTER_LOCAL_PATH/{name}" && echo seen || echo absent\n',
        user="ckptuser1",
        extra_args=["-w", "n1"],
    )
    c.wait_job_state(probe, "COMPLETED", timeout=30)
    assert c.job_output(probe).strip() == "absent"
    (c.local_root("n2") / name).unlink()


def test_pfs_is_shared_between_nodes(slurm_cluster: DevCluster) -> None:
    c = slurm_cluster
    tok = _token()
    target = c.pfs_root / f"shared-{tok}.txt"
    writer = c.sbatch(
        f'echo "{tok} written on $SLURMD_NODENAME" > {target}\n',
        user="ckptuser1",
        extra_args=["-w", "n1"],
    )
    c.wait_job_state(writer, "COMPLETED", timeout=30)
    reader = c.sbatch(
        f'echo "reader on $SLURMD_NODENAME"; cat {target}\n',
        user="ckptuser2",
        extra_args=["-w", c.nodes[-1]],
    )
    c.wait_job_state(reader, "COMPLETED", timeout=30)
    out = c.job_output(reader)
    assert f"reader on {c.nodes[-1]}" in out and f"{tok} written on n1" in out, out
    assert target.read_text() == f"{tok} written on n1\n"  # the host sees it too
    assert target.stat().st_uid != 0
    assert os.stat(c.pfs_root).st_mode & 0o7777 == 0o1777
    target.unlink()


def test_high_partition_preempts_and_requeues_low_job(slurm_cluster: DevCluster) -> None:
    c = slurm_cluster
    out = c.jobs_dir / f"preempt-{_token()}.out"
    victim = c.sbatch(
        'echo "start job=$SLURM_JOB_ID restart=${SLURM_RESTART_COUNT:-none}"\nexec sleep 300\n',
        user="ckptuser1",
        extra_args=[
            "-p",
            "low",
            "-w",
            "n1",
            "--exclusive",
            "--requeue",
            "--open-mode=append",
            "-o",
            str(out),
        ],
    )
    c.wait_job_state(victim, "RUNNING", timeout=30)
    c.wait_until(
        lambda: "restart=none" in (out.read_text() if out.exists() else ""),
        timeout=30,
        what="first run's output",
    )

    high = c.sbatch(
        "sleep 1\n", user="ckptuser2", extra_args=["-p", "high", "-w", "n1", "--exclusive"]
    )
    try:
        c.wait_job_state(high, ("RUNNING", "COMPLETED"), timeout=30)
        info = c.wait_job_state(victim, ("PENDING", "REQUEUED"), timeout=30)
        assert info["Restarts"] == "1"
        c.wait_job_state(high, "COMPLETED", timeout=30)
        # Eligible again once the first run's credential expired (cred_expire, dev-cluster).
        info = c.wait_job_state(victim, "RUNNING", timeout=60)
        assert info["JobId"] == victim and info["Restarts"] == "1"
        text = c.wait_until(
            lambda: "restart=1" in out.read_text() and out.read_text(),
            timeout=30,
            what="second run's output",
        )
        assert f"start job={victim} restart=none" in text
        assert f"start job={victim} restart=1" in text  # same job id, appended output
        assert "DUE TO PREEMPTION" in text
    finally:
        c.run(["scancel", victim, high], check=False)
    c.wait_job_state(victim, "CANCELLED", timeout=30)


def test_hooks_reboot_program_and_extra_conf_apply_on_rerun_of_up(
    slurm_cluster: DevCluster, tmp_path: Path
) -> None:
    c = slurm_cluster
    tok = _token()
    # Hooks run as root inside the node (so they must live where nodes see them).
    prolog = c.jobs_dir / f"prolog-{tok}.sh"
    prolog.write_text(
        "#!/bin/sh\n"
        'echo "prolog job=$SLURM_JOB_ID user=$SLURM_JOB_USER" '
        f'> "{c.local_path}/prolog-$SLURM_JOB_ID"\n'
    )
    reboot = c.jobs_dir / f"reboot-{tok}.sh"
    reboot.write_text(f"#!/bin/sh\nexec {SCRIPT} reboot-node --wipe-local\n")
    for hook in (prolog, reboot):
        hook.chmod(0o755)
    extra = tmp_path / "extra.conf"
    extra.write_text("# extra-conf-marker\n")
    try:
        c.up(prolog=str(prolog), reboot_program=str(reboot), extra_conf=str(extra))
        conf = c.conf.read_text()
        assert f"Prolog={prolog}" in conf and f"RebootProgram={reboot}" in conf
        assert "# extra-conf-marker" in conf and "Epilog=" not in conf

        # The prolog ran on the job's node and wrote into that node's NVMe.
        jobid = c.sbatch("true\n", user="ckptuser1", extra_args=["-w", "n3"])
        c.wait_job_state(jobid, "COMPLETED", timeout=30)
        marker = c.local_root("n3") / f"prolog-{jobid}"
        assert marker.read_text() == f"prolog job={jobid} user=ckptuser1\n"
        marker.unlink()

        # `scontrol reboot` power-cycles the node through the RebootProgram.
        (c.local_root("n2") / "before-reboot").write_text("x")
        start_before = c.node_info("n2")["SlurmdStartTime"]
        c.run(["scontrol", "reboot", "n2"])
        c.wait_until(
            lambda: (
                c.node_info("n2")["SlurmdStartTime"] != start_before
                and c.node_state("n2") == "IDLE"
            ),
            timeout=60,
            what="n2 to come back from its reboot",
        )
        assert not (c.local_root("n2") / "before-reboot").exists()  # --wipe-local
    finally:
        c.up()  # back to the plain configuration
    conf = c.conf.read_text()
    assert "Prolog=" not in conf and "RebootProgram=" not in conf
    assert "extra-conf-marker" not in conf
    prolog.unlink()
    reboot.unlink()


def test_down_then_up_again(slurm_cluster: DevCluster) -> None:
    c = slurm_cluster
    keep = c.pfs_root / f"persist-{_token()}"
    keep.write_text("kept\n")
    c.down()
    try:
        status = c.status()
        assert status.returncode != 0
        assert not os.path.ismount(c.pfs_root)
        assert not any(os.path.ismount(c.local_root(n)) for n in c.nodes)
        assert not _daemon_pids(c), "pid files left after down"
        c.down()  # safe when nothing is up
    finally:
        c.up()
    for node in c.nodes:
        c.wait_node_state(node, "idle", timeout=30)
    assert keep.read_text() == "kept\n"  # the PFS image persists across down/up
    keep.unlink()
    jobid = c.sbatch("hostname\n", user="ckptuser1", extra_args=["-w", c.nodes[0]])
    c.wait_job_state(jobid, "COMPLETED", timeout=30)
