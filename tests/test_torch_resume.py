"""Exact resume of PyTorch training: capture/apply round trips, and a real training script
(examples/train_tiny.py) interrupted by SIGTERM and SIGKILL at random (seeded) points that
must end bitwise equal to an uninterrupted run.

Why bitwise: "close enough" hides real bugs (an RNG not restored, a scheduler one step
off, a data loader replaying a batch); with deterministic CPU kernels and one thread,
any such bug changes the final weights' digest.
"""

from __future__ import annotations

import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pytest
import torch  # noqa: E402  (a test dependency: installed by scripts/setup)

from slurm_ckpt import torch as sct  # noqa: E402
from slurm_ckpt import torch_codec as codec  # noqa: E402
from slurm_ckpt.job import state as st  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train_tiny.py"


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------
def through_format(state: Dict[str, Any]) -> Any:
    """Serialise with the job layer's pickle-free codec and read back from raw bytes."""
    index, leaves = st.flatten(state)
    st.layout(index)
    index = json.loads(st.index_bytes(index))  # the index really is plain JSON
    raw = [bytes(st.leaf_bytes(leaf.buffer)) for leaf in leaves]
    return st.unflatten(index, raw)


def make_objects(seed: int = 0) -> Tuple[Any, Any, Any, Any, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 12),
        torch.nn.BatchNorm1d(12),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(12, 3),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    sched = torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.2, total_iters=3),
            torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.97**e),
        ],
        milestones=[3],
    )
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)  # holds float('inf')
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    return model, opt, sched, plateau, scaler


def train_steps(model: Any, opt: Any, sched: Any, scaler: Any, n: int) -> List[float]:
    """Steps that draw from every global RNG (python, numpy, torch)."""
    losses = []
    for _ in range(n):
        x = torch.randn(8, 6) + float(np.random.rand()) + random.random()
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        losses.append(loss.item())
    return losses


# ------------------------------------------------------------------------------------------
# capture / apply (no processes)
# ------------------------------------------------------------------------------------------
def test_capture_apply_continues_bitwise_identically() -> None:
    model, opt, sched, plateau, scaler = make_objects()
    random.seed(1)
    np.random.seed(1)
    train_steps(model, opt, sched, scaler, 5)
    plateau.step(3.0)
    state = through_format(
        sct.capture(
            model,
            opt,
            sched,
            scaler,
            data_position={"epoch": 2, "index": 17, "tokens": 12345},
            extra={"plateau": plateau.state_dict()},
        )
    )
    ref_losses = train_steps(model, opt, sched, scaler, 6)
    ref_digest = sct.state_digest(model)

    # a fresh process would rebuild everything from scratch, then apply
    model2, opt2, sched2, plateau2, scaler2 = make_objects(seed=99)
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    pos = sct.apply(state, model2, opt2, sched2, scaler2)
    plateau2.load_state_dict(sct.decode(state["extra"])["plateau"])
    assert pos == {"epoch": 2, "index": 17, "tokens": 12345}
    assert plateau2.state_dict() == plateau.state_dict()
    assert train_steps(model2, opt2, sched2, scaler2, 6) == ref_losses
    assert sct.state_digest(model2) == ref_digest
    assert sched2.state_dict() == sched.state_dict()
    assert scaler2.state_dict() == scaler.state_dict()
    assert sct.state_digest(opt2.state_dict()["state"][0]) == sct.state_digest(
        opt.state_dict()["state"][0]
    )


