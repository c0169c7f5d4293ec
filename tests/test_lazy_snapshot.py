"""The lazy snapshot (job/lazy.py): save() returns before the big tensors are copied.

What is proven, without timing: the background copy is held on a gate the test opens, so
the optimizer step, the scheduler step, the GradScaler update and in-place writes
provably happen *while* the copy is pending; the checkpoint must still hold exactly the
values at save() time (every tensor torch.equal to a deep copy taken then), or be
refused when a write bypassed the guarded paths.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any, Dict, Tuple

import pytest
import torch
from test_torch_distributed import free_port

from slurm_ckpt import Checkpointer
from slurm_ckpt import torch as sct

REPO = Path(__file__).resolve().parents[1]
WAIT = 60.0


def make_ckpt(tmp_path: Path, **kw: Any) -> Checkpointer:
    for d in ("local", "pfs"):
        os.makedirs(tmp_path / d, exist_ok=True)
    kw.setdefault("install_signals", False)
    kw.setdefault("end_time_fn", None)
    return Checkpointer(local=tmp_path / "local", warm=tmp_path / "pfs", key="lazy", **kw)


def objects(seed: int = 0) -> Tuple[Any, Any, Any, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256),  # 64 KiB of weight: deferred
        torch.nn.BatchNorm1d(256),  # running stats change in forward: copied eagerly
        torch.nn.ReLU(),
        torch.nn.Linear(256, 128),  # 128 KiB: deferred
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    return model, opt, sched, scaler


def step(model: Any, opt: Any, sched: Any, scaler: Any) -> None:
    loss = model(torch.randn(16, 64)).pow(2).mean()
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    sched.step()


class Gate:
    """Holds the deferred half of a snapshot until opened (wraps StagingArea.snapshot)."""

    def __init__(self, ckpt: Checkpointer) -> None:
        self.opened = threading.Event()
        self.entered = threading.Event()
        self._orig = ckpt._staging.snapshot

        def snapshot(index: Any, tensors: Any, select: Any = None) -> Any:
            if select is not None and threading.current_thread().name == "ckpt-drain":
                self.entered.set()
                assert self.opened.wait(WAIT), "test gate never opened"
            return self._orig(index, tensors, select)

        ckpt._staging.snapshot = snapshot  # type: ignore[method-assign]


def expected_state(model: Any, opt: Any, sched: Any, scaler: Any) -> Dict[str, Any]:
    return copy.deepcopy(
        {
            "model": model.state_dict(),
            "opt": opt.state_dict(),
            "sched": sched.state_dict(),
            "scaler": scaler.state_dict(),
        }
    )


def assert_same(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def restored_state(tmp_path: Path, step_no: int) -> Dict[str, Any]:
    model, opt, sched, scaler = objects(seed=99)  # different values everywhere
    ck = make_ckpt(tmp_path)
    got = sct.restore(ck, model, opt, sched, scaler)
    ck.close()
    assert got is not None and got.step == step_no
    return expected_state(model, opt, sched, scaler)


def test_optimizer_step_waits_and_the_checkpoint_holds_the_values_at_save(tmp_path):
    model, opt, sched, scaler = objects()
    for _ in range(3):
        step(model, opt, sched, scaler)
    ck = make_ckpt(tmp_path)
    tc = sct.TorchCheckpointer(ck, model, opt, sched, scaler)
    gate = Gate(ck)
    want = expected_state(model, opt, sched, scaler)
    rec = tc.save(step=3)
    assert rec.deferred_bytes >= 64 * 1024 * 4
    assert gate.entered.wait(WAIT)
    # Forward, backward and the scheduler/scaler go on while the copy is held ...
    loss = model(torch.randn(16, 64)).pow(2).mean()
    opt.zero_grad()
    scaler.scale(loss).backward()
    # ... and the optimizer step waits for it (its pre-hook).
    stepper = threading.Thread(target=lambda: (scaler.step(opt), scaler.update(), sched.step()))
    stepper.start()
    stepper.join(0.3)
    assert stepper.is_alive(), "optimizer.step() ran while the snapshot was still pending"
    for name, p in model.named_parameters():  # no parameter written yet
        assert torch.equal(want["model"][name], p.detach()), name
    gate.opened.set()
    stepper.join(WAIT)
    assert not stepper.is_alive()
    assert not torch.equal(want["model"]["0.weight"], model.state_dict()["0.weight"])
    assert ck.stats.snapshot_waits >= 1 and ck.stats.snapshot_wait_s > 0
    tc.close()
    assert ck.stats.committed == 1 and ck.stats.failures == 0
    assert_same(want, restored_state(tmp_path, 3))


def test_optimizer_step_at_once_after_save_every_tensor_equal(tmp_path):
    """The issue's exactness check: save, step at once, compare with a deep copy."""
    model, opt, sched, scaler = objects(1)
    ck = make_ckpt(tmp_path)
    tc = sct.TorchCheckpointer(ck, model, opt, sched, scaler)
    for s in range(6):
        step(model, opt, sched, scaler)
        if s in (2, 5):
            want = expected_state(model, opt, sched, scaler)
            tc.save(step=s)
            step(model, opt, sched, scaler)  # at once: the pre-hook orders it after the copy
    tc.close()
    assert ck.stats.committed == 2
    assert_same(want, restored_state(tmp_path, 5))


