"""PyTorch Lightning (real pytorch-lightning from PyPI, CPU): its checkpoints through
slurm_ckpt.lightning, interrupted and resumed.

examples/lightning_train.py is run in subprocesses, on a tmpfs local tier and a
loop-mounted ext4 PFS, and must end with weights bitwise equal to a plain Lightning run
without slurm_ckpt; the batches trained after a resume must be exactly the ones the
uninterrupted run trained at those steps (the data position continues, nothing replayed
or skipped); the checkpoint must verify on the PFS after the job. Under SLURM variables
(so Lightning's SLURMEnvironment with its auto-requeue is active) a SIGUSR1 must be
answered by our save at a step boundary: no ``hpc_ckpt_*.ckpt`` written inside Lightning's
signal handler, no ``scontrol requeue`` from Lightning.
"""

from __future__ import annotations

import os
import pwd
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest
import pytorch_lightning as pl  # a dev dependency (scripts/setup): missing fails, never skips
import torch
from test_torch_resume import TrainProc

from slurm_ckpt import Checkpointer
from slurm_ckpt.errors import CkptError
from slurm_ckpt.lightning import CKPT_FILE, SlurmCheckpointCallback, SlurmCheckpointIO
from slurm_ckpt.tiers.posix import PosixTier

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "lightning_train.py"
STEPS = 60  # 24 steps per epoch (96 samples, batch 4): a run crosses two epoch ends
_DONE = r"^DONE step=(\d+) digest=([0-9a-f]{64})$"


class LightningProc(TrainProc):
    """examples/lightning_train.py in a subprocess, its lines read as they come."""

    def __init__(self, args: List[str], cwd: Path, env: Optional[Dict[str, str]] = None):
        full_env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--steps", str(STEPS), "--root", str(cwd), *args],
            cwd=cwd,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines = []
        self._q: queue.Queue[Optional[str]] = queue.Queue()
        self._eof = False
        threading.Thread(target=self._read, daemon=True).start()

    def batches(self, rank: int = 0) -> Dict[int, str]:
        """step -> the sample indices that ``rank`` trained at that step."""
        out = {}
        for line in self.lines:
            m = re.match(rf"^BATCH step=(\d+) rank={rank} idx=([\d,]+)$", line)
            if m:
                out[int(m.group(1))] = m.group(2)
        return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Tuple[str, Dict[int, str]]:
    """A plain Lightning run (no slurm_ckpt at all): its final digest and its batches."""
    run = LightningProc(["--no-ckpt"], tmp_path_factory.mktemp("ref"))
    try:
        done = run.expect(_DONE)
        assert run.finish() == 0, run.tail()
    finally:
        run.close()
    assert done.group(1) == str(STEPS)
    batches = run.batches()
    assert sorted(batches) == list(range(1, STEPS + 1))
    return done.group(2), batches


@pytest.fixture
def tiers(mounts: Any, pfs: Path) -> Iterator[Tuple[Path, Path]]:
    yield mounts.tmpfs("64m", "local"), pfs


def _args(tiers: Tuple[Path, Path], *more: str) -> List[str]:
    local, pfs = tiers
    return ["--local", str(local), "--pfs", str(pfs), "--key", "lit", *more]


def _checkpointer(tiers: Tuple[Path, Path]) -> Checkpointer:
    local, pfs = tiers
    return Checkpointer(
        local=local, warm=pfs, key="lit", install_signals=False, rank=0, world_size=1
    )


def _resume_and_finish(
    tiers: Tuple[Path, Path], cwd: Path, reference: Tuple[str, Dict[int, str]], at: int, tier: str
) -> None:
    """Resume from step ``at`` (from ``tier``), run to the end, compare with the reference."""
    run = LightningProc(_args(tiers), cwd)
    try:
        first = run.expect(r"^(START fresh|RESUMED step=(\d+) tier=(\w+) path=(.+))$")
        assert first.group(2) == str(at) and first.group(3) == tier, first.group(0)
        assert first.group(4).endswith(f"/step-{at:010d}/rank-00000/{CKPT_FILE}")
        done = run.expect(_DONE)
        assert run.finish() == 0, run.tail()
    finally:
        run.close()
    digest, ref_batches = reference
    got = run.batches()
    # the data continues where it stopped: the very next batch, nothing replayed/skipped
    assert min(got) == at + 1, sorted(got)[:3]
    assert got == {s: b for s, b in ref_batches.items() if s > at}
    assert done.group(2) == digest, "weights differ from the uninterrupted run"