def test_encoding_is_lossless_and_pickle_free() -> None:
    value = {
        "tuple": (1, 2.5, "x"),
        "inf": float("inf"),
        "ninf": -float("inf"),
        "ints": {3: torch.ones(2), 7: "seven"},
        "list_with_tensors": [torch.zeros(1), {"a": np.arange(3)}],
        "np_scalar": np.float32(0.1),
        "np_int": np.int64(5),
        "dtype": torch.bfloat16,
        "bytes": b"\x00\xff",
        "nested": {"deep": [[1, 2], (3,)]},
    }
    enc = sct.encode(value)

    # Only tensors/arrays/bytes, str-keyed dicts and JSON lists/scalars remain.
    def check(x: Any) -> None:
        if isinstance(x, dict):
            assert all(isinstance(k, str) for k in x)
            for v in x.values():
                check(v)
        elif isinstance(x, list):
            assert not codec.has_blob(x)
            json.dumps(x, allow_nan=False)
        else:
            assert isinstance(x, (torch.Tensor, np.ndarray, bytes, str, int, float, type(None)))
            if isinstance(x, float):
                assert np.isfinite(x)

    check(enc)
    back = sct.decode(through_format({"v": enc})["v"])
    assert back["tuple"] == (1, 2.5, "x") and isinstance(back["tuple"], tuple)
    assert back["inf"] == float("inf") and back["ninf"] == -float("inf")
    assert set(back["ints"]) == {3, 7} and torch.equal(back["ints"][3], torch.ones(2))
    assert torch.equal(back["list_with_tensors"][0], torch.zeros(1))
    assert np.array_equal(back["list_with_tensors"][1]["a"], np.arange(3))
    assert type(back["np_scalar"]) is np.float32 and back["np_scalar"] == np.float32(0.1)
    assert type(back["np_int"]) is np.int64 and back["np_int"] == 5
    assert back["dtype"] is torch.bfloat16
    assert back["bytes"] == b"\x00\xff"
    assert back["nested"] == {"deep": [[1, 2], (3,)]}


def test_optimizer_keys_are_strings_and_come_back_as_ints() -> None:
    model, opt, sched, _, scaler = make_objects()
    train_steps(model, opt, sched, scaler, 1)
    cap = sct.capture(optimizer=opt, rng=False)
    assert set(cap["optimizer"]["state"]) == {"0", "1", "2", "3", "4", "5"}
    json.dumps(sct.decode(cap["optimizer"]["param_groups"]))  # JSON (tuples -> lists)
    _, opt2, _, _, _ = make_objects()
    sct.apply(cap, optimizer=opt2)
    sd = opt2.state_dict()
    assert set(sd["state"]) == {0, 1, 2, 3, 4, 5}
    assert sd["param_groups"][0]["betas"] == (0.8, 0.95)


@pytest.mark.parametrize(
    "bad,where",
    [
        ({"fn": lambda: 1}, "extra.fn"),
        ({"obj": object()}, "extra.obj"),
        ({"deep": [1, {"m": print}]}, "extra.deep[1].m"),
    ],
)
def test_unpicklable_values_are_refused_clearly(bad: Dict[str, Any], where: str) -> None:
    with pytest.raises(sct.UnsupportedState) as err:
        sct.capture(extra=bad, rng=False)
    msg = str(err.value)
    assert where in msg and "pickle" in msg and "\n" not in msg


def test_scheduler_holding_a_callable_object_state_is_refused() -> None:
    class Decay:  # LambdaLR saves a callable *object*'s __dict__
        def __init__(self) -> None:
            self.rate = 0.9
            self.hook = lambda e: e

        def __call__(self, epoch: int) -> float:
            return self.rate**epoch

    _, opt, _, _, _ = make_objects()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, Decay())
    with pytest.raises(sct.UnsupportedState, match=r"scheduler\.lr_lambdas\[0\]\.hook"):
        sct.capture(scheduler=sched, rng=False)


def test_rng_states_restored_exactly() -> None:
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    random.gauss(0, 1)  # leaves a cached gauss_next
    np.random.standard_normal()  # and a cached numpy gaussian
    saved = through_format(sct.capture(rng=True))
    want = (random.random(), random.gauss(0, 1), np.random.standard_normal(), torch.rand(3))
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    sct.apply(saved)
    got = (random.random(), random.gauss(0, 1), np.random.standard_normal(), torch.rand(3))
    assert got[:3] == want[:3] and torch.equal(got[3], want[3])