def test_in_place_write_outside_the_guard_refuses_the_checkpoint(tmp_path):
    model, opt, sched, scaler = objects(2)
    step(model, opt, sched, scaler)
    ck = make_ckpt(tmp_path)
    tc = sct.TorchCheckpointer(ck, model, opt, sched, scaler)
    tc.save(step=1)
    ck.wait(flush=False)
    gate = Gate(ck)
    tc.save(step=2)
    assert gate.entered.wait(WAIT)
    with torch.no_grad():
        model[0].weight.add_(1.0)  # seen by the version counter
    gate.opened.set()
    ck.wait(flush=False)
    s = ck.stats
    assert s.failures == 1 and s.committed == 1
    assert "written in place" in (s.last_error or "")
    tc.close()
    # Step 2 was never committed: the newest checkpoint is still step 1.
    assert restored_state(tmp_path, 1)


def test_wait_snapshot_makes_a_manual_write_safe(tmp_path):
    model, opt, sched, scaler = objects(3)
    step(model, opt, sched, scaler)
    ck = make_ckpt(tmp_path)
    tc = sct.TorchCheckpointer(ck, model, opt, sched, scaler)
    want = expected_state(model, opt, sched, scaler)
    tc.save(step=1)
    tc.wait_snapshot()
    with torch.no_grad():
        model[0].weight.data.copy_(torch.zeros_like(model[0].weight))
    tc.close()
    assert ck.stats.failures == 0
    assert_same(want, restored_state(tmp_path, 1))


def test_load_state_dict_waits_for_the_copy(tmp_path):
    model, opt, sched, scaler = objects(4)
    step(model, opt, sched, scaler)
    ck = make_ckpt(tmp_path)
    tc = sct.TorchCheckpointer(ck, model, opt, sched, scaler)
    gate = Gate(ck)
    want = expected_state(model, opt, sched, scaler)
    tc.save(step=1)
    assert gate.entered.wait(WAIT)
    other, _, _, _ = objects(5)
    loader = threading.Thread(target=lambda: model.load_state_dict(other.state_dict()))
    loader.start()
    loader.join(0.3)
    assert loader.is_alive(), "load_state_dict ran while the snapshot was pending"
    gate.opened.set()
    loader.join(WAIT)
    tc.close()
    assert ck.stats.failures == 0
    assert_same(want, restored_state(tmp_path, 1))


def test_without_an_optimizer_the_snapshot_stays_eager(tmp_path):
    model, _, _, _ = objects(6)
    ck = make_ckpt(tmp_path)
    tc = sct.TorchCheckpointer(ck, model)
    assert tc.lazy is False
    rec = tc.save(step=0)
    assert rec.deferred_bytes == 0
    with pytest.raises(ValueError):
        sct.TorchCheckpointer(ck, model, lazy=True)
    tc.close()


