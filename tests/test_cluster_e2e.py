"""End to end on the real dev cluster: the installed hooks (``ckpt-slurm install-hooks``)
as slurm.conf Prolog/Epilog, jobs run as unprivileged users, the stager run inside a
node's mount namespace, and ``ckpt-srun`` requeueing at the time limit.

Runs the package installed in the venv (``scripts/setup``), as slurmd does. Every wait
polls SLURM or the files; nothing sleeps for a fixed time. Each test uses its own key and
a private local/PFS subtree (``sckpt-e2e-<token>``) so that it cannot see other tests'
checkpoints.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import pytest
from helpers.cluster import DevCluster
from helpers.site import write_config

from slurm_ckpt.core.config import Config
from slurm_ckpt.errors import NotFound
from slurm_ckpt.slurm.client import SlurmClient
from slurm_ckpt.tiers.posix import PosixTier

pytestmark = pytest.mark.root

VENV = Path(os.environ.get("SLURM_CKPT_VENV", "/opt/slurm-ckpt/venv"))
PY = VENV / "bin" / "python"
CKPT_SLURM = VENV / "bin" / "ckpt-slurm"
CKPT_SRUN = VENV / "bin" / "ckpt-srun"

WRITER = """\
import os, pwd, sys
from slurm_ckpt.core.config import load_config
from slurm_ckpt.tiers.registry import tiers_from_config
local = tiers_from_config(load_config())["local"]
user = pwd.getpwuid(os.getuid()).pw_name
key, size = sys.argv[1], int(sys.argv[2])
for step in map(int, sys.argv[3:]):
    w = local.writer(user, key, step, job=os.environ["SLURM_JOB_ID"])
    w.write_buffers({"model.bin": os.urandom(size), "opt/state.bin": b"s" * 1000})
    w.commit()
    print("WROTE", step, local.step_path(user, key, step), flush=True)
"""

# A training stand-in for ckpt-srun: a step every 0.1 s on the first run (for the warning
# or the preemption to land mid-way; a restart is interrupted no more and goes at full
# speed), a checkpoint every 10 steps and on the warning signal (then exit 0, as a real
# trainer does), resume from the newest.
TRAINER = """\
import os, pwd, signal, sys, time
from slurm_ckpt.core.config import load_config
from slurm_ckpt.tiers.registry import tiers_from_config
tiers = tiers_from_config(load_config())
user = pwd.getpwuid(os.getuid()).pw_name
key, total = os.environ["SLURM_CKPT_KEY"], int(sys.argv[1])
have = [s.step for t in tiers.values() for s in t.steps(user, key)]
step = max(have, default=0)
print(f"START restart={os.environ.get('SLURM_RESTART_COUNT', '0')} from={step} "
      f"signal={os.environ['SLURM_CKPT_SIGNAL']}", flush=True)
got = []
for name in (os.environ["SLURM_CKPT_SIGNAL"], "SIGTERM"):
    signal.signal(getattr(signal, name), lambda s, f: got.append(s))
def save(n):
    w = tiers["local"].writer(user, key, n, job=os.environ["SLURM_JOB_ID"])
    w.write_buffers({"model.bin": n.to_bytes(8, "little") * 1000})
    w.commit()
pause = 0.1 if os.environ.get("SLURM_RESTART_COUNT", "0") == "0" else 0.0
while step < total:
    step += 1
    time.sleep(pause)
    if got:
        save(step)
        print(f"WARNED saved step={step} by={signal.Signals(got[0]).name}", flush=True)
        sys.exit(0)
    if step % 10 == 0:
        save(step)
if step % 10:
    save(step)