def test_sigterm_mid_epoch_resumes_bitwise_from_the_pfs(
    tiers: Tuple[Path, Path], tmp_path: Path, reference: Tuple[str, Dict[int, str]]
) -> None:
    """SIGTERM mid-run: the preemption save at the next step boundary, exit 0; the job
    resumes on a node whose local tier is empty (the PFS copy, verified) and ends equal."""
    run = LightningProc(_args(tiers, "--sleep-per-step", "0.05"), tmp_path)
    try:
        run.expect(r"^START fresh$")
        run.expect(r"^STEP 13 ")  # mid-epoch, after the step-10 interval save
        run.signal(signal.SIGTERM)
        pre = int(run.expect(r"^PREEMPTED step=(\d+)$").group(1))
        assert run.finish() == 0, run.tail()
    finally:
        run.close()
    assert pre >= 13 and max(run.batches()) == pre  # saved at the step it stopped at
    assert run.values("SAVED") == [10, pre]
    with _checkpointer(tiers) as ckpt:  # after the job: verified on the PFS
        assert ckpt.warm.verify(ckpt.user, ckpt.shard_key, pre).ok
        assert ckpt.warm.verify(ckpt.user, ckpt.shard_key, 10).ok
        user = ckpt.user
    local, _ = tiers
    shutil.rmtree(local / user)  # another node: nothing local
    _resume_and_finish(tiers, tmp_path, reference, pre, "pfs")