KILLED = textwrap.dedent(
    """
    import os, sys, threading
    sys.path.insert(0, {repo!r})
    import torch
    from slurm_ckpt import Checkpointer
    from slurm_ckpt import torch as sct
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ck = Checkpointer(local={local!r}, warm={pfs!r}, key="lazy", install_signals=False,
                      end_time_fn=None)
    tc = sct.TorchCheckpointer(ck, model, opt)
    model(torch.randn(4, 256)).sum().backward(); opt.step()
    tc.save(step=1); ck.wait()
    orig = ck._staging.snapshot
    def held(index, tensors, select=None):
        if select is not None and threading.current_thread().name == "ckpt-drain":
            print("DRAINING", flush=True)
            threading.Event().wait()
        return orig(index, tensors, select)
    ck._staging.snapshot = held
    tc.save(step=2)
    threading.Event().wait()
    """
)


def test_sigkill_during_the_drain_leaves_nothing_committed(tmp_path):
    for d in ("local", "pfs"):
        os.makedirs(tmp_path / d)
    script = KILLED.format(repo=str(REPO), local=str(tmp_path / "local"), pfs=str(tmp_path / "pfs"))
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "DRAINING"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(WAIT)
    ck = make_ckpt(tmp_path)
    got = ck.restore()
    ck.close()
    assert got is not None and got.step == 1


# ------------------------------------------------------------ composing with the rest
class Events:
    """The Checkpointer's event hook: records names and lets a test wait for one."""

    def __init__(self) -> None:
        self.names: list = []
        self._cv = threading.Condition()

    def __call__(self, name: str, info: Dict[str, Any]) -> None:
        with self._cv:
            self.names.append(name)
            self._cv.notify_all()

    def wait_for(self, name: str) -> None:
        with self._cv:
            assert self._cv.wait_for(lambda: name in self.names, WAIT), name


def test_close_with_the_copy_pending_commits_the_values_at_save(tmp_path):
    """close() right after save(): it waits for the background copy, then commits the
    values of save() time, although the optimizer stepped in between."""
    model, opt, sched, scaler = objects(7)
    step(model, opt, sched, scaler)
    ck = make_ckpt(tmp_path)
    tc = sct.TorchCheckpointer(ck, model, opt, sched, scaler)
    gate = Gate(ck)
    want = expected_state(model, opt, sched, scaler)
    assert tc.save(step=1).deferred_bytes > 0
    assert gate.entered.wait(WAIT)
    stepper = threading.Thread(target=step, args=(model, opt, sched, scaler))
    stepper.start()
    closer = threading.Thread(target=tc.close)
    closer.start()
    gate.opened.set()
    stepper.join(WAIT)
    closer.join(WAIT)
    assert not stepper.is_alive() and not closer.is_alive()
    assert ck.stats.committed == 1 and ck.stats.failures == 0
    assert_same(want, restored_state(tmp_path, 1))


def test_signal_save_at_the_step_boundary_is_lazy_and_exact(tmp_path):
    """SIGTERM mid-loop: should_save() says so at the next boundary, the save is a
    preemption save with a deferred copy, the optimizer steps at once, and the
    checkpoint (flushed to the warm tier at close) holds the values of save() time."""
    model, opt, sched, scaler = objects(8)
    ck = make_ckpt(tmp_path, install_signals=True, interval_steps=1000)
    tc = sct.TorchCheckpointer(ck, model, opt, sched, scaler)
    want, at = None, -1
    try:
        for s in range(20):
            step(model, opt, sched, scaler)
            if s == 4:
                os.kill(os.getpid(), signal.SIGTERM)  # handled: sets the flag only
            if tc.should_save(step=s):
                want, at = expected_state(model, opt, sched, scaler), s
                assert tc.save(step=s).deferred_bytes > 0
                step(model, opt, sched, scaler)  # at once: waits for the copy
                break
    finally:
        stats = tc.close()
    assert want is not None and at == 4
    assert tc.preempted and stats.committed == 1 and stats.failures == 0
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers put back
    warm = make_ckpt(tmp_path)
    got = warm.restore(tiers=["pfs"])  # the preemption save was flushed at close
    warm.close()
    assert got is not None and got.step == 4
    assert_same(want, restored_state(tmp_path, 4))


