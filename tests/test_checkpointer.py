"""The Checkpointer: two-phase saves, backpressure, flush policies, failures, intervals.

Ordering is proven with events (a background phase blocked on a gate), never by timing.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pytest
import torch  # noqa: E402  (a test dependency: installed by scripts/setup)

from slurm_ckpt import Checkpointer  # noqa: E402
from slurm_ckpt.errors import ConfigError  # noqa: E402
from slurm_ckpt.job import CheckpointFailed  # noqa: E402
from slurm_ckpt.job.checkpointer import DEFAULT_INTERVAL_TOKENS  # noqa: E402
from slurm_ckpt.ledger import State  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WAIT = 60.0  # generous bound for "eventually", never a timing assertion


class Events:
    """Records (name, step) from ``on_event`` and can hold one phase on a gate."""

    def __init__(self, gate_on: Optional[Tuple[str, int]] = None) -> None:
        self.log: List[Tuple[str, Any]] = []
        self.lock = threading.Lock()
        self.gate = threading.Event()
        self.gate_on = gate_on
        self.seen: Dict[Tuple[str, Any], threading.Event] = {}

    def _flag(self, name: str, step: Any) -> threading.Event:
        with self.lock:
            return self.seen.setdefault((name, step), threading.Event())

    def __call__(self, name: str, info: Dict[str, Any]) -> None:
        step = info.get("step")
        with self.lock:
            self.log.append((name, step))
        self._flag(name, step).set()
        if self.gate_on == (name, step):
            assert self.gate.wait(WAIT), "test gate never opened"

    def wait_for(self, name: str, step: Any) -> None:
        assert self._flag(name, step).wait(WAIT), f"event {name} {step} never came"

    def index(self, name: str, step: Any) -> int:
        with self.lock:
            return self.log.index((name, step))

    def names(self) -> List[Tuple[str, Any]]:
        with self.lock:
            return list(self.log)


def make(tmp_path: Path, **kw: Any) -> Checkpointer:
    local = kw.pop("local", tmp_path / "local")
    pfs = kw.pop("pfs", tmp_path / "pfs")
    os.makedirs(local, exist_ok=True)
    os.makedirs(pfs, exist_ok=True)
    kw.setdefault("install_signals", False)
    kw.setdefault("end_time_fn", None)
    return Checkpointer(local=local, warm=pfs, key=kw.pop("key", "run"), **kw)


def sample_state(seed: int = 0) -> Dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(64, 32, generator=g).to(torch.bfloat16), "b": torch.zeros(32)},
        "optimizer": {"m": torch.randn(64, 32, generator=g), "step": 3},
        "rng": np.random.default_rng(seed).integers(0, 255, 16, dtype=np.uint8),
        "loader": {"epoch": 1, "offset": 1234, "files": ["a", "b"]},
        "blob": b"opaque",
    }


def assert_state_equal(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_state_equal(a[k], b[k])
    else:
        assert a == b


def clone(state: Dict[str, Any]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out[k] = clone(v)
        elif isinstance(v, torch.Tensor):
            out[k] = v.clone()
        elif isinstance(v, np.ndarray):
            out[k] = v.copy()
        else:
            out[k] = v
    return out


def steps(ckpt: Checkpointer, tier: str) -> List[int]:
    t = ckpt.local if tier == "local" else ckpt.warm
    return [s.step for s in t.steps(ckpt.user, ckpt.shard_key)]


# ------------------------------------------------------------------ basics


def test_save_then_restore_in_a_new_process_object(tmp_path: Path, caplog: Any) -> None:
    caplog.set_level(logging.INFO, logger="slurm_ckpt")
    ckpt = make(tmp_path)
    assert ckpt.restore() is None
    state = sample_state()
    rec = ckpt.save(state, step=10, tokens=5000)
    assert rec.step == 10
    stats = ckpt.close()
    assert (stats.saves, stats.committed, stats.flushes, stats.failures) == (1, 1, 1, 0)
    assert steps(ckpt, "local") == [10] and steps(ckpt, "pfs") == [10]
    assert ckpt.warm.verify(ckpt.user, "run", 10).ok
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[ckpt] step=")]
    assert len(lines) == 1
    assert "step=10 snapshot=" in lines[0] and " local=" in lines[0] and " flush=" in lines[0]
    rec10 = ckpt.ledger.get(ckpt.user, "run", 10)
    assert rec10.state("local") is State.COMMITTED and rec10.state("pfs") is State.VERIFIED
    assert {"snapshot_s", "local_s", "flush_s"} <= set(rec10.durations)

    again = make(tmp_path)
    got = again.restore()
    assert (got.step, got.tokens, got.tier) == (10, 5000, "local")
    assert_state_equal(state, got.state)
    again.close()


def test_mutating_the_state_after_save_does_not_change_the_checkpoint(tmp_path: Path) -> None:
    ev = Events(gate_on=("local_start", 1))
    ckpt = make(tmp_path, on_event=ev)
    state = sample_state()
    original = clone(state)
    ckpt.save(state, step=1)
    # The write has not even started: scribble over everything the state holds.
    state["model"]["w"].fill_(7)
    state["model"]["b"].add_(1)
    state["optimizer"]["m"].mul_(-1)
    state["rng"][:] = 0
    state["loader"]["offset"] = 0
    ev.gate.set()
    ckpt.close()
    got = make(tmp_path).restore()
    assert_state_equal(original, got.state)


def test_save_returns_after_the_snapshot_not_after_the_write(tmp_path: Path) -> None:
    ev = Events(gate_on=("local_start", 1))
    ckpt = make(tmp_path, on_event=ev)
    rec = ckpt.save(sample_state(), step=1)
    # save() returned while the local write is held at its start: nothing committed yet.
    assert ("snapshot_done", 1) in ev.names()
    assert ("local_done", 1) not in ev.names()
    assert steps(ckpt, "local") == [] and ckpt.stats.committed == 0 and rec.step == 1
    ev.gate.set()
    assert ckpt.wait()
    assert steps(ckpt, "local") == [1] and ckpt.stats.committed == 1
    ckpt.close()


def test_flush_runs_after_save_returns_on_a_slow_pfs(tmp_path: Path) -> None:
    # A bandwidth cap makes the flush slow; the order is still proven by events.
    ev = Events(gate_on=("flush_start", 1))
    ckpt = make(tmp_path, on_event=ev, warm_bandwidth="20MB/s")
    ckpt.save({"model": {"w": torch.ones(256, 1024)}}, step=1)
    ev.wait_for("flush_start", 1)
    assert ckpt.wait(flush=False)
    assert steps(ckpt, "local") == [1] and steps(ckpt, "pfs") == []
    ev.gate.set()
    ckpt.close()
    assert steps(ckpt, "pfs") == [1]


def test_backpressure_second_save_waits_for_first_local_write(tmp_path: Path) -> None:
    ev = Events(gate_on=("local_start", 1))
    ckpt = make(tmp_path, on_event=ev)
    ckpt.save(sample_state(1), step=1)
    errors: List[BaseException] = []

    def second() -> None:
        try:
            ckpt.save(sample_state(2), step=2)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=second)
    t.start()
    ev.wait_for("backpressure_wait", 2)
    # The first write is still held: the second snapshot cannot have started.
    assert ("snapshot_start", 2) not in ev.names()
    ev.gate.set()
    t.join(WAIT)
    assert not t.is_alive() and not errors
    assert ev.index("local_done", 1) < ev.index("snapshot_start", 2)
    stats = ckpt.close()
    assert stats.wait_s > 0 and stats.stall_s >= stats.wait_s
    assert steps(ckpt, "local") == [1, 2]


def test_flush_policy_skip_drops_the_intermediate_checkpoint(tmp_path: Path) -> None:
    ev = Events(gate_on=("flush_start", 1))
    ckpt = make(tmp_path, on_event=ev, keep_local=3)
    ckpt.save(sample_state(1), step=1)
    ev.wait_for("flush_start", 1)  # the flush of step 1 is in progress (held)
    ckpt.save(sample_state(2), step=2)
    ckpt.save(sample_state(3), step=3)
    assert ckpt.wait(flush=False)
    ev.wait_for("flush_skipped", 2)
    ev.gate.set()
    stats = ckpt.close()
    assert steps(ckpt, "pfs") == [1, 3]
    assert stats.flush_skipped == 1 and stats.flushes == 2
    rec2 = ckpt.ledger.get(ckpt.user, "run", 2)
    assert rec2.selected_for_flush is False and rec2.state("pfs") is None
    assert "skipped" in rec2.extra.get("flush_note", "")


def test_flush_policy_wait_flushes_everything(tmp_path: Path) -> None:
    ev = Events(gate_on=("flush_start", 1))
    ckpt = make(tmp_path, on_event=ev, flush_policy="wait", keep_local=3)
    ckpt.save(sample_state(1), step=1)
    ev.wait_for("flush_start", 1)
    t = threading.Thread(target=ckpt.save, args=(sample_state(2),), kwargs={"step": 2})
    t.start()
    ev.wait_for("flush_wait", 2)
    assert ("snapshot_start", 2) not in ev.names()
    ev.gate.set()
    t.join(WAIT)
    assert ev.index("flush_done", 1) < ev.index("snapshot_start", 2)
    stats = ckpt.close()
    assert steps(ckpt, "pfs") == [1, 2] and stats.flush_skipped == 0


def test_flush_every_and_newest_always_flushed_at_close(tmp_path: Path) -> None:
    ckpt = make(tmp_path, flush_every=3, keep_local=1)
    for step in range(1, 6):  # seq 0..4: seq 0 and 3 selected, seq 4 is the newest
        ckpt.save(sample_state(step), step=step)
        assert ckpt.wait()
    assert steps(ckpt, "pfs") == [1, 4]
    ckpt.close()
    assert steps(ckpt, "pfs") == [1, 4, 5]
    # Local retention: keep_local=1, nothing protected any more -> only the newest.
    assert steps(ckpt, "local") == [5]
    assert ckpt.ledger.get(ckpt.user, "run", 2).state("local") is State.DELETED


def test_local_retention_never_deletes_an_unflushed_selected_checkpoint(tmp_path: Path) -> None:
    ev = Events(gate_on=("flush_start", 1))
    ckpt = make(tmp_path, on_event=ev, keep_local=1, flush_policy="skip")
    ckpt.save(sample_state(1), step=1)
    ev.wait_for("flush_start", 1)
    ckpt.save(sample_state(2), step=2)
    assert ckpt.wait(flush=False)
    # keep_local=1, but step 1 is being flushed and step 2 waits for its flush.
    assert steps(ckpt, "local") == [1, 2]
    ev.gate.set()
    ckpt.close()
    assert steps(ckpt, "pfs") == [1, 2] and steps(ckpt, "local") == [2]


def test_sync_write_when_staging_memory_is_short(tmp_path: Path, caplog: Any) -> None:
    caplog.set_level(logging.INFO, logger="slurm_ckpt")
    ckpt = make(tmp_path, staging_memory_limit=1)
    state = sample_state()
    rec = ckpt.save(state, step=7)
    # Synchronous: committed before save() returned.
    assert rec.synchronous and ckpt.stats.committed == 1
    assert steps(ckpt, "local") == [7]
    assert "writing synchronously" in caplog.text
    stats = ckpt.close()
    assert stats.sync_writes == 1
    assert_state_equal(state, make(tmp_path).restore().state)


def test_save_refuses_unserialisable_state_at_once(tmp_path: Path) -> None:
    ckpt = make(tmp_path)
    with pytest.raises(TypeError, match="/opt/fn"):
        ckpt.save({"opt": {"fn": print}}, step=1)
    ckpt.close()


# ------------------------------------------------------------------ failures


def test_full_local_tier_never_stops_training_until_too_many_failures(
    tmp_path: Path, mounts: Any
) -> None:
    local = mounts.tmpfs("2m")
    filler = local / "filler"

    def fill(name: str, info: Dict[str, Any]) -> None:
        # Make the third save hit a real ENOSPC mid-write (the space check passed).
        if name == "local_start" and info["step"] == 3:
            free = os.statvfs(local).f_bavail * os.statvfs(local).f_frsize
            with open(filler, "wb") as fh:
                fh.write(b"\0" * max(0, free - 64 * 1024))

    ckpt = make(tmp_path, local=local, on_event=fill, max_consecutive_failures=3)
    small = {"model": {"w": torch.ones(1000)}}
    ckpt.save(small, step=1)
    assert ckpt.wait()
    big = {"model": {"w": torch.ones(3 * 2**20 // 4)}}  # 3 MiB > 2 MiB tmpfs
    ckpt.should_save(step=2)  # training code keeps asking: no exception
    ckpt.save(big, step=2)  # fails in the background: "not enough space"
    assert ckpt.wait()
    s = ckpt.stats
    assert (s.failures, s.consecutive_failures, s.committed) == (1, 1, 1)
    assert "not enough space" in s.last_error
    rec2 = ckpt.ledger.get(ckpt.user, "run", 2)
    assert rec2.state("local") is State.FAILED and "not enough space" in rec2.error

    medium = {"model": {"w": torch.ones(2**18)}}  # 1 MiB: passes the check, then ENOSPC
    ckpt.save(medium, step=3)
    assert ckpt.wait()
    filler.unlink()
    s = ckpt.stats
    assert (s.failures, s.consecutive_failures) == (2, 2)
    assert "no space left on device" in s.last_error
    assert ckpt.ledger.get(ckpt.user, "run", 3).state("local") is State.FAILED
    assert ckpt.ledger.failures().get("local_write_failed") == 2

    ckpt.save(big, step=4)  # third failure in a row
    assert ckpt.wait()
    with pytest.raises(CheckpointFailed, match="3 checkpoints failed in a row"):
        ckpt.should_save(step=5)
    with pytest.raises(CheckpointFailed):
        ckpt.save(small, step=5)
    ckpt.close()
    # The previous good checkpoint is intact and restorable; no debris left behind.
    assert steps(ckpt, "local") == [1]
    assert ckpt.local.verify(ckpt.user, "run", 1).ok
    assert [n for n in os.listdir(local / ckpt.user / "run") if n.startswith(".tmp")] == []
    got = make(tmp_path, local=local).restore()
    assert got.step == 1


def test_a_success_resets_the_consecutive_failure_count(tmp_path: Path, mounts: Any) -> None:
    local = mounts.tmpfs("2m")
    ckpt = make(tmp_path, local=local, max_consecutive_failures=2)
    big = {"w": np.ones(3 * 2**20, np.uint8)}
    small = {"w": np.ones(10, np.uint8)}
    for step, state in enumerate([big, small, big, small, big], start=1):
        ckpt.save(state, step=step)
        assert ckpt.wait()
    s = ckpt.close()
    assert (s.failures, s.committed, s.consecutive_failures) == (3, 2, 1)


def test_full_pfs_fails_the_flush_but_training_goes_on(tmp_path: Path, mounts: Any) -> None:
    pfs = mounts.tmpfs("2m")
    ckpt = make(tmp_path, pfs=pfs, keep_local=1)
    big = {"model": {"w": torch.ones(3 * 2**20 // 4)}}
    ckpt.save(big, step=1)
    assert ckpt.wait()
    ckpt.save(big, step=2)
    stats = ckpt.close()
    assert stats.flush_failures == 2 and stats.flushes == 0
    assert stats.failures == 0 and stats.consecutive_failures == 0  # the saves themselves worked
    rec = ckpt.ledger.get(ckpt.user, "run", 1)
    assert rec.state("pfs") is State.FAILED and "no space left on device" in rec.error
    assert ckpt.ledger.failures().get("flush_failed") == 2
    # keep_local=1, but neither checkpoint reached the PFS: both stay on the local tier.
    assert steps(ckpt, "local") == [1, 2]
    assert steps(ckpt, "pfs") == []
    assert [n for n in os.listdir(pfs / ckpt.user / "run") if n.startswith(".partial")] == []


# ------------------------------------------------------------------ intervals and config


def test_token_and_step_intervals_are_aligned(tmp_path: Path) -> None:
    ckpt = make(tmp_path, interval_tokens=100)
    assert not ckpt.should_save(step=0, tokens=0)
    assert not ckpt.should_save(step=1, tokens=99)
    assert ckpt.should_save(step=2, tokens=100)
    ckpt.save({"x": 1}, step=2, tokens=130)
    assert not ckpt.should_save(step=3, tokens=199)
    assert ckpt.should_save(step=4, tokens=200)
    ckpt.close()

    ckpt = make(tmp_path, key="steps", interval_steps=5)
    assert [ckpt.should_save(step=s) for s in (3, 4, 5)] == [False, False, True]
    ckpt.save({"x": 1}, step=5)
    assert [ckpt.should_save(step=s) for s in (6, 9, 10)] == [False, False, True]
    ckpt.close()


def test_default_interval_and_seconds_and_auto(tmp_path: Path) -> None:
    ckpt = make(tmp_path)
    assert ckpt.interval_tokens == DEFAULT_INTERVAL_TOKENS == 50_000_000
    ckpt.close()
    ckpt = make(tmp_path, interval_seconds="1h")
    assert ckpt.interval_tokens is None and not ckpt.should_save(step=1)
    ckpt.close()
    # auto with a tiny MTBI: the Daly period is the MTBI itself (1 ms), due at once after
    # a 20 ms pause (a lower bound on a monotonic clock, not a timing assertion).
    ckpt = make(tmp_path, interval="auto", mtbi=0.001)
    threading.Event().wait(0.02)
    assert ckpt.should_save(step=1)
    ckpt.save({"x": 1}, step=1)
    assert ckpt.stats.last_stall_s > 0
    ckpt.close()
    with pytest.raises(ConfigError, match="interval"):
        make(tmp_path, interval="sometimes")


def test_from_env_uses_site_config_and_slurm_variables(tmp_path: Path, monkeypatch: Any) -> None:
    (tmp_path / "l").mkdir()
    (tmp_path / "p").mkdir()
    cfg = tmp_path / "config.toml"
    cfg.write_text(
        f"""
