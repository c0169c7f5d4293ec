"""``ckpt-srun --spares 1 --in-job`` on the real dev cluster: the launcher's side.

A 3 + 1 spare node job (``sbatch -N4 --no-kill``) runs three ranks and one hot spare of
``tests/in_job_ddp_worker.py`` (DDP or FSDP2 over gloo through ``slurm_ckpt.torch.recovery``)
or, for the fallback, of ``tests/in_job_worker.py`` (a process that speaks the membership
protocol of :mod:`slurm_ckpt.core.membership`, no torch). The node dies as on a real
cluster (``dev-cluster power-off``: slurmd and every process SIGKILLed, its disk gone)
and **nothing marks it DOWN** (``SlurmdTimeout`` is 300 s). What must hold:

* ckpt-srun runs one ``srun --overlap`` step per node, the spare's with
  ``SLURM_CKPT_SPARE=1``, every one with ``SLURM_CKPT_RECOVERY_DIR`` (made ``0700``),
  and writes epoch 0;
* on the heartbeats' verdict it writes epoch 1 with the spare in the lost rank's place;
  the survivors **keep their processes** (one ``PID`` line each, the same pid, and they
  restore from their own RAM snapshot in epoch 1); the spare joins as rank 1;
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
from typing import Dict, Iterator, List, Tuple

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
TINY_MODEL = Path(__file__).parent / "helpers" / "tiny_model.py"
DDP_STEPS = 60
#: FSDP2's run: few short steps (CI's budget); the node dies at step 5, and 40 steps (8 s)
#: remain for a loaded CI host to power it off before the run would end.
FSDP_STEPS = 45
FSDP_STEP_S = 0.2


class InJobSite(MultiSite):
    def __init__(self, cluster: DevCluster) -> None:
        super().__init__(cluster)
        self.worker = self.dir / "in_job_worker.py"
        self.ddp_worker = self.dir / "in_job_ddp_worker.py"
        # the DDP worker imports its model from helpers/ next to it (sys.path[0])
        (self.dir / "helpers").mkdir(mode=0o755, exist_ok=True)
        os.chmod(self.dir / "helpers", 0o755)
        for src, dst in (
            (WORKER, self.worker),
            (DDP_WORKER, self.ddp_worker),
            (TINY_MODEL, self.dir / "helpers" / "tiny_model.py"),
        ):
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

    def ddp_job(self, key: str, mode: str = "ddp", reference: bool = False) -> str:
        """The DDP or FSDP2 worker's job. A ``reference`` run (nothing is killed) does
        not sleep between steps: the sleep leaves time for a kill, and the values do
        not depend on it (CI's budget)."""
        if mode == "fsdp":
            args = f"{FSDP_STEPS} {0 if reference else FSDP_STEP_S} {self.out} --fsdp"
        else:
            args = f"{DDP_STEPS} {0 if reference else 0.3} {self.out}"
        return self.in_job(key, cmd=f"{PY} {self.ddp_worker} {args}")

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


def killed_mid_step(t: InJobSite, mode: str, kill_after: int) -> Tuple[str, Dict[int, dict]]:
    """A reference job (no failure), then the same job with n2 powered off once every
    rank is past step ``kill_after`` (nobody marks it DOWN); what both runs must show
    whatever the parallelism: the same job ends 0 with Restarts=0, the survivors keep
    their one process and restore from their own RAM snapshot with at most one step
    redone, the spare takes rank 1 on n4, and every rank's final digest is the
    reference's. Gives the job's output and its DONE records."""
    t.configure(
        hooks={"stage_on_requeue": False},
        retention={"keep_local": 4},
        partner={"enabled": True, "keep_partner": 2},
    )
    ref = t.ddp_job(f"{mode}ref-{t.tok}", mode, reference=True)
    job = ""
    try:
        info = t.c.wait_job_state(ref, ("COMPLETING", "COMPLETED"), timeout=300)
        want = t.done(ref)
        assert info["ExitCode"] == "0:0" and sorted(want) == [0, 1, 2], t.c.job_output(ref)
        assert all(d["history"] == [] for d in want.values()), want
        job = t.ddp_job(f"{mode}-{t.tok}", mode)
        t.c.wait_until(
            lambda: all(
                f"STEP {kill_after}" in MultiRun(t.c.job_output(job)).lines(r, "STEP ")
                for r in range(WORLD)
            ),
            timeout=240,
            interval=0.2,
            what=f"every rank of job {job} past step {kill_after}",
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
        assert got[0]["history"][0]["step"] == got[2]["history"][0]["step"], got
        for r in range(WORLD):  # bitwise the uninterrupted run, rank by rank
            assert got[r]["digest"] == want[r]["digest"], (r, got, want)
        assert f"in-job: node {LOST} lost" in out and "relaunching" not in out, out
        launcher_side(t, job, out)
        g = json.loads(
            t.c.run(
                [str(CKPT_SLURM), "--config", str(t.config), "goodput", job, "--json"],
                user=USER,
            ).stdout
        )
        [f] = g["failures"]
        assert f["mode"] == "in_job" and f["nodes"] == [LOST], g
        # productive time from the recovery loop's progress (it was 0: no should_save)
        assert 0 < g["productive_s"] < g["wall_s"] and g["mean_step_s"], g
        print(
            f"\n[in-job {mode}] {LOST} killed: detection {f['detection_s']:.1f}s, epoch 1 "
            f"{f['recovery_s']:.1f}s later, re-form {f['reform_s']}, restore {f['restore_s']}, "
            f"training again {f['training_again_s']}s after the last heartbeat, "
            f"{f['steps_recomputed']} step(s) recomputed; survivors' history {got[0]['history']}"
            f"; the spare's start {got[1]['started']}; the spare's setup "
            f"{run.lines(1, 'SETUP ')[-1:]}"
        )
        return out, got
    finally:
        t.c.run(["scancel", ref, *([job] if job else [])], check=False)
        _bring_back(t, LOST)
        t.configure(hooks={"stage_on_requeue": False})


def launcher_side(t: InJobSite, job: str, out: str) -> None:
    """ckpt-srun's part of a recovered job: the recovery directory (``0700``, the
    user's), epoch 0 of three ranks, epoch 1 with the spare (task 3) in rank 1's place,
    ``end.json`` once every rank was done, and the timeline's heartbeat verdict."""
    rd = t.recovery_dir(job)
    st = rd.stat()
    uid = pwd.getpwnam(USER).pw_uid
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == uid, oct(st.st_mode)
    ep0 = json.loads((rd / "epoch-0.json").read_text())
    assert ep0["world_size"] == WORLD and ep0["lost"] == [], ep0
    ep1 = json.loads((rd / "epoch-1.json").read_text())
    assert ep1["lost"] == [1] and ep1["members"]["1"]["task"] == WORLD, ep1
    assert (rd / "end.json").exists()
    assert f"rank 1 -> spare {SPARE}" in out and "every rank finished" in out, out
    events = t.timeline(job)
    assert "in_job_reform" in [e.get("event") for e in events], events
    lost = [e for e in events if e.get("event") == "node_lost"]
    assert lost and lost[0]["nodes"] == [LOST] and lost[0]["by"] == "heartbeat", lost


def test_ddp_node_killed_mid_step_survivors_keep_training(t: InJobSite) -> None:
    """DDP over gloo through slurm_ckpt.torch.recovery under ckpt-srun --in-job: n2 dies
    mid-run (nobody marks it DOWN); the survivors keep their processes, the spare takes
    rank 1 from its partner's RAM copy, at most one step is redone, same job,
    Restarts=0, and the result is bitwise that of an uninterrupted run."""
    _, got = killed_mid_step(t, "ddp", 10)
    assert len({d["digest"] for d in got.values()}) == 1, got  # data-parallel: one model


def test_fsdp2_node_killed_mid_step_spare_takes_its_shard_from_partner_ram(
    t: InJobSite,
) -> None:
    """The same with FSDP2 (``fully_shard`` over gloo, each rank holding a third of every
    parameter and of its momentum): no other rank holds the lost rank's shard, so the
    spare must take it from the partner's RAM copy (tier ``partner-ram``: not the NVMe
    partner copy, not the warm tier) at the step the survivors restored from their own
    RAM; each rank's final shard is bitwise the uninterrupted run's. Few short steps:
    the kill lands at step 5 of 30 (0.2 s each)."""
    _, got = killed_mid_step(t, "fsdp", 5)
    restored = got[0]["history"][0]["step"]
    assert got[1]["started"] == {"step": restored, "tier": "partner-ram"}, got
    assert got[1]["history"] == [] and got[1]["last"] == FSDP_STEPS, got
    assert len({d["digest"] for d in got.values()}) == WORLD, got  # three different shards


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
