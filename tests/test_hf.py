"""A real HF Trainer (transformers from PyPI, a tiny GPT-2 from a config, CPU) protected by
:class:`slurm_ckpt.hf.SlurmCkptCallback`, in separate processes (tests/hf_worker.py):

1. an uninterrupted run (the reference);
2. a run that gets SIGTERM at the end of step 7: the Trainer saves checkpoint-7 at that
   step boundary and stops; the checkpoint verifies on the PFS after the job;
3. a resume on another node (an empty local tier): ``restore_path()`` fetches step 7
   from the PFS; SIGKILL inside the Trainer's save of step 8 leaves an incomplete
   ``checkpoint-8`` that HF's own ``get_last_checkpoint`` would pick;
4. a resume on that node: step 7 (never the incomplete 8), to the end.

The final weights equal the reference's bit for bit, and the samples of every step (the
DataLoader position after each resume) are the reference's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import torch
from transformers.trainer_utils import get_last_checkpoint  # the dev extra installs it

from slurm_ckpt.tiers.posix import PosixTier

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "hf_worker.py"


def run(workdir: Path, local: Path, pfs: Path, *extra: str, rc: int = 0) -> Dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    p = subprocess.run(
        [sys.executable, str(WORKER), str(workdir), str(local), str(pfs), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == rc, p.stdout[-3000:] + p.stderr[-3000:]
    res = workdir / "result.json"
    return json.loads(res.read_text()) if rc == 0 else {}


def batches(workdir: Path, rank: int = 0) -> Dict[int, List[int]]:
    out: Dict[int, List[int]] = {}
    for line in (workdir / f"batches.{rank}.jsonl").read_text().splitlines():
        row = json.loads(line)
        out[row["step"]] = row["ids"]
    return out


def test_sigterm_resume_and_kill_mid_save_end_bitwise_equal(tmp_path: Path) -> None:
    ref = run(tmp_path / "ref", tmp_path / "ref-local", tmp_path / "ref-pfs")
    assert ref["done"] and ref["resumed_from"] is None
    want = torch.load(tmp_path / "ref" / "final.pt", weights_only=True)
    ref_batches = batches(tmp_path / "ref")
    assert sorted(ref_batches) == list(range(1, 13))

    work, pfs = tmp_path / "job", tmp_path / "pfs"
    node_a, node_b = tmp_path / "node-a", tmp_path / "node-b"

    # 2. SIGTERM at the end of step 7: saved at that boundary, stopped, flushed.
    r2 = run(work, node_a, pfs, "--sigterm-at", "7")
    assert r2["preempted"] and r2["global_step"] == 7 and not r2["done"]
    warm = PosixTier("pfs", str(pfs))
    user, key = r2["user"], r2["key"]
    assert 7 in [i.step for i in warm.steps(user, key)]
    assert warm.verify(user, key, 7).ok  # verified on the PFS after the job
    assert warm.manifest(user, key, 7).meta["reason"] == "signal"
    first = batches(work)
    assert first == {s: ref_batches[s] for s in range(1, 8)}

    # 3. Another node: fetched from the PFS; killed inside the save of step 8.
    (work / "batches.0.jsonl").unlink()
    run(work, node_b, pfs, "--kill-in-save-at", "8", rc=-9)
    assert batches(work) == {8: ref_batches[8]}  # resumed at step 8: the data continued
    incomplete = work / "out" / "checkpoint-8"
    assert incomplete.is_dir() and not (incomplete / "trainer_state.json").exists()
    assert get_last_checkpoint(str(work / "out")) == str(incomplete)  # HF's own pick
    local_b = PosixTier("local", str(node_b))
    assert [i.step for i in local_b.steps(user, key)] == [7]  # fetched, nothing of 8

    # 4. Resumed on that node: step 7 from its local tier, never the incomplete 8.
    (work / "batches.0.jsonl").unlink()
    r4 = run(work, node_b, pfs)
    assert r4["resumed_step"] == 7 and r4["resumed_tier"] == "local" and r4["done"]
    assert Path(r4["resumed_from"]).is_relative_to(node_b)
    assert batches(work) == {s: ref_batches[s] for s in range(8, 13)}
    got = torch.load(work / "final.pt", weights_only=True)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert warm.verify(user, key, 12).ok


def test_local_tier_only_no_traceback_and_the_last_step_committed(tmp_path: Path) -> None:
    """The documented laptop mode (a local tier only) with the Trainer saving every 5
    steps of 12: no traceback at any save (before: an AssertionError from the pipeline's
    flush at every save), and the end of training commits step 12, which the Trainer's
    own schedule does not save."""
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    local = tmp_path / "local"
    p = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path / "job"), str(local), "-", "--save-steps", "5"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "Traceback" not in out and "AssertionError" not in out, out[-3000:]
    r = json.loads((tmp_path / "job" / "result.json").read_text())
    assert r["done"] and r["global_step"] == 12
    tier = PosixTier("local", str(local))
    steps = [i.step for i in tier.steps(r["user"], r["key"])]
    assert steps[-1] == 12, steps  # the final state, committed
    assert tier.verify(r["user"], r["key"], 12).ok
    assert tier.manifest(r["user"], r["key"], 12).meta["checkpoint"] == "checkpoint-12"


def torchrun(workdir: Path, local: Path, pfs: Path, *extra: str) -> List[Dict[str, Any]]:
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    p = subprocess.run(
        [*cmd, str(WORKER), str(workdir), str(local), str(pfs), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return [json.loads((workdir / f"result-{r}.json").read_text()) for r in (0, 1)]


def test_ddp_ranks_save_at_one_step_and_resume_agreed(tmp_path: Path) -> None:
    """Two DDP ranks (gloo, CPU): SIGTERM reaches rank 1 only, at step 2, mid-epoch (3
    steps an epoch): both ranks save step 2 and stop. Resumed on other nodes (empty local
    tiers) both take step 2 from the PFS, and the first epoch's samples over both ranks
    are every sample exactly once: no batch replayed or skipped by the resume."""
    work, pfs = tmp_path / "job", tmp_path / "pfs"
    first = torchrun(work, tmp_path / "a", pfs, "--sigterm-at", "2", "--sigterm-rank", "1")
    assert [(r["global_step"], r["preempted"]) for r in first] == [(2, True), (2, True)]
    warm = PosixTier("pfs", str(pfs))
    for r in first:
        assert [i.step for i in warm.steps(r["user"], r["key"])] == [2]
        assert warm.verify(r["user"], r["key"], 2).ok
    before = [batches(work, r) for r in (0, 1)]
    for r in (0, 1):
        (work / f"batches.{r}.jsonl").unlink()
    again = torchrun(work, tmp_path / "b", pfs)
    assert [(r["resumed_step"], r["resumed_tier"], r["done"]) for r in again] == [
        (2, "pfs", True),
        (2, "pfs", True),
    ]
    after = [batches(work, r) for r in (0, 1)]
    assert all(sorted(b) == [1, 2] for b in before) and all(
        sorted(a) == [3, 4, 5, 6] for a in after
    )
    epoch1 = [i for r in (0, 1) for s in (1, 2) for i in before[r][s]] + [
        i for r in (0, 1) for i in after[r][3]
    ]
    assert sorted(epoch1) == list(range(24))
    for r in again:
        assert warm.verify(r["user"], r["key"], 6).ok