def test_weights_first_then_rest() -> None:
    model, opt, sched, _, scaler = make_objects()
    train_steps(model, opt, sched, scaler, 3)
    state = through_format(sct.capture(model, opt, sched, rng=False))
    assert next(iter(state)) == "model"  # weights first in the tree
    weights = {"model": state["model"], "torch_format": state["torch_format"]}
    model2, opt2, sched2, _, _ = make_objects(seed=3)
    sct.apply_model(weights, model2)
    assert sct.state_digest(model2) == sct.state_digest(model)
    rest = {k: v for k, v in state.items() if k != "model"}
    sct.apply(rest, optimizer=opt2, scheduler=sched2)
    assert sched2.state_dict() == sched.state_dict()
    with pytest.raises(sct.UnsupportedState, match="no model weights"):
        sct.apply(rest, model=model2)


# ------------------------------------------------------------------------------------------
# the training script, interrupted (processes)
# ------------------------------------------------------------------------------------------
class TrainProc:
    """examples/train_tiny.py in a subprocess, its output read line by line.

    Tests wait for progress by reading the lines the script prints (never fixed sleeps),
    so they are as fast as the machine allows and do not flake when it is slow.
    """

    def __init__(self, args: List[str], cwd: Path, env: Optional[Dict[str, str]] = None):
        full_env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, str(TRAIN), *args],
            cwd=cwd,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: List[str] = []
        self._q: queue.Queue[Optional[str]] = queue.Queue()
        self._eof = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def _next(self, deadline: float) -> Optional[str]:
        if self._eof:
            return None
        try:
            line = self._q.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"timed out; output so far:\n{self.tail()}") from None
        if line is None:
            self._eof = True
            return None
        self.lines.append(line)
        return line

    def expect(self, pattern: str, timeout: float = 120.0) -> re.Match[str]:
        """The next line matching ``pattern`` (fails on exit or timeout)."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            line = self._next(deadline)
            if line is None:
                raise AssertionError(f"exited before /{pattern}/; output:\n{self.tail()}")
            m = rx.match(line)
            if m:
                return m

    def finish(self, timeout: float = 120.0) -> int:
        deadline = time.monotonic() + timeout
        while self._next(deadline) is not None:
            pass
        return self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def values(self, prefix: str) -> List[int]:
        """The step numbers of all lines ``PREFIX step=N`` / ``STEP N`` seen so far."""
        out = []
        for line in self.lines:
            if line.startswith(prefix + " "):
                m = re.search(r"(?:step=)?(\d+)", line[len(prefix) :])
                if m:
                    out.append(int(m.group(1)))
        return out

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.lines[-n:])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _without_tiers(args: List[str]) -> List[str]:
    """The same command line without --local/--pfs/--key (and their values)."""
    out: List[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a in ("--local", "--pfs", "--key"):
            skip = True
        else:
            out.append(a)
    return out


_RESUMED = (
    r"^(?:START fresh(?: reached=(?P<reached0>\d+) lost=(?P<lost0>\d+))?"
    r"|RESUMED step=(?P<step>\d+) reached=(?P<reached>\d+) lost=(?P<lost>\d+) tier=(?P<tier>\w+))"
)


def test_interrupted_training_is_bitwise_equal_to_uninterrupted(tmp_path: Path) -> None:
    """SIGTERM (preemption) and SIGKILL at seeded random points, restarted each time."""
    steps, interval = 120, 10
    common = ["--steps", str(steps), "--seed", "77", "--quiet-steps"]
    ref = TrainProc([*common, "--no-ckpt"], tmp_path)  # runs alongside (2 cores)
    args = [
        *[a for a in common if a != "--quiet-steps"],
        "--local", str(tmp_path / "local"),
        "--pfs", str(tmp_path / "pfs"),
        "--key", "tiny",
        "--interval-steps", str(interval),
        "--sleep-per-step", "0.01",
        "--digest-out", str(tmp_path / "digest"),
    ]  # fmt: skip
    (tmp_path / "local").mkdir()
    (tmp_path / "pfs").mkdir()
    rng = random.Random(20261129)
    plan = ["term", "kill", "kill-in-save", "term"]
    rng.shuffle(plan)
    expect: Optional[Dict[str, Any]] = None  # what the next start must show
    history = []
    # The last run finds its tiers as a job under srun does: site config + SLURM variables.
    config = tmp_path / "config.toml"
    config.write_text(
        f'[tiers.local]\nroot = "{tmp_path / "local"}"\nrequire_mount = false\nmin_free = 0\n'
        f'[tiers.pfs]\nkind = "posix"\nroot = "{tmp_path / "pfs"}"\n'
    )
    slurm_env = {
        "SLURM_CKPT_CONFIG": str(config),
        "SLURM_JOB_ID": "4242",
        "SLURM_PROCID": "0",
        "SLURM_STEP_NUM_TASKS": "1",
        "SLURM_RESTART_COUNT": str(len(plan)),
        "SLURM_CKPT_KEY": "tiny",  # as ckpt-srun exports them
        "SLURM_CKPT_SIGNAL": "USR2",
    }
    for i, kind in enumerate([*plan, "finish"]):
        if kind == "finish":
            run = TrainProc(_without_tiers(args), tmp_path, env=slurm_env)
        else:
            run = TrainProc(args + (["--weights-first"] if i % 2 else []), tmp_path)
        try:
            first = run.expect(_RESUMED)
            resumed = int(first.group("step") or 0)  # 0: a fresh start
            if expect is None:
                assert first.group(0) == "START fresh"
            else:
                # the side file may be one step ahead of the last STEP line (killed between)
                reached = int(first.group("reached") or first.group("reached0"))
                assert reached in (expect["reached"], expect["reached"] + 1), first.group(0)
                lost = int(first.group("lost") or first.group("lost0"))
                assert lost == reached - resumed
                if expect["kind"] == "term":  # a preemption loses nothing
                    assert resumed == expect["preempted"] and lost == 0, first.group(0)
                else:  # the newest committed checkpoint; the one being written may be lost
                    ok = {expect["committed"], expect["saved"]}
                    assert resumed in ok, (first.group(0), expect)
                    assert resumed >= expect["saved"] - interval
                    if expect["committed"] == expect["saved"]:
                        assert lost <= interval, (first.group(0), expect)
            history.append((kind, first.group(0)))
            if kind == "finish":
                done = run.expect(r"^DONE step=(\d+) digest=([0-9a-f]{64})$")
                assert run.finish() == 0
                break
            target = min(resumed + rng.randint(3, 2 * interval), steps - interval - 2)
            if kind == "kill-in-save":  # SIGKILL while the save's write is in flight
                run.expect(r"^SAVED step=\d+$")
                run.signal(signal.SIGKILL)
            else:
                run.expect(rf"^STEP {target} ")
                run.signal(signal.SIGTERM if kind == "term" else signal.SIGKILL)
            rc = run.finish()
            saved, committed = run.values("SAVED"), run.values("COMMITTED")
            expect = {
                "kind": "term" if kind == "term" else "kill",
                "reached": max(run.values("STEP")),
                "saved": max(saved, default=resumed),
                "committed": max(committed, default=resumed),
            }
            if kind == "term":
                assert rc == 0, f"a preempted run must exit 0 (requeue); got {rc}\n{run.tail()}"
                pre_steps = run.values("PREEMPTED")
                assert len(pre_steps) == 1 and pre_steps[0] >= target, run.tail()
                assert pre_steps[0] == expect["reached"] == expect["saved"]
                expect["preempted"] = pre_steps[0]
            else:
                assert rc == -signal.SIGKILL
        finally:
            run.close()
    ref_done = ref.expect(r"^DONE step=(\d+) digest=([0-9a-f]{64})$")
    assert ref.finish() == 0
    assert done.group(1) == ref_done.group(1) == str(steps)
    assert done.group(2) == ref_done.group(2), f"weights differ after restarts: {history}"
    assert (tmp_path / "digest").read_text().strip() == ref_done.group(2)
    assert len(history) == len(plan) + 1


# ------------------------------------------------------------------------------------------
# corrupt or partial checkpoints are never restored (real torch state, in process)
# ------------------------------------------------------------------------------------------
def _blob(tier_root: Path, step: int, group: str) -> Path:
    """The weights blob (data-0000.bin) or the first optimizer-state blob of a step."""
    d = tier_root / _user() / "tiny" / f"step-{step:010d}" / "rank-00000"
    index = json.loads((d / "index.json").read_text())
    name = next(b["name"] for b in index["blobs"] if b["group"] == group)
    return d / name


def _user() -> str:
    import getpass

    return getpass.getuser()


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x01]))


def test_corrupt_or_partial_checkpoints_are_never_restored(tmp_path: Path) -> None:
    from slurm_ckpt import Checkpointer

    local, pfs = tmp_path / "local", tmp_path / "pfs"
    local.mkdir()
    pfs.mkdir()

    def checkpointer() -> Any:
        return Checkpointer(
            local=local, warm=pfs, key="tiny", interval_steps=10, install_signals=False
        )

    model, opt, sched, _, scaler = make_objects()
    digests: Dict[int, str] = {}
    ckpt = checkpointer()
    for step in (10, 20):
        train_steps(model, opt, sched, scaler, 10)
        sct.save(ckpt, model, opt, sched, scaler, step=step, data_position={"index": step})
        ckpt.wait()  # local commit and PFS flush
        digests[step] = sct.state_digest(model)
    ckpt.close()

    def restore(weights_first: bool = False) -> Tuple[Any, Any]:
        m, o, s, _, sc = make_objects(seed=5)
        c = checkpointer()
        try:
            got = sct.restore(c, m, o, s, sc, weights_first=weights_first)
        finally:
            c.close()
        return got, m

    got, m = restore()
    assert (got.step, got.tier, got.data_position) == (20, "local", {"index": 20})
    assert sct.state_digest(m) == digests[20]

    # one flipped bit in the local weights: the same step comes from the PFS copy
    _flip(_blob(local, 20, "weights"), 100)
    got, m = restore()
    assert (got.step, got.tier) == (20, "pfs") and sct.state_digest(m) == digests[20]

    # weights-first: step 20's weights (PFS copy) are loaded first; its rest is then
    # corrupt on both tiers, so the whole state rolls back to step 10, weights reloaded
    _flip(_blob(pfs, 20, "rest"), 7)
    got, m = restore(weights_first=True)
    assert (got.step, got.tier) == (10, "local") and sct.state_digest(m) == digests[10]

    # the PFS copy whose bytes did not match its manifest was uncommitted (manifest first),
    # so no later restore or retention counts it; the local copy stays for the node's owner
    pfs_step = pfs / _user() / "tiny" / f"step-{20:010d}"
    assert not (pfs_step / "manifest.json").exists()
    assert (local / _user() / "tiny" / f"step-{20:010d}" / "manifest.json").exists()

    # truncated where it is left: the previous step
    blob = _blob(local, 20, "weights")
    os.truncate(blob, blob.stat().st_size - 1)
    got, m = restore()
    assert got.step == 10 and sct.state_digest(m) == digests[10]

    # a partial newer checkpoint (a writer killed before its manifest) is not a checkpoint
    import shutil

    src = local / _user() / "tiny" / f"step-{10:010d}"
    part = local / _user() / "tiny" / f"step-{30:010d}"
    shutil.copytree(src, part)
    (part / "manifest.json").unlink()
    tmp = local / _user() / "tiny" / f".tmp-step-{40:010d}-1-abcd"
    shutil.copytree(src, tmp)
    got, m = restore()
    assert got.step == 10 and sct.state_digest(m) == digests[10]
