"""The issue's "must show", on the real dev cluster, with the *real* example trainer.

``examples/train_tiny.py`` (a PyTorch model, AdamW, LR schedule, every RNG, the data
position - all through :class:`slurm_ckpt.Checkpointer`) runs under ``ckpt-srun`` as an
unprivileged user, with the site hooks (``ckpt-slurm install-hooks``) as slurm.conf
Prolog/Epilog, and is interrupted the ways a cluster interrupts training:

1. preempted by a ``high`` job and requeued on the same node: resumes from the node-local
   tier, nothing lost, final weights bitwise equal to an uninterrupted run;
2. preempted and requeued onto another node: resumes from the PFS, same guarantees;
3. ``scancel`` (SIGTERM) and the time limit (ckpt-srun's ``--warn`` timer, SIGUSR1): the
   trainer saves at the next step, the epilog flushes what the job left local, and every
   one of those checkpoints verifies on the PFS afterwards;
4. SIGKILL right after a local commit, while a (bandwidth-capped) flush runs: the epilog
   still gets that checkpoint to the PFS - here by handing it to the stager and draining
   the node until ``ckpt-slurm stager --once`` has finished it.

The trainer is a copy of ``examples/train_tiny.py`` placed in a private directory that the
job user can read: a checkout may not be (``/root/...``), and beside the copy there is no
``slurm_ckpt`` source tree, so jobs import the package installed in the venv - the same
code the hooks run (``scripts/setup`` installs it). The reference digest comes from the
same copy run standalone with ``--no-ckpt``, outside SLURM.

Every wait polls SLURM, the job's output or files; nothing sleeps for a fixed time.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import pytest
from helpers.cluster import FINAL_JOB_STATES, DevCluster
from test_cluster_e2e import CKPT_SRUN, E2E, PY, hooked_site

from slurm_ckpt.tiers.posix import PosixTier

pytestmark = pytest.mark.root

REPO = Path(__file__).resolve().parents[1]
TRAIN_TINY = REPO / "examples" / "train_tiny.py"
USER = "ckptuser1"

# One training run: small enough for a 2-core machine, long enough (sleep per step) that
# a preemption lands in the middle of it. The reference run uses the same model/steps.
STEPS = 100
INTERVAL = 10
SLEEP = 0.1
# Runs that are interrupted and never resumed: far more steps than they get to do.
LONG_STEPS = 1000


def _ints(pattern: str, text: str) -> List[int]:
    return [int(m) for m in re.findall(pattern, text, re.M)]


class Run:
    """What one job's output says (the trainer's event lines, see train_tiny.py)."""

    def __init__(self, text: str) -> None:
        self.text = text
        # "RUN job=J restart=R node=N": printed by the batch script at every start.
        self.runs = re.findall(r"^RUN job=(\d+) restart=(\d+) node=(\S+)$", self.text, re.M)
        self.saved = _ints(r"^SAVED step=(\d+)$", text)
        self.committed = _ints(r"^COMMITTED step=(\d+)$", text)
        self.flushed = _ints(r"^FLUSHED step=(\d+)$", text)
        self.preempted = _ints(r"^PREEMPTED step=(\d+)$", text)
        self.resumed = [
            {"step": int(s), "reached": r, "lost": lost, "tier": t}
            for s, r, lost, t in re.findall(
                r"^RESUMED step=(\d+) reached=(\S+) lost=(\S+) tier=(\S+) ", text, re.M
            )
        ]
        done = re.findall(r"^DONE step=(\d+) digest=([0-9a-f]+)$", text, re.M)
        self.done = [(int(s), d) for s, d in done]


class TrainSite(E2E):
    """The e2e site (hooks, private local/PFS subtrees, config) plus the real trainer."""

    def __init__(self, cluster: DevCluster) -> None:
        super().__init__(cluster)
        # <dir>/examples/train_tiny.py: the script puts dirname(dirname(itself)) on
        # sys.path - here our private dir, which holds no slurm_ckpt package.
        (self.dir / "examples").mkdir(mode=0o755)
        self.train = self.dir / "examples" / "train_tiny.py"
        shutil.copyfile(TRAIN_TINY, self.train)
        os.chmod(self.train, 0o644)
        # Progress and digest files are written by the job user.
        self.out = self.dir / "out"
        self.out.mkdir(mode=0o755)
        shutil.chown(self.out, USER, USER)
        self._ref: Optional[subprocess.Popen] = None
        self._ref_digest: Optional[str] = None

    # -- the uninterrupted reference ----------------------------------------------------
    def trainer_args(self, key: str, steps: int) -> List[str]:
        return [
            "--key",
            key,
            "--steps",
            str(steps),
            "--interval-steps",
            str(INTERVAL),
            "--quiet-steps",
        ]

    def start_reference(self) -> None:
        """Start the uninterrupted run now (outside SLURM, no checkpoints); it runs while
        the first cluster job does."""
        ref_dir = self.dir / "reference"
        ref_dir.mkdir()
        args = self.trainer_args("reference", STEPS)
        self._ref = subprocess.Popen(
            [str(PY), str(self.train), *args, "--no-ckpt", "--digest-out", str(ref_dir / "d")],
            cwd=str(ref_dir),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def reference_digest(self) -> str:
        if self._ref_digest is None:
            assert self._ref is not None
            out, _ = self._ref.communicate(timeout=300)
            assert self._ref.returncode == 0, out
            self._ref_digest = (self.dir / "reference" / "d").read_text().strip()
            assert f"DONE step={STEPS} digest={self._ref_digest}" in out, out
        return self._ref_digest

    # -- jobs ---------------------------------------------------------------------------
    def train_job(
        self,
        key: str,
        sbatch_args: List[str],
        steps: int = STEPS,
        srun_opts: str = "--warn 0",
        step_cmd: Optional[str] = None,
    ) -> str:
        """Submit the trainer under ``ckpt-srun`` (as the job's last line, with exec)."""
        slow = ""
        if step_cmd is None:
            args = " ".join(self.trainer_args(key, steps))
            step_cmd = (
                f"{PY} {self.train} {args} --sleep-per-step $per_step "
                f"--progress-file {self.progress(key)} --digest-out {self.out / key}.digest"
            )
            # Slow only the first run, for the signal or preemption to land mid-way; a
            # requeued run is interrupted no more and goes at full speed.
            slow = f'per_step={SLEEP}; [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ] || per_step=0\n'
        body = (
            'echo "RUN job=$SLURM_JOB_ID restart=${SLURM_RESTART_COUNT:-0} '
            'node=$SLURMD_NODENAME"\n'
            f"{slow}exec {CKPT_SRUN} --key {key} {srun_opts} -- -n1 {step_cmd}\n"
        )
        return self.job(body, args=sbatch_args)

    def progress(self, key: str) -> Path:
        return self.out / f"{key}.progress"

    def reached(self, key: str) -> int:
        """The last step the trainer completed (its progress side file)."""
        return int(json.loads(self.progress(key).read_text())["step"])

    def run_of(self, jobid: str) -> Run:
        return Run(self.c.job_output(jobid))

    @contextlib.contextmanager
    def preempted_and_moved(
        self, key: str, first: str = "n2", second: str = "n3", timeout: float = 150
    ) -> Iterator[Tuple[str, Run]]:
        """Train ``key`` on ``first``, preempt it once it has committed, move the requeued
        job to ``second`` (whose disk has nothing of the series) and wait for it to end:
        yields the job id and its run, checked to have run once on each node."""
        victim = self.train_job(key, ["-p", "low", "-w", first, "--requeue", "--open-mode=append"])
        high = None
        try:
            self.wait_output(victim, r"^COMMITTED step=")
            high = self.preempt(first)
            self.wait_requeued(victim)
            # SLURM keeps the node list of a requeued job: move it while it waits (a
            # requeued job is held for cred_expire before it may start again).
            self.c.run(["scontrol", "update", f"jobid={victim}", f"ReqNodeList={second}"])
            info = self.c.wait_job_state(victim, "COMPLETED", timeout=timeout)
            run = self.run_of(victim)
            assert info["Restarts"] == "1", run.text
            assert run.runs == [(victim, "0", first), (victim, "1", second)], run.text
            yield victim, run
        finally:
            self.c.run(["scancel", victim] + ([high] if high else []), check=False)

    def wait_output(self, jobid: str, pattern: str, timeout: float = 90) -> Run:
        """Poll the job's output until ``pattern`` (a regex, multiline) appears."""

        def seen() -> Optional[Run]:
            run = self.run_of(jobid)
            if re.search(pattern, run.text, re.M):
                return run
            state = self.c.job_state(jobid)
            assert state not in FINAL_JOB_STATES, f"job {jobid} is {state}:\n{run.text}"
            return None

        return self.c.wait_until(seen, timeout=timeout, what=f"{pattern!r} in job {jobid}")  # type: ignore[return-value]

    def wait_requeued(self, jobid: str, timeout: float = 60) -> Dict[str, str]:
        """Until the job is back in the queue (PENDING) after its first run."""

        def back() -> Optional[Dict[str, str]]:
            info = self.c.job_info(jobid)
            if info and info.get("Restarts") == "1" and info.get("JobState") == "PENDING":
                return info
            return None

        what = f"job {jobid} requeued and pending"
        return self.c.wait_until(back, timeout=timeout, what=what)  # type: ignore[return-value]

    def preempt(self, node: str) -> str:
        """A high-partition job that needs all of ``node``: every low job there goes."""
        return self.c.sbatch(
            "true\n", user="ckptuser2", extra_args=["-p", "high", "-w", node, "--exclusive"]
        )

    def pfs_steps(self, key: str) -> List[int]:
        return [s.step for s in self.tier("pfs").steps(USER, key)]

    def assert_verified_on_pfs(self, key: str, *steps: int) -> None:
        pfs = PosixTier("pfs", str(self.pfs_root))
        for step in steps:
            res = pfs.verify(USER, key, step)
            assert res.ok, f"{key} step {step} on the PFS: {res}"


@pytest.fixture(scope="module")
def site(slurm_cluster: DevCluster) -> Iterator[TrainSite]:
    s = TrainSite(slurm_cluster)
    s.start_reference()
    try:
        with hooked_site(s):
            yield s
    finally:
        if s._ref is not None and s._ref.poll() is None:
            s._ref.kill()
            s._ref.wait()


@pytest.fixture
def t(site: TrainSite) -> Iterator[TrainSite]:
    """Per test: our hooks in place (a concurrent `dev-cluster up` may have replaced
    them) and the plain config (no PFS staging on requeue: a restart on another node
    must read the PFS itself); the config is put back afterwards."""
    site.ensure_hooks()
    site.configure(hooks={"stage_on_requeue": False})
    yield site
    site.configure(hooks={"stage_on_requeue": False})


# --------------------------------------------------------------------------- tests


def test_preempted_requeued_on_the_same_node_resumes_from_local(t: TrainSite) -> None:
    """A high job takes n1: SLURM sends SIGTERM, the trainer saves at the next step and
    exits, SLURM requeues the job (same id, same node list). The restart finds that step on
    n1's own disk and reads it there; the finished weights equal the uninterrupted run's."""
    key = f"same-{t.tok}"
    node = "n1"
    victim = t.train_job(key, ["-p", "low", "-w", node, "--requeue", "--open-mode=append"])
    high = None
    try:
        t.wait_output(victim, r"^COMMITTED step=")
        high = t.preempt(node)
        t.wait_requeued(victim)
        info = t.c.wait_job_state(victim, "COMPLETED", timeout=150)
        run = t.run_of(victim)
        out = run.text
        assert info["Restarts"] == "1", out
        # Requeued, not resubmitted: both runs are the same job id, on the same node.
        assert run.runs == [(victim, "0", node), (victim, "1", node)], out
        assert "DUE TO PREEMPTION" in out, out
        [saved] = run.preempted  # SIGTERM -> saved at the next step, exit 0
        [res] = run.resumed
        assert res["tier"] == "local", out
        assert res["step"] == saved and res["reached"] == str(saved), out
        assert res["lost"] == "0", out  # at most one interval may go; SIGTERM loses none
        assert run.done == [(STEPS, t.reference_digest())], out
        t.wait_hook("epilog", victim, node)
        t.assert_verified_on_pfs(key, saved, STEPS)
    finally:
        t.c.run(["scancel", victim] + ([high] if high else []), check=False)


def test_preempted_requeued_on_another_node_resumes_from_pfs(t: TrainSite) -> None:
    """As above, but the requeued job is moved to n3 while it waits: n3's disk has nothing
    of this series, so the restart reads the checkpoint the preempted run flushed to the
    PFS (the prolog stages nothing here: hooks.stage_on_requeue is off)."""
    key = f"moved-{t.tok}"
    with t.preempted_and_moved(key) as (victim, run):
        out = run.text
        [saved] = run.preempted
        [res] = run.resumed
        assert res["tier"] == "pfs", out  # nothing of this key on the new node's disk
        assert res["step"] == saved and res["lost"] == "0", out
        assert run.done == [(STEPS, t.reference_digest())], out
        t.wait_hook("epilog", victim, "n3")
        t.assert_verified_on_pfs(key, saved, STEPS)


@pytest.mark.parametrize("how", ["scancel", "time-limit"])
def test_signalled_job_saves_at_next_step_and_epilog_flushes(t: TrainSite, how: str) -> None:
    """SIGTERM (scancel) or SIGUSR1 (ckpt-srun's timer, --warn 40 with -t 1: 20 s in, well
    after the trainer has started - before its handlers are in, SIGUSR1 would kill it): the
    trainer saves at the next step and exits. Only every 1000th interval checkpoint is flushed by
    the job itself (flush_every) and ckpt-srun's own flush is off, so the newest interval
    checkpoint is still only on the node when the job ends: the epilog must flush it."""
    t.configure(hooks={"stage_on_requeue": False}, retention={"flush_every": 1000})
    key = f"{how}-{t.tok}"
    node = "n3" if how == "scancel" else "n2"
    if how == "scancel":
        srun_opts, args = "--warn 0 --no-flush", ["-w", node]
    else:
        srun_opts, args = "--warn 40s --no-requeue --no-flush", ["-w", node, "-t", "1"]
    jobid = t.train_job(key, args, steps=LONG_STEPS, srun_opts=srun_opts)
    try:
        # Two interval checkpoints: the first (seq 0) is flushed by the job, the second
        # is not (flush_every = 1000).
        t.wait_output(jobid, rf"^COMMITTED step={2 * INTERVAL}$")
        if how == "scancel":
            t.c.scancel(jobid)
            t.c.wait_job_state(jobid, "CANCELLED", timeout=60, fail_fast=False)
        else:
            t.c.wait_job_state(jobid, "COMPLETED", timeout=90)
        epilog = t.wait_hook("epilog", jobid, node)
        run = t.run_of(jobid)
        out = run.text
        if how == "time-limit":
            assert "ckpt-srun: time limit in" in out and "sending SIGUSR1" in out, out
        else:
            assert "CANCELLED AT" in out, out
        [saved] = run.preempted
        assert saved == t.reached(key) and saved in run.flushed, out  # nothing lost
        left = max(s for s in run.saved if s != saved)  # newest interval save before it
        assert left % INTERVAL == 0 and left not in run.flushed, out
        assert "node not drained" in epilog and not re.search(r"flushed 0 ", epilog), epilog
        assert {left, saved} <= set(t.pfs_steps(key)), (t.pfs_steps(key), epilog)
        t.assert_verified_on_pfs(key, left, saved)
    finally:
        t.c.run(["scancel", jobid], check=False)


KILLER = """\
#!/bin/bash
# The trainer in the background; SIGKILL the moment its first local commit shows.
log=$1
shift
"$@" >"$log" 2>&1 &
pid=$!
until grep -q '^COMMITTED step=' "$log"; do
    kill -0 "$pid" 2>/dev/null || { cat "$log"; exit 1; }
    sleep 0.05
done
kill -KILL "$pid"
wait "$pid"
echo "KILLED rc=$?"
cat "$log"
"""


def test_sigkilled_trainer_epilog_hands_slow_flush_to_stager(t: TrainSite) -> None:
    """SIGKILL right after the first local commit, while its flush crawls (100 kB/s): no
    one in the job gets to flush it (ckpt-srun's flush is off, as when the whole job dies).
    The epilog's 2 s budget is not enough either: it hands the checkpoint to the stager
    and drains the node with our reason; ``stager --once`` finishes the copy and the node
    returns to idle."""
    t.configure(
        hooks={"stage_on_requeue": False, "budget": "2s"},
        tiers_pfs={"bandwidth_limit": "100kB/s"},
    )
    key = f"killed-{t.tok}"
    node = "n1"
    killer = t.dir / "killer.sh"
    killer.write_text(KILLER)
    os.chmod(killer, 0o755)
    args = " ".join(t.trainer_args(key, LONG_STEPS))
    step_cmd = (
        f"{killer} {t.out / key}.log {PY} {t.train} {args} --sleep-per-step {SLEEP} "
        f"--progress-file {t.progress(key)}"
    )
    jobid = t.train_job(key, ["-w", node], srun_opts="--warn 0 --no-flush", step_cmd=step_cmd)
    try:
        t.c.wait_job_state(jobid, "COMPLETED", timeout=90)
        run = t.run_of(jobid)
        assert "KILLED rc=137" in run.text, run.text
        [step] = run.committed
        assert step == INTERVAL and step not in run.flushed, run.text
        line = t.wait_hook("epilog", jobid, node)
        assert "handed 1 to the stager" in line and "drained:" in line, line
        t.c.wait_node_state(node, lambda s: "DRAIN" in s, timeout=30)
        reason = t.node_reason(node)
        assert re.match(
            r"slurm_ckpt: flushing 1 checkpoint \([0-9.]+ ?KiB\); see ckpt-slurm status$", reason
        ), reason
        assert step not in t.pfs_steps(key)
        res = t.stager(node)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "node resumed" in res.stdout and "0 still owed" in res.stdout, res.stdout
        t.c.wait_node_state(node, "IDLE", timeout=30)
        assert t.pfs_steps(key) == [step]
        t.assert_verified_on_pfs(key, step)
    finally:
        t.c.run(["scancel", jobid], check=False)
        t.configure(hooks={"stage_on_requeue": False})
        if "DRAIN" in t.c.node_state(node):
            t.resume(node)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))