def test_sigusr1_under_slurm_one_owner_and_no_save_in_the_handler(
    tiers: Tuple[Path, Path], tmp_path: Path, reference: Tuple[str, Dict[int, str]]
) -> None:
    """Under SLURM Lightning's SLURMEnvironment(auto_requeue=True) would answer SIGUSR1 by
    saving hpc_ckpt_1.ckpt inside its handler and running scontrol requeue. With our
    callback: our save at the step boundary, fit stops, exit 0, neither of Lightning's."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    trip = tmp_path / "scontrol-called"
    scontrol = bin_dir / "scontrol"  # a tripwire: Lightning's requeue must never run
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {trip}\n')
    scontrol.chmod(0o755)
    slurm = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_NTASKS": "1",
        "SLURM_JOB_NAME": "lit",
        "SLURM_JOB_ID": "4242",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_NODELIST": "localhost",
    }
    run = LightningProc(_args(tiers, "--sleep-per-step", "0.05"), tmp_path, env=slurm)
    try:
        run.expect(r"^START fresh$")
        run.expect(r".*SLURMEnvironment auto-requeue switched off")
        run.expect(r"^STEP 27 ")  # in the second epoch, after the step-20 save
        run.signal(signal.SIGUSR1)
        pre = int(run.expect(r"^PREEMPTED step=(\d+)$").group(1))
        assert run.finish() == 0, run.tail()
    finally:
        run.close()
    assert pre >= 27 and max(run.batches()) == pre
    assert run.values("SAVED") == [10, 20, pre]
    assert not list(tmp_path.rglob("hpc_ckpt_*")), "Lightning saved inside its handler"
    assert not trip.exists(), f"Lightning ran scontrol {trip.read_text()}"
    with _checkpointer(tiers) as ckpt:
        assert ckpt.warm.verify(ckpt.user, ckpt.shard_key, pre).ok
    _resume_and_finish(tiers, tmp_path, reference, pre, "local")


def test_resume_from_an_epoch_end_and_the_retention_owns_deletion(
    tiers: Tuple[Path, Path], tmp_path: Path, reference: Tuple[str, Dict[int, str]]
) -> None:
    """A job that ends at an epoch boundary (max_steps=24, saved there); the next one,
    with a larger max_steps, goes on from there. Lightning's ModelCheckpoint runs beside
    ours: its saves of the same steps (top-2 and "last") neither fail nor replace ours,
    and its remove_checkpoint (top-k rotation) deletes nothing of ours."""
    args = _args(tiers, "--steps", "24", "--interval-steps", "8", "--model-checkpoint")
    run = LightningProc(args, tmp_path)
    try:
        assert run.expect(_DONE).group(1) == "24"
        assert run.finish() == 0, run.tail()
    finally:
        run.close()
    assert sorted(set(run.values("SAVED"))) == [8, 16, 24]
    assert not [line for line in run.lines if "FAILED" in line or "replacing" in line]
    with _checkpointer(tiers) as ckpt:
        io = SlurmCheckpointIO(ckpt)
        path = io.restore_path()
        assert path is not None and ckpt.restored is not None and ckpt.restored.step == 24
        io.remove_checkpoint(path)
        assert Path(path).is_file()
        for tier in (ckpt.local, ckpt.warm):
            assert tier.verify(ckpt.user, ckpt.shard_key, 24).ok
        assert ckpt.warm.verify(ckpt.user, ckpt.shard_key, 8).ok  # rotated out by Lightning
    _resume_and_finish(tiers, tmp_path, reference, 24, "local")


def test_ddp_two_processes_sigterm_past_the_first_epoch_resumes_bitwise(
    tiers: Tuple[Path, Path], tmp_path: Path
) -> None:
    """DDP, 2 CPU processes (gloo), 12 steps per epoch: SIGTERM in the second epoch, both
    ranks save together at one step boundary (rank 0 writes), both resume from it and
    train exactly the batches, and end with exactly the weights, of an uninterrupted run
    (every rank's RNG restored; StatefulDistributedSampler keeps each rank's position)."""
    ddp = ["--devices", "2", "--steps", "36"]
    (tmp_path / "ref").mkdir()
    ref = LightningProc([*ddp, "--no-ckpt"], tmp_path / "ref")  # alongside
    run = LightningProc(_args(tiers, *ddp, "--sleep-per-step", "0.05"), tmp_path)
    try:
        run.expect(r"^STEP 14 ")
        run.signal(signal.SIGTERM)  # Lightning's launcher passes it on to rank 1
        pre = int(run.expect(r"^PREEMPTED step=(\d+)$").group(1))
        assert run.finish() == 0, run.tail()
        ref_done = ref.expect(_DONE)
        assert ref.finish() == 0, ref.tail()
    finally:
        run.close()
        ref.close()
    assert 14 <= pre < 36 and run.values("SAVED") == [10, pre]
    assert max(run.batches(0)) == max(run.batches(1)) == pre
    with _checkpointer(tiers) as ckpt:
        assert ckpt.warm.verify(ckpt.user, ckpt.shard_key, pre).ok
    again = LightningProc(_args(tiers, *ddp), tmp_path)
    try:
        for _ in range(2):  # each rank restores the same step
            assert again.expect(r"^(START fresh|RESUMED step=(\d+) .*)$").group(2) == str(pre)
        done = again.expect(_DONE)
        assert again.finish() == 0, again.tail()
    finally:
        again.close()
    for rank in (0, 1):
        want = {s: b for s, b in ref.batches(rank).items() if s > pre}
        assert again.batches(rank) == want and min(want) == pre + 1, f"rank {rank}"
    assert done.group(2) == ref_done.group(2), "weights differ from the uninterrupted run"


# ------------------------------------------------------------------------------------------
# in process: what is refused, and why
# ------------------------------------------------------------------------------------------
def test_local_tier_only_no_traceback_and_the_end_of_fit_committed(
    mounts: Any, tmp_path: Path
) -> None:
    """The documented laptop mode (a local tier only): no traceback at any save (before:
    an AssertionError from the pipeline's flush at every save), and the end of ``fit()``
    commits the final step although the interval (25) does not fall on it (60)."""
    local = mounts.tmpfs("64m", "local")
    run = LightningProc(["--local", str(local), "--key", "lit", "--interval-steps", "25"], tmp_path)
    try:
        done = run.expect(_DONE)
        assert run.finish() == 0, run.tail()
    finally:
        run.close()
    out = "\n".join(run.lines)
    assert "Traceback" not in out and "AssertionError" not in out, out[-3000:]
    assert done.group(1) == str(STEPS)
    tier = PosixTier("local", str(local))
    user = pwd.getpwuid(os.getuid()).pw_name
    steps = [i.step for i in tier.steps(user, "lit")]
    assert steps[-1] == STEPS, steps
    assert tier.verify(user, "lit", STEPS).ok


def test_a_multi_part_checkpointer_is_refused(tmp_path: Path) -> None:
    (tmp_path / "l").mkdir()
    (tmp_path / "p").mkdir()
    ckpt = Checkpointer(
        local=tmp_path / "l", warm=tmp_path / "p", key="k", install_signals=False, rank=1,
        world_size=2,
    )  # fmt: skip
    try:
        with pytest.raises(CkptError, match="rank=0, world_size=1") as err:
            SlurmCheckpointIO(ckpt)
        assert "\n" not in str(err.value)
    finally:
        ckpt.close()


def test_model_parallel_is_routed_to_the_dcp_backend(tmp_path: Path) -> None:
    """ModelParallel (and FSDP, which Lightning runs on GPUs only) never call
    CheckpointIO: the callback refuses them with one line naming the DCP route."""
    from pytorch_lightning.strategies import ModelParallelStrategy

    (tmp_path / "l").mkdir()
    (tmp_path / "p").mkdir()
    with Checkpointer(
        local=tmp_path / "l", warm=tmp_path / "p", key="k", install_signals=False
    ) as ckpt:
        io = SlurmCheckpointIO(ckpt)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            strategy=ModelParallelStrategy(),
            plugins=[io],
            callbacks=[SlurmCheckpointCallback(io)],
            logger=False,
            enable_progress_bar=False,
            max_steps=1,
        )

        class M(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.lin = torch.nn.Linear(2, 1)

            def training_step(self, batch: Any, i: int) -> Any:
                return self.lin(batch).sum()

            def configure_optimizers(self) -> Any:
                return torch.optim.SGD(self.parameters(), lr=0.1)

        environ = dict(os.environ)
        try:
            with pytest.raises(CkptError, match=r"dcp_writer") as err:
                trainer.fit(M(), torch.utils.data.DataLoader(torch.randn(4, 2)))
        finally:  # Lightning set up a process group and its variables in this process
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
            os.environ.clear()
            os.environ.update(environ)
        assert "ModelParallelStrategy" in str(err.value) and "\n" not in str(err.value)