print(f"DONE step={step}", flush=True)
"""


class E2E:
    """Hooks installed from the venv, a private config, helpers."""

    def __init__(self, cluster: DevCluster) -> None:
        self.c = cluster
        self.tok = uuid.uuid4().hex[:8]
        self.dir = Path(f"/var/tmp/sckpt-e2e-{self.tok}")
        self.dir.mkdir(mode=0o755)
        os.chmod(self.dir, 0o755)
        self.sub = f"sckpt-e2e-{self.tok}"
        for node in cluster.nodes:
            d = cluster.local_root(node) / self.sub
            d.mkdir(mode=0o755)
            os.chmod(d, 0o755)
        self.local_root = cluster.local_path / self.sub
        self.pfs_root = cluster.pfs_root / self.sub
        self.pfs_root.mkdir()
        os.chmod(self.pfs_root, 0o1777)
        self.config = self.dir / "config.toml"
        self.log = self.dir / "hooks.log"
        (self.dir / "writer.py").write_text(WRITER)
        (self.dir / "trainer.py").write_text(TRAINER)
        self.configure()
        self.hooks = self.dir / "hooks"

    def configure(self, local_root: Optional[str] = None, **sections: Dict[str, object]) -> Config:
        data: Dict[str, Dict[str, object]] = {
            "tiers.local": {"root": local_root or str(self.local_root), "min_free": "16MiB"},
            "tiers.pfs": {"root": str(self.pfs_root)},
            "hooks": {"budget": "20s", "stage_on_requeue": True},
            "retention": {"keep_local": 2},
            "copy": {"chunk_size": "1MiB", "streams": 2},
        }
        for name, values in sections.items():
            data.setdefault(name.replace("_", "."), {}).update(values)
        return write_config(self.config, data)

    def local_dir(self, node: str) -> Path:
        """Host-side path of this test's local tier on ``node``."""
        return self.c.local_root(node) / self.sub

    def tier(self, name: str, node: Optional[str] = None) -> PosixTier:
        if name == "pfs":
            return PosixTier("pfs", str(self.pfs_root))
        assert node is not None
        return PosixTier("local", str(self.local_dir(node)))

    def verified_on_pfs(self, user: str, key: str, step: int) -> bool:
        """The step is committed and verifies on the PFS (False while not yet there)."""
        try:
            return bool(self.tier("pfs").verify(user, key, step).ok)
        except NotFound:
            return False

    def job(self, body: str, user: str = "ckptuser1", args: List[str] = ()) -> str:
        script = f"export SLURM_CKPT_CONFIG={self.config}\n{body}"
        return self.c.sbatch(script, user=user, extra_args=list(args))

    def write_job(self, node: str, key: str, size: int, *steps: int) -> str:
        body = f"{PY} {self.dir / 'writer.py'} {key} {size} {' '.join(map(str, steps))}\n"
        return self.job(body, args=["-w", node])

    def hook_lines(self, kind: str, job: str) -> List[str]:
        try:
            text = self.log.read_text()
        except FileNotFoundError:
            return []
        return [ln for ln in text.splitlines() if f" {kind} " in ln and f" job {job}:" in ln]

    def wait_hook(
        self, kind: str, job: str, node: Optional[str] = None, timeout: float = 60
    ) -> str:
        def done() -> Optional[str]:
            for ln in self.hook_lines(kind, job):
                if f"{kind} job {job} on" in ln and (node is None or f" on {node}:" in ln):
                    return ln
            return None

        what = f"{kind} of job {job}"
        if not self.hooks_configured():
            what += " (slurm.conf lost our hooks: a concurrent `dev-cluster up`?)"
        return str(self.c.wait_until(done, timeout=timeout, what=what))

    def hooks_configured(self) -> bool:
        conf = self.c.conf.read_text()
        return (
            f"Prolog={self.hooks / 'prolog'}\n" in conf
            and f"Epilog={self.hooks / 'epilog'}\n" in conf
        )

    def ensure_hooks(self) -> None:
        """(Re)install our Prolog/Epilog if a concurrent `dev-cluster up` (another test
        session on this machine) replaced the configuration."""
        if not self.hooks_configured():
            self.c.up(prolog=str(self.hooks / "prolog"), epilog=str(self.hooks / "epilog"))

    def stager(self, node: str) -> subprocess.CompletedProcess:
        """``ckpt-slurm stager --once`` inside ``node``'s mount namespace, as a node's
        daemon would run it."""
        pid = (self.c.state_dir / "run" / f"slurmd-{node}.pid").read_text().strip()
        env = dict(self.c.env, SLURM_CKPT_CONFIG=str(self.config))
        return subprocess.run(
            ["nsenter", "-t", pid, "-m", "--", str(CKPT_SLURM), "stager", "--once", "--node", node],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    def node_reason(self, node: str) -> str:
        return SlurmClient(backend="cli", env=self.c.env).node(node).reason or ""

    def resume(self, node: str) -> None:
        self.c.run(["scontrol", "update", f"nodename={node}", "state=resume"], check=False)
        self.c.wait_node_state(node, lambda s: "DRAIN" not in s and "DOWN" not in s, timeout=60)


@contextlib.contextmanager
def hooked_site(site: E2E) -> Iterator[E2E]:
    """Install the site hooks for ``site`` (``ckpt-slurm install-hooks``, as an admin
    would), turn them on in slurm.conf, and on exit turn them off, resume the nodes we
    drained and remove the site's files. Shared by every cluster test module."""
    if not CKPT_SLURM.exists() or not CKPT_SRUN.exists():
        pytest.fail(f"{CKPT_SLURM} / {CKPT_SRUN} missing: run scripts/setup first")
    cluster = site.c
    proc = subprocess.run(
        [
            str(CKPT_SLURM),
            "install-hooks",
            "--dest",
            str(site.hooks),
            "--config",
            str(site.config),
            "--log-file",
            str(site.log),
        ],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    cluster.up(prolog=str(site.hooks / "prolog"), epilog=str(site.hooks / "epilog"))
    try:
        yield site
    finally:
        cluster.up()  # hooks off again for the rest of the session
        for node in cluster.nodes:
            if site.node_reason(node).startswith("slurm_ckpt:"):
                site.resume(node)
            shutil.rmtree(site.local_dir(node), ignore_errors=True)
        shutil.rmtree(site.pfs_root, ignore_errors=True)
        shutil.rmtree(site.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def e2e(slurm_cluster: DevCluster) -> Iterator[E2E]:
    with hooked_site(E2E(slurm_cluster)) as e:
        yield e


@pytest.fixture(autouse=True)
def _hooks_on(e2e: E2E) -> None:
    e2e.ensure_hooks()


# --------------------------------------------------------------------------- tests


def test_prolog_user_dir_and_epilog_flush(e2e: E2E) -> None:
    e = e2e
    e.configure()
    jobid = e.write_job("n1", "flush", 1_000_000, 1, 2, 3)
    e.c.wait_job_state(jobid, "COMPLETED", timeout=60)
    prolog = e.wait_hook("prolog", jobid, "n1")
    assert "user dir created" in prolog or "user dir ok" in prolog
    st = os.lstat(e.local_dir("n1") / "ckptuser1")
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
    assert st.st_uid == int(e.c.run(["id", "-u", "ckptuser1"]).stdout)
    line = e.wait_hook("epilog", jobid, "n1")
    assert "flushed 3" in line and "node not drained" in line, line
    pfs = e.tier("pfs")
    assert [s.step for s in pfs.steps("ckptuser1", "flush")] == [1, 2, 3]
    assert all(pfs.verify("ckptuser1", "flush", s).ok for s in (1, 2, 3))
    # keep_local = 2: the oldest local copy went, once its PFS copy was verified.
    assert [s.step for s in e.tier("local", "n1").steps("ckptuser1", "flush")] == [2, 3]
    assert (e.pfs_root / ".slurm_ckpt" / "nodes" / "n1.json").is_file()
    assert "DRAIN" not in e.c.node_state("n1")


def test_slow_flush_drains_until_the_stager_finishes(e2e: E2E) -> None:
    e = e2e
    e.configure(tiers_pfs={"bandwidth_limit": "2MB/s"}, hooks={"budget": "2s"})
    try:
        jobid = e.write_job("n2", "slow", 3_000_000, 1, 2)
        e.c.wait_job_state(jobid, "COMPLETED", timeout=60)
        line = e.wait_hook("epilog", jobid, "n2")
        assert "handed" in line and "to the stager" in line, line
        e.c.wait_node_state("n2", lambda s: "DRAIN" in s, timeout=30)
        reason = e.node_reason("n2")
        # One or both (on a loaded machine the first copy may not fit in the budget either).
        assert re.match(
            r"slurm_ckpt: flushing [12] checkpoints? \([0-9.]+ ?MiB\); see ckpt-slurm status$",
            reason,
        ), reason
        # A job that asks for n2 now does not get it.
        probe = e.job("true\n", args=["-w", "n2"])
        e.c.wait_until(
            lambda: e.c.job_info(probe).get("Reason", "").startswith("ReqNodeNotAvail"),
            timeout=30,
            what="the probe job to wait for the drained node",
        )
        res = e.stager("n2")
        assert res.returncode == 0, res.stdout + res.stderr
        assert "node resumed" in res.stdout and "0 still owed" in res.stdout
        e.c.wait_node_state("n2", lambda s: "DRAIN" not in s, timeout=30)
        e.c.wait_job_state(probe, "COMPLETED", timeout=60)
        assert [s.step for s in e.tier("pfs").steps("ckptuser1", "slow")] == [1, 2]
    finally:
        e.configure()
        if "DRAIN" in e.c.node_state("n2"):
            e.resume("n2")


@pytest.mark.parametrize("problem", ["missing", "full"])
def test_failed_prolog_drains_with_our_reason_and_requeues_held(e2e: E2E, problem: str) -> None:
    e = e2e
    if problem == "missing":
        e.configure(local_root=str(e.c.local_path / f"{e.sub}-missing"))
        want = "does not exist"
    else:  # more than the node's small NVMe image can hold
        e.configure(hooks={"expected_checkpoint_size": "1GiB"})
        want = "free, need"
    node = "n3"
    jobid = e.job("echo ran\n", args=["-w", node, "--requeue"])
    try:
        info = e.c.wait_job_state(jobid, lambda s: s == "PENDING", timeout=60, fail_fast=True)
        e.c.wait_until(
            lambda: e.c.job_info(jobid).get("Reason") == "launch_failed_requeued_held",
            timeout=60,
            what="job requeued held",
        )
        info = e.c.job_info(jobid)
        assert info["Restarts"] == "1" and info["Priority"] == "0"
        e.c.wait_node_state(node, lambda s: "DRAIN" in s, timeout=30)
        reason = e.node_reason(node)
        assert reason.startswith("slurm_ckpt: prolog:") and want in reason, reason
        assert "ran" not in e.c.job_output(jobid)
        # Still broken: the stager keeps the node out of service.
        res = e.stager(node)
        assert "not resumed" in res.stdout, res.stdout + res.stderr
        assert "DRAIN" in e.c.node_state(node)
        # Fixed: the stager returns it (the reason is still ours).
        e.configure()
        res = e.stager(node)
        assert "node resumed" in res.stdout, res.stdout + res.stderr
        e.c.wait_node_state(node, lambda s: "DRAIN" not in s, timeout=30)
    finally:
        e.c.scancel(jobid)
        e.configure()


def test_stager_leaves_an_admin_drain_alone(e2e: E2E) -> None:
    e = e2e
    node = "n3"
    e.c.run(["scontrol", "update", f"nodename={node}", "state=drain", "reason=admin: bad dimm"])
    try:
        e.c.wait_node_state(node, lambda s: "DRAIN" in s, timeout=30)
        res = e.stager(node)
        assert res.returncode == 0 and "drained by someone else" in res.stdout, res.stdout
        assert e.node_reason(node) == "admin: bad dimm" and "DRAIN" in e.c.node_state(node)
    finally:
        e.resume(node)


def test_planted_symlink_cannot_make_root_read_or_delete(e2e: E2E) -> None:
    e = e2e
    e.configure(retention={"keep_local": 1})
    secret = e.dir / "root-secret"
    secret.write_bytes(b"TOP-SECRET-ROOT-DATA")
    os.chmod(secret, 0o600)
    body = textwrap.dedent(
        f"""\
        {PY} {e.dir / "writer.py"} evil 100000 1 2 3
        d={e.local_root}/ckptuser1/evil
        # step 1 and 2: a payload file swapped for a symlink to a root-only file
        for s in 0000000001 0000000002; do
            rm "$d/step-$s/model.bin" && ln -s {secret} "$d/step-$s/model.bin"
        done
        # and a whole key directory that is a symlink to a root-owned directory
        ln -s {e.dir} {e.local_root}/ckptuser1/evil2
        echo planted
        """
    )
    try:
        jobid = e.job(body, args=["-w", "n1"])
        e.c.wait_job_state(jobid, "COMPLETED", timeout=60)
        assert "planted" in e.c.job_output(jobid)
        line = e.wait_hook("epilog", jobid, "n1")
        assert "node not drained" in line and "refusing" in line, line
        res = e.stager("n1")
        assert res.returncode == 0, res.stdout + res.stderr
        st = secret.stat()
        assert secret.read_bytes() == b"TOP-SECRET-ROOT-DATA"
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o600)
        assert [s.step for s in e.tier("pfs").steps("ckptuser1", "evil")] == [3]
        for dirpath, _dirs, files in os.walk(e.pfs_root):
            for f in files:
                p = Path(dirpath) / f
                assert p.is_symlink() or b"TOP-SECRET" not in p.read_bytes(), p
        assert not (e.pfs_root / "ckptuser1" / "evil2").exists()
        local = e.local_dir("n1") / "ckptuser1" / "evil"
        assert os.path.islink(local / "step-0000000001" / "model.bin")  # not deleted through
        assert "DRAIN" not in e.c.node_state("n1")
    finally:
        e.configure()


def test_users_cannot_read_each_others_checkpoints(e2e: E2E) -> None:
    e = e2e
    e.configure()
    jobid = e.write_job("n1", "mine", 1000, 1)
    e.c.wait_job_state(jobid, "COMPLETED", timeout=60)
    e.wait_hook("epilog", jobid, "n1")
    step = "mine/step-0000000001/model.bin"
    body = "".join(
        f"ls {root}/ckptuser1 >/dev/null 2>&1 && echo LISTED-{tag} || echo denied-{tag}\n"
        f"cat {root}/ckptuser1/{step} >/dev/null 2>&1 && echo READ-{tag} || echo denied-{tag}\n"
        for tag, root in (("local", e.local_root), ("pfs", e.pfs_root))
    )
    spy = e.job(body, user="ckptuser2", args=["-w", "n1"])
    e.c.wait_job_state(spy, "COMPLETED", timeout=60)
    out = e.c.job_output(spy)
    assert out.count("denied-local") == 2 and out.count("denied-pfs") == 2, out


def test_install_hooks_checks_prolog_epilog_timeout(e2e: E2E) -> None:
    e = e2e
    conf = e.dir / "big-budget.toml"
    conf.write_text(e.config.read_text().replace('budget = "20s"', 'budget = "200s"'))
    proc = subprocess.run(
        [str(CKPT_SLURM), "install-hooks", "--dest", str(e.dir / "h2"), "--config", str(conf)],
        env=e.c.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "PrologEpilogTimeout=120s" in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1


def test_ckpt_srun_time_limit_requeues_once_and_resumes(e2e: E2E) -> None:
    """-t 1 with --warn 45: ckpt-srun's timer warns the step ~15 s in (no
    #SBATCH --signal needed); the trainer saves and exits, ckpt-srun flushes and requeues;
    the prolog stages the newest checkpoint; the second run resumes and finishes. (150
    steps of 0.1 s: the first run cannot finish before the warning; the second, a restart,
    does not sleep and finishes well before its own even on a loaded machine.)"""
    e = e2e
    e.configure()
    key = f"srun-{e.tok}"
    body = (
        f"exec {CKPT_SRUN} --key {key} --warn 45s --max-requeues 3 -- "
        f"-n1 {PY} {e.dir / 'trainer.py'} 150\n"
    )
    jobid = e.job(body, args=["-t", "1", "-N1", "--requeue", "--open-mode=append", "-w", "n1"])
    info = e.c.wait_job_state(jobid, "COMPLETED", timeout=150)
    out = e.c.job_output(jobid)
    assert info["Restarts"] == "1", out
    assert "START restart=0 from=0 signal=SIGUSR1" in out
    assert "ckpt-srun: time limit in" in out and "WARNED saved step=" in out, out
    assert "by=SIGUSR1" in out
    assert "ckpt-srun: time limit near (warning from ckpt-srun timer): requeueing" in out
    assert "START restart=1 from=" in out and "DONE step=150" in out, out
    resumed = int(out.split("START restart=1 from=")[1].split()[0])
    warned = int(out.split("WARNED saved step=")[1].split()[0])
    assert resumed == warned > 0  # nothing lost at the time limit
    prologs = e.hook_lines("prolog", jobid)
    assert any(f"staged {key} step {warned}" in ln for ln in prologs), prologs
    pfs = e.tier("pfs")
    steps = [s.step for s in pfs.steps("ckptuser1", key)]
    assert warned in steps and 150 in steps and pfs.verify("ckptuser1", key, 150).ok


def test_ckpt_srun_leaves_preemption_requeue_to_slurm(e2e: E2E) -> None:
    """A high-partition job preempts ours: SIGTERM reaches the trainer (it saves), ckpt-srun
    flushes and does *not* requeue (SLURM does: one restart, not two)."""
    e = e2e
    e.configure()
    key = f"preempt-{e.tok}"
    body = f"exec {CKPT_SRUN} --key {key} --warn 0 -- -n1 {PY} {e.dir / 'trainer.py'} 120\n"
    victim = e.job(
        body,
        args=["-p", "low", "-w", "n1", "--exclusive", "--requeue", "--open-mode=append"],
    )
    high = None
    try:
        e.c.wait_until(lambda: "START restart=0" in e.c.job_output(victim), timeout=60)
        high = e.c.sbatch(
            "sleep 1\n", user="ckptuser2", extra_args=["-p", "high", "-w", "n1", "--exclusive"]
        )
        info = e.c.wait_job_state(victim, "COMPLETED", timeout=150)
        out = e.c.job_output(victim)
        assert info["Restarts"] == "1", out
        assert "by=SIGTERM" in out and "after SIGTERM" in out, out
        assert "SLURM decides about requeue" in out and "requeueing" not in out, out
        saved = int(out.split("WARNED saved step=")[1].split()[0])
        assert f"START restart=1 from={saved} " in out and "DONE step=120" in out, out
    finally:
        e.c.run(["scancel", victim] + ([high] if high else []), check=False)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))