[tiers.local]
root = "{tmp_path / "l"}"
require_mount = false
min_free = 0
[tiers.pfs]
kind = "posix"
root = "{tmp_path / "p"}"
[job]
interval_steps = 3
signals = []
[retention]
keep_local = 4
"""
    )
    for k in ("RANK", "WORLD_SIZE", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_CKPT_CONFIG", str(cfg))
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURMD_NODENAME", "gpu-node17")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    ckpt = Checkpointer.from_env()
    assert (ckpt.key, ckpt.job, ckpt.node, ckpt.rank, ckpt.world_size) == (
        "4242",
        "4242",
        "gpu-node17",
        0,
        1,
    )
    assert ckpt.interval_steps == 3 and ckpt.policy.keep_local == 4
    assert ckpt.local.root == str(tmp_path / "l")
    ckpt.save({"x": np.arange(3)}, step=3)
    ckpt.close()
    m = ckpt.warm.manifest(ckpt.user, "4242", 3)
    assert (m.job, m.node, m.meta["rank"], m.meta["world_size"]) == ("4242", "gpu-node17", 0, 1)
    # Keyword arguments override the config.
    ckpt = Checkpointer.from_env(key="other", interval_tokens=10)
    assert ckpt.key == "other" and ckpt.interval_tokens == 10 and ckpt.interval_steps is None
    ckpt.close()


def test_standalone_identity_without_slurm(tmp_path: Path, monkeypatch: Any) -> None:
    for k in ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    ckpt = make(tmp_path)
    assert ckpt.job is None and (ckpt.rank, ckpt.world_size) == (0, 1)
    assert ckpt.user and ckpt.node and "." not in ckpt.node
    ckpt.close()


def test_import_is_cheap_and_checkpointer_is_lazy() -> None:
    code = (
        "import sys, slurm_ckpt\n"
        "assert 'numpy' not in sys.modules and 'slurm_ckpt.job' not in sys.modules\n"
        "from slurm_ckpt import Checkpointer\n"
        "assert Checkpointer.__module__ == 'slurm_ckpt.job.checkpointer'\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert res.returncode == 0, res.stderr


def test_exit_without_close_still_commits_the_local_write(tmp_path: Path) -> None:
    (tmp_path / "local").mkdir()
    (tmp_path / "pfs").mkdir()
    code = (
        "import numpy as np\n"
        "from slurm_ckpt import Checkpointer\n"
        f"c = Checkpointer(local={str(tmp_path / 'local')!r}, warm={str(tmp_path / 'pfs')!r},\n"
        "                 key='run', install_signals=False, end_time_fn=None)\n"
        "c.save({'model': {'w': np.ones(8 * 2**20, np.float32)}}, step=3)\n"
        "# no close(): the interpreter exits while the write runs in a daemon thread\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert res.returncode == 0, res.stderr
    ckpt = make(tmp_path)
    assert steps(ckpt, "local") == [3]
    got = ckpt.restore()  # verified while read
    assert got.step == 3 and float(got.state["model"]["w"].sum()) == 8 * 2**20
    # The flush either made it before the interpreter died or is owed (for the epilog).
    owed = [r.step for r in ckpt.ledger.pending_flush(ckpt.user, "run")]
    assert owed == [3] or steps(ckpt, "pfs") == [3]
    ckpt.close()


def test_saves_and_flushes_become_events_and_metrics(tmp_path: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from slurm_ckpt.core.config import Config
    from slurm_ckpt.ledger.events import read_events

    prom_dir = tmp_path / "prom"
    (tmp_path / "local").mkdir()
    (tmp_path / "pfs").mkdir()
    cfg = Config.standalone(
        tmp_path / "local", tmp_path / "pfs", metrics={"textfile_dir": str(prom_dir)}
    )
    ckpt = make(tmp_path, config=cfg, interval_steps=1)
    for step in (1, 2):
        ckpt.save(sample_state(step), step=step, tokens=step * 100)
        ckpt.wait()
    ckpt.close()
    log = Path(ckpt.ledger.directory) / "events.jsonl"  # type: ignore[union-attr]
    types = [e["type"] for e in read_events(log)]
    assert types.count("save") == 2 and types.count("flush") == 2
    assert types.count("local_write") == 2
    text = (prom_dir / "slurm_ckpt.prom").read_text()
    samples = {
        (s.name, s.labels.get("key")): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    assert samples[("slurm_ckpt_flush_queue_checkpoints", None)] == 0
    assert samples[("slurm_ckpt_flush_seconds", "run")] > 0
    assert samples[("slurm_ckpt_save_stall_seconds", "run")] > 0


def test_runs_as_a_user_below_root_owned_tiers() -> None:
    """The secure SLURM layout: tier roots and the node ledger are root's; the prolog made
    ``<root>/<user>`` for the job user. The job's Checkpointer (not root) must save,
    flush and keep its own ledger in its user directory."""
    import shutil
    import tempfile

    from conftest import in_child_as

    tmp_path = Path(tempfile.mkdtemp(prefix="ckpt-user-", dir="/var/tmp"))  # world-traversable
    os.chmod(tmp_path, 0o755)
    local, pfs = tmp_path / "local", tmp_path / "pfs"
    for root in (local, pfs):
        root.mkdir(mode=0o755)
        (root / "nobody").mkdir(mode=0o700)
        os.chown(root / "nobody", 65534, 65534)
    (local / ".slurm_ckpt").mkdir(mode=0o755)  # the node ledger: root's alone

    def run() -> Any:
        ck = Checkpointer(
            local=local,
            warm=pfs,
            key="run",
            install_signals=False,
            end_time_fn=None,
            interval_steps=1,
        )
        ck.save({"model": {"w": torch.ones(4)}}, step=1)
        ck.close()
        assert ck.ledger is not None
        return [s.step for s in ck.warm.steps("nobody", "run")], str(ck.ledger.directory)

    steps, ledger_dir = in_child_as(65534, 65534, run)
    assert steps == [1]
    assert ledger_dir == str(local / "nobody" / ".slurm_ckpt")
    assert os.listdir(local / ".slurm_ckpt") == []  # root's ledger untouched
    assert (local / "nobody" / ".slurm_ckpt" / "events.jsonl").stat().st_size > 0
    shutil.rmtree(tmp_path)


def test_a_forked_child_leaves_the_exit_hook_to_its_parent(tmp_path: Path) -> None:
    """A DataLoader worker is a fork of the trainer: it inherits the Checkpointer's exit
    hook but none of its threads. Run in the child, the hook waited for a local write no
    thread of the child does (each worker hung until its parent killed it: 5 s per epoch)
    and handed the parent's flushes off again. The parent still runs it."""
    import multiprocessing

    ckpt = make(tmp_path)
    marker = tmp_path / "hook-ran-in"

    def record() -> None:
        with open(marker, "a") as fh:
            fh.write(f"{os.getpid()}\n")

    ckpt._pipeline.finish_at_exit = record  # type: ignore[method-assign]

    def child() -> None:  # ends through multiprocessing's exit: threading's hooks run
        pass

    p = multiprocessing.get_context("fork").Process(target=child)
    p.start()
    p.join()
    assert p.exitcode == 0
    assert not marker.exists()
    from slurm_ckpt.job.closing import _finish_at_exit

    _finish_at_exit(lambda: ckpt._ctx, os.getpid())  # what the parent's exit runs
    assert marker.read_text() == f"{os.getpid()}\n"
    ckpt.close()


def test_close_says_when_it_waits(tmp_path: Path, caplog) -> None:
    """A close() that waits more than a second for the flushes says so, and when it is
    done (it waited silently, 9.7 s for 800 MiB)."""
    import logging

    import numpy as np

    from slurm_ckpt import Checkpointer

    ckpt = Checkpointer(
        local=str(tmp_path / "l"), warm=str(tmp_path / "p"), key="run", warm_bandwidth="2MB/s"
    )
    ckpt.save({"w": np.zeros(1 << 20, dtype=np.float32)}, step=1)  # 4 MiB at 2 MB/s
    with caplog.at_level(logging.INFO, logger="slurm_ckpt"):
        ckpt.close()
    said = [r.getMessage() for r in caplog.records if "close():" in r.getMessage()]
    assert said[0] == "[ckpt] close(): waiting for the local write and the flushes", said
    assert said[-1].startswith("[ckpt] close(): done waiting after "), said