def test_a_save_while_the_copy_drains_waits_and_is_reported_never_skipped(tmp_path):
    """The copy cannot keep up (held by the gate): the next save waits for it, says so
    (a backpressure event and the stats' wait time), and both checkpoints commit."""
    model, opt, sched, scaler = objects(9)
    step(model, opt, sched, scaler)
    ev = Events()
    ck = make_ckpt(tmp_path, on_event=ev)
    tc = sct.TorchCheckpointer(ck, model, opt, sched, scaler)
    gate = Gate(ck)
    tc.save(step=1)
    assert gate.entered.wait(WAIT)
    want: Dict[str, Any] = {}

    def second() -> None:
        want["s"] = expected_state(model, opt, sched, scaler)  # no step in between
        tc.save(step=2)

    t = threading.Thread(target=second)
    t.start()
    ev.wait_for("backpressure_wait")
    assert "snapshot_start" not in ev.names[ev.names.index("backpressure_wait") :]
    gate.opened.set()
    t.join(WAIT)
    assert not t.is_alive()
    stats = tc.close()
    assert stats.committed == 2 and stats.failures == 0 and stats.wait_s > 0
    assert_same(want["s"], restored_state(tmp_path, 2))


def test_a_state_over_the_staging_limit_is_written_synchronously_and_exact(tmp_path):
    """Memory stays bounded: a state larger than the staging limit is not deferred into
    unbounded buffers; it is written synchronously (a logged warning), still exact."""
    model, opt, sched, scaler = objects(10)
    step(model, opt, sched, scaler)
    ck = make_ckpt(tmp_path, staging_memory_limit=64 * 1024)
    tc = sct.TorchCheckpointer(ck, model, opt, sched, scaler)
    want = expected_state(model, opt, sched, scaler)
    saved = tc.save(step=1)
    assert saved.synchronous and saved.deferred_bytes == 0
    step(model, opt, sched, scaler)
    tc.close()
    assert_same(want, restored_state(tmp_path, 1))


RANK_SCRIPT = textwrap.dedent(
    """
    import copy, os, sys
    from pathlib import Path
    import torch
    import torch.distributed as dist
    sys.path.insert(0, sys.argv[2])
    from test_lazy_snapshot import assert_same
    from slurm_ckpt import Checkpointer
    from slurm_ckpt import torch as sct

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    tmp = Path(sys.argv[1])

    def ckpt():
        local = tmp / f"n{rank}" / "local"
        local.mkdir(parents=True, exist_ok=True)
        return Checkpointer(local=local, warm=tmp / "pfs", key="lazy2", rank=rank,
                            world_size=world, install_signals=False, end_time_fn=None)

    def objects(seed):
        torch.manual_seed(seed)  # every rank its own values: each saves its own copy
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                    torch.nn.Linear(256, 128))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(model, opt):
        loss = model(torch.randn(16, 64)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():  # a collective while the copy may still drain
            dist.all_reduce(p.grad)
        opt.step()

    model, opt = objects(rank)
    tc = sct.TorchCheckpointer(ckpt(), model, opt, rng=False)
    assert tc.lazy
    for s in range(5):
        step(model, opt)
        if s == 3:
            want = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
            saved = tc.save(step=s)
            assert saved.deferred_bytes > 0
            step(model, opt)  # at once: the pre-hook orders it after this rank's copy
    tc.close()
    model2, opt2 = objects(100 + rank)  # different values everywhere
    ck = ckpt()
    got = sct.restore(ck, model2, opt2, rng=False)
    ck.close()
    assert got is not None and got.step == 3, got
    assert_same(want, {"model": model2.state_dict(), "opt": opt2.state_dict()})
    mine = torch.cat([p.detach().flatten() for p in model2.parameters()])
    all_ = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(all_, mine)
    assert not torch.equal(all_[0], all_[1]), "the ranks restored the same values"
    dist.destroy_process_group()
    print("OK", rank, flush=True)
    """
)


def test_two_ranks_each_checkpoint_their_own_values_at_save(tmp_path):
    """Several ranks (gloo, two processes): each rank's lazy copy is its own. Each saves
    the same step, steps at once (an all-reduce per gradient while its copy drains), and
    restores exactly its own values at save() time, not the other rank's."""
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            GLOO_SOCKET_IFNAME="lo",
            PYTHONPATH=str(REPO),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", RANK_SCRIPT, str(tmp_path), str(REPO / "tests")],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = [p.communicate(timeout=180)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"OK {rank}" in out, out
