"""``ckpt-srun --spares 1 --in-job`` on the real dev cluster: the launcher's side.

A 3 + 1 spare node job (``sbatch -N4 --no-kill``) runs three ranks and one hot spare of
``tests/in_job_worker.py`` (a process that speaks the membership protocol of
:mod:`slurm_ckpt.core.membership`; no torch: the process group's re-form is the job
layer's, tested there). The node dies as on a real cluster (``dev-cluster power-off``:
slurmd and every process SIGKILLed, its disk gone) and **nothing marks it DOWN**
(``SlurmdTimeout`` is 300 s). What must hold:

* ckpt-srun runs one ``srun --overlap`` step per node, the spare's with
  ``SLURM_CKPT_SPARE=1``, every one with ``SLURM_CKPT_RECOVERY_DIR`` (made ``0700``),
  and writes epoch 0;
* on the heartbeats' verdict it writes epoch 1 with the spare in the lost rank's place;
  the survivors **keep their processes** (one ``PID`` line each, the same pid, and they
  see epoch 1); the spare joins as rank 1;
* when every live rank wrote ``rank-<r>.done``, ckpt-srun writes ``end.json``, stops the
  dead node's step (srun waits for it for ever) and the job ends 0: same job id,
  ``Restarts=0``, one run of the batch script; the lost node is in no later step;
* with the **hot spare lost** first, the training node's loss finds no spare ready: the
  fallback is today's path, and with no spare left that is a requeue (``Restarts=1``).

Every wait polls SLURM, the job's output or the files; nothing sleeps for a fixed time.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import sys
from pathlib import Path
from typing import Dict, Iterator, List

import pytest
from helpers.cluster import DevCluster, at_least_nodes
from test_cluster_e2e import CKPT_SLURM, CKPT_SRUN, PY
from test_cluster_multinode import RUN_LINE, MultiRun, MultiSite, _bring_back
from test_cluster_train import USER

pytestmark = pytest.mark.root

NEED_NODES = 4
WORLD = 3
LOST = "n2"
SPARE = "n4"
WORKER = Path(__file__).parent / "in_job_worker.py"
DDP_WORKER = Path(__file__).parent / "in_job_ddp_worker.py"
DDP_STEPS = 60


class InJobSite(MultiSite):
    def __init__(self, cluster: DevCluster) -> None:
        super().__init__(cluster)
        self.worker = self.dir / "in_job_worker.py"
        self.ddp_worker = self.dir / "in_job_ddp_worker.py"
        for src, dst in ((WORKER, self.worker), (DDP_WORKER, self.ddp_worker)):
            shutil.copyfile(src, dst)
            os.chmod(dst, 0o644)

    def in_job(self, key: str, extra_sbatch: List[str] = (), cmd: str = "") -> str:
        cmd = cmd or f"{PY} {self.worker} --steps 100 --spare-steps 20 --step-s 0.5"
        body = RUN_LINE + (
            f"exec {CKPT_SRUN} --key {key} --warn 0 --spares 1 --in-job --node-wait 1min -- "
            f"--ntasks-per-node=1 --label {cmd}\n"
        )
        nodes = ",".join(f"n{i}" for i in range(1, NEED_NODES + 1))
        return self.job(
            body,
            args=["-N", str(NEED_NODES), "-w", nodes, "--no-kill", "-p", "low", *extra_sbatch],
        )

    def ddp_job(self, key: str) -> str:
        return self.in_job(key, cmd=f"{PY} {self.ddp_worker} {DDP_STEPS} 0.3 {self.out}")

    def done(self, job: str) -> Dict[int, dict]:
        run = MultiRun(self.c.job_output(job))
        return {
            r: json.loads(run.lines(r, "DONE ")[-1][5:])
            for r in range(WORLD)
            if run.lines(r, "DONE ")
        }

    def recovery_dir(self, job: str) -> Path:
        return self.pfs_root / USER / ".slurm_ckpt" / "jobs" / job / "recovery"

    def timeline(self, job: str) -> List[dict]:
        path = self.pfs_root / USER / ".slurm_ckpt" / "jobs" / job / "srun.jsonl"
        return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


@pytest.fixture(scope="module")
def site(slurm_cluster: DevCluster) -> Iterator[InJobSite]:
    with at_least_nodes(slurm_cluster, NEED_NODES), InJobSite(slurm_cluster).running() as s:
        yield s


@pytest.fixture
def t(site: InJobSite) -> Iterator[InJobSite]:
    site.ensure_hooks()
    site.configure(hooks={"stage_on_requeue": False})
    yield site


def test_node_lost_spare_takes_its_rank_survivors_keep_their_processes(t: InJobSite) -> None:
    job = t.in_job(f"injob-{t.tok}")
    try:
        t.c.wait_until(
            lambda: (
                all(MultiRun(t.c.job_output(job)).lines(r, "PID ") for r in range(WORLD))
                and "SPARE task=3" in t.c.job_output(job)
            ),
            timeout=120,
            interval=0.2,
            what=f"every rank and the spare of job {job} started",
        )
        before = {r: MultiRun(t.c.job_output(job)).lines(r, "PID ") for r in range(WORLD)}
        rd = t.recovery_dir(job)
        st = rd.stat()
        uid = pwd.getpwnam(USER).pw_uid
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == uid, oct(st.st_mode)
        ep0 = json.loads((rd / "epoch-0.json").read_text())
        assert ep0["world_size"] == WORLD and ep0["lost"] == [], ep0
        t.c.power_off(LOST, wipe_local=True)  # nobody marks it DOWN
        info = t.c.wait_job_state(job, ("COMPLETING", "COMPLETED"), timeout=240)
        run = MultiRun(t.c.job_output(job))
        out = run.text
        assert info["ExitCode"] == "0:0" and info["Restarts"] == "0", (info, out)
        assert [(j, r) for j, r, _ in run.runs] == [(job, "0")], out
        ep1 = json.loads((rd / "epoch-1.json").read_text())
        assert ep1["lost"] == [1] and ep1["members"]["1"]["task"] == WORLD, ep1
        assert (rd / "end.json").exists()
        # The survivors: one process each, the same before and after, and they saw epoch 1.
        for r in (0, 2):
            assert run.lines(r, "PID ") == before[r], (r, out)
            pid = before[r][0].split()[1].split("=")[1]
            assert f"DONE rank={r} pid={pid}" in run.lines(r, "DONE "), (r, out)
            assert "EPOCH 1 lost=[1]" in run.lines(r, "EPOCH "), (r, out)
        # Rank 1 is the spare now: it joined in epoch 1 on the spare node and finished.
        joined = run.lines(1, "JOINED ")
        assert any("rank=1 epoch=1" in ln and f"node={SPARE}" in ln for ln in joined), out
        assert run.lines(1, "DONE rank=1"), out
        assert f"in-job: node {LOST} lost" in out and "rank 1 -> spare n4" in out, out
        assert "every rank finished" in out and "relaunching" not in out, out
        events = [e.get("event") for e in t.timeline(job)]
        assert "node_lost" in events and "in_job_reform" in events, events
        lost = [e for e in t.timeline(job) if e.get("event") == "node_lost"]
        assert lost[0]["nodes"] == [LOST] and lost[0]["by"] == "heartbeat", lost
    finally:
        t.c.run(["scancel", job], check=False)
        _bring_back(t, LOST)


def test_ddp_node_killed_mid_step_survivors_keep_training(t: InJobSite) -> None:
    """DDP over gloo through slurm_ckpt.torch.recovery under ckpt-srun --in-job: n2 dies
    mid-run (nobody marks it DOWN); the survivors keep their processes, the spare takes
    rank 1 from its partner's RAM copy, at most one step is redone, same job,
    Restarts=0, and the result is bitwise that of an uninterrupted run."""
    t.configure(
        hooks={"stage_on_requeue": False},
        retention={"keep_local": 4},
        partner={"enabled": True, "keep_partner": 2},
    )
    ref = t.ddp_job(f"ddpref-{t.tok}")
    job = ""
    try:
        info = t.c.wait_job_state(ref, ("COMPLETING", "COMPLETED"), timeout=300)
        want = t.done(ref)
        assert info["ExitCode"] == "0:0" and sorted(want) == [0, 1, 2], t.c.job_output(ref)
        [digest] = {d["digest"] for d in want.values()}
        assert all(d["history"] == [] for d in want.values()), want
        job = t.ddp_job(f"ddp-{t.tok}")
        t.c.wait_until(
            lambda: all(
                "STEP 10" in MultiRun(t.c.job_output(job)).lines(r, "STEP ") for r in range(WORLD)
            ),
            timeout=240,
            interval=0.2,
            what=f"every rank of job {job} past step 10",
        )
        before = {r: MultiRun(t.c.job_output(job)).lines(r, "PID ") for r in (0, 2)}
        t.c.power_off(LOST, wipe_local=True)  # mid-step; nobody marks it DOWN
        info = t.c.wait_job_state(job, ("COMPLETING", "COMPLETED"), timeout=300)
        run = MultiRun(t.c.job_output(job))
        out = run.text
        assert info["ExitCode"] == "0:0" and info["Restarts"] == "0", (info, out)
        assert [(j, r) for j, r, _ in run.runs] == [(job, "0")], out
        got = t.done(job)
        assert sorted(got) == [0, 1, 2], out
        for r in (0, 2):  # the survivors: the same process all along, restored from RAM
            assert run.lines(r, "PID ") == before[r] and len(before[r]) == 1, (r, out)
            [h] = got[r]["history"]
            assert h["epoch"] == 1 and h["tier"] == "ram" and h["recomputed"] <= 1, got
        assert f"node={SPARE}" in "".join(ln for ln in out.splitlines() if "spare3: PID" in ln)
        assert {d["digest"] for d in got.values()} == {digest}, (got, want)
        assert f"in-job: node {LOST} lost" in out and "relaunching" not in out, out
        g = json.loads(
            t.c.run(
                [str(CKPT_SLURM), "--config", str(t.config), "goodput", job, "--json"],
                user=USER,
            ).stdout
        )
        [f] = g["failures"]
        assert f["mode"] == "in_job" and f["nodes"] == [LOST], g
        print(
            f"\n[in-job ddp] {LOST} killed: detection {f['detection_s']:.1f}s, epoch 1 "
            f"{f['recovery_s']:.1f}s later, re-form {f['reform_s']}, restore {f['restore_s']}, "
            f"training again {f['training_again_s']}s after the last heartbeat, "
            f"{f['steps_recomputed']} step(s) recomputed; survivors' history {got[0]['history']}"
        )
    finally:
        t.c.run(["scancel", ref, *([job] if job else [])], check=False)
        _bring_back(t, LOST)
        t.configure(hooks={"stage_on_requeue": False})


def test_hot_spare_lost_falls_back_to_requeue(t: InJobSite) -> None:
    """The spare's node dies first (it is not offered again), then a training node: no
    spare is ready, so ckpt-srun falls back to today's path, which with no spare left
    requeues the job (a --no-kill job is never requeued by SLURM itself)."""
    job = t.in_job(f"injob-nospare-{t.tok}", ["--requeue", "--open-mode=append"])
    try:
        t.c.wait_until(
            lambda: (
                "SPARE task=3" in t.c.job_output(job)
                and all(MultiRun(t.c.job_output(job)).lines(r, "PID ") for r in range(WORLD))
            ),
            timeout=120,
            interval=0.2,
            what=f"every rank and the spare of job {job} started",
        )
        t.c.power_off(SPARE)
        t.c.wait_until(
            lambda: f"in-job: spare {SPARE} is gone" in t.c.job_output(job),
            timeout=60,
            interval=0.2,
            what="the spare's loss noticed",
        )
        t.c.power_off(LOST)
        t.c.wait_until(
            lambda: (t.c.job_info(job) or {}).get("Restarts") == "1",
            timeout=120,
            what=f"job {job} requeued",
        )
        out = t.c.job_output(job)
        assert f"in-job: node {LOST} lost and no spare ready: falling back" in out, out
        assert "no spare left" in out and "requeueing (restart 1)" in out, out
        assert not (t.recovery_dir(job) / "epoch-1.json").exists()
    finally:
        t.c.run(["scancel", job], check=False)
        for node in (LOST, SPARE):
            _bring_back(t, node)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v", "-s"]))
