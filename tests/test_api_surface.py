"""The library as a new user meets it: one obvious constructor, a frozen save record, the
errors in one place, a laptop with one tier, and errors raised where the mistake is.

Each test is one bullet of issue 18 (library half); they use real tiers on tmp_path.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import signal
import stat
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import slurm_ckpt
from slurm_ckpt import Checkpointer, CkptError, ConfigError, Saved, TierError
from slurm_ckpt.core.config import Config
from slurm_ckpt.job.options import OPTION_NAMES, UNSET, Options

REPO = Path(__file__).resolve().parents[1]
STATE = {"w": np.arange(4096, dtype=np.float32), "step": 1}


def laptop(tmp_path: Path, **kw: Any) -> Checkpointer:
    kw.setdefault("install_signals", False)
    kw.setdefault("end_time_fn", None)
    return Checkpointer(local=tmp_path / "ckpt", key=kw.pop("key", "run"), **kw)


# ------------------------------------------------------------------ one obvious way in
def test_every_option_is_an_explicit_keyword_with_one_line_of_help() -> None:
    sig = inspect.signature(Checkpointer.__init__)
    kwonly = [p for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY]
    assert [p.name for p in kwonly] == ["config", *OPTION_NAMES]
    assert not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())  # no **options
    defaults = {f.name: f.default for f in dataclasses.fields(Options)}
    for p in kwonly[1:]:
        assert p.default is defaults[p.name] or p.default == defaults[p.name], p.name
    assert defaults["end_time_fn"] is UNSET
    doc = inspect.getdoc(Checkpointer) or ""
    guide = (REPO / "docs" / "user-guide-options.md").read_text()
    for name in ["local", "warm", "key", "config", *OPTION_NAMES]:
        assert re.search(rf"^\s+{name}: \S", doc, re.M), f"{name} has no line in help()"
        assert f"`{name}`" in guide, f"{name} is not in docs/user-guide-options.md"


def test_save_returns_a_small_frozen_record(tmp_path: Path) -> None:
    with laptop(tmp_path) as ckpt:
        got = ckpt.save(STATE, step=3, tokens=96)
    assert isinstance(got, Saved)
    assert [f.name for f in dataclasses.fields(got)] == [
        "step",
        "tokens",
        "nbytes",
        "stall_s",
        "preemption",
        "synchronous",
        "deferred_bytes",
    ]
    assert (got.step, got.tokens, got.preemption, got.synchronous) == (3, 96, False, False)
    assert got.nbytes >= STATE["w"].nbytes and got.stall_s >= 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.step = 4  # type: ignore[misc]


def test_the_errors_a_user_catches_come_from_slurm_ckpt() -> None:
    from slurm_ckpt import errors, torch_codec
    from slurm_ckpt.job import pipeline, restore

    assert slurm_ckpt.CheckpointFailed is pipeline.CheckpointFailed
    assert slurm_ckpt.DataVersionMismatch is restore.DataVersionMismatch
    assert slurm_ckpt.UnsupportedState is torch_codec.UnsupportedState
    for name in ("CkptError", "ConfigError", "TierError", "VerifyError", "NotFound"):
        assert getattr(slurm_ckpt, name) is getattr(errors, name)
    for name in slurm_ckpt.__all__:
        value = getattr(slurm_ckpt, name)
        if isinstance(value, type) and issubclass(value, Exception):
            assert issubclass(value, CkptError), name


def test_from_env_relays_the_signal_ckpt_srun_sends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = Config.standalone(tmp_path / "l", tmp_path / "p", job={"signals": ["SIGTERM"]})
    monkeypatch.setenv("SLURM_CKPT_SIGNAL", "USR1")  # what ckpt-srun exports
    monkeypatch.setenv("SLURM_CKPT_KEY", "relay")
    for var in ("SLURM_JOB_ID", "SLURM_PROCID", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "l").mkdir()
    (tmp_path / "p").mkdir()
    before = signal.getsignal(signal.SIGUSR1)
    ckpt = Checkpointer.from_env(config=cfg, interval_steps=1000, end_time_fn=None)
    try:
        assert ckpt.key == "relay"
        assert not ckpt.should_save(step=1)
        os.kill(os.getpid(), signal.SIGUSR1)  # would kill a job that did not install it
        assert ckpt.signal_received == signal.SIGUSR1
        assert ckpt.should_save(step=2)
        assert ckpt.save(STATE, step=2).preemption and ckpt.preempted
    finally:
        ckpt.close()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_from_env_names_a_misspelt_option(tmp_path: Path) -> None:
    cfg = Config.standalone(tmp_path / "l", tmp_path / "p")
    with pytest.raises(CkptError, match="unknown option 'interval_step'.*'interval_steps'"):
        Checkpointer.from_env("k", config=cfg, interval_step=5)


# ------------------------------------------------------------------ laptop mode
def test_a_laptop_needs_only_a_local_tier_and_keeps_the_newest_keep_local(
    tmp_path: Path,
) -> None:
    ckpt = laptop(tmp_path, keep_local=2, interval_steps=1)
    assert ckpt.warm is None and [t.name for t in ckpt.tiers] == ["local"]
    for step in range(1, 6):
        ckpt.save(
            {"w": np.full(64, step, dtype=np.int64)}, step=step, preemption=step == 3
        )  # not kept for ever
        ckpt.wait()
    stats = ckpt.close()
    assert (stats.saves, stats.committed, stats.flushes, stats.failures) == (5, 5, 0, 0)
    assert [i.step for i in ckpt.local.steps(ckpt.user, "run")] == [4, 5]
    again = laptop(tmp_path)
    got = again.restore()
    assert got is not None and got.step == 5 and got.tier == "local"
    assert int(np.asarray(got.state["w"])[0]) == 5
    again.close()


def test_a_missing_tier_root_is_made_for_the_user_mode_0700(tmp_path: Path) -> None:
    local, pfs = tmp_path / "a" / "b" / "local", tmp_path / "pfs"
    ckpt = Checkpointer(local=local, warm=pfs, key="run", install_signals=False)
    ckpt.save(STATE, step=1)
    ckpt.close()
    for root in (local, pfs):
        st = os.stat(root)
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    assert [i.step for i in ckpt.warm.steps(ckpt.user, "run")] == [1]  # type: ignore[union-attr]


def test_a_site_config_with_a_missing_root_is_still_refused(tmp_path: Path) -> None:
    cfg = Config.standalone(tmp_path / "nolocal", tmp_path / "pfs")
    with pytest.raises(TierError, match="nolocal"):
        Checkpointer(key="run", config=cfg, install_signals=False)
    assert not (tmp_path / "nolocal").exists()


def test_debris_of_a_killed_save_is_swept_but_not_a_live_writers(tmp_path: Path) -> None:
    with laptop(tmp_path) as ckpt:
        ckpt.save(STATE, step=1)
    kdir = tmp_path / "ckpt" / ckpt.user / "run"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    killed = kdir / f".tmp-step-0000000002-{int(dead.stdout)}-0badc0de"
    live = kdir / f".tmp-step-0000000003-{os.getpid()}-0000beef"
    for d in (killed, live):
        d.mkdir()
        (d / "blob").write_bytes(b"x" * 1000)
    laptop(tmp_path).close()
    assert not killed.exists()  # its writer is gone
    assert live.exists()  # a writer that still runs keeps its directory


# ------------------------------------------------------------------ honest errors
def test_an_interval_that_can_never_be_reached_warns_at_the_first_should_save(
    tmp_path: Path,
) -> None:
    with laptop(tmp_path) as ckpt:
        with pytest.warns(UserWarning, match="no interval given.*tokens="):
            assert not ckpt.should_save(step=1)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once only
            ckpt.should_save(step=2)
    for kw, call in (({}, {"tokens": 10}), ({"interval_steps": 5}, {})):
        with laptop(tmp_path, **kw) as ckpt, warnings.catch_warnings():
            warnings.simplefilter("error")
            ckpt.should_save(step=1, **call)


@pytest.mark.parametrize(
    "bad",
    [
        {"step": 2**70},
        {"step": -1},
        {"step": 1.0},
        {"step": 1, "tokens": -5},
        {"step": 1, "tokens": 2**64},
        {"step": 1, "meta": {"x": object()}},
        {"step": 1, "meta": {"x": float("nan")}},
        {"step": 1, "preemption": "yes"},
        {"step": 1, "data_version": 3},
    ],
)
def test_bad_save_arguments_raise_at_the_call(tmp_path: Path, bad: Any) -> None:
    with laptop(tmp_path) as ckpt:
        with pytest.raises(CkptError, match=r"^save\(\): "):
            ckpt.save(STATE, **bad)
        assert ckpt.stats.saves == 0
    assert ckpt.local.steps(ckpt.user, "run") == []


def test_restore_from_a_tier_that_does_not_exist_raises(tmp_path: Path) -> None:
    with laptop(tmp_path) as ckpt:
        with pytest.raises(CkptError, match="no tier 'nvme' here.*local"):
            ckpt.restore(tiers=["nvme"])
        assert ckpt.restore(tiers=["local"]) is None  # a real tier with nothing yet


def test_a_keep_local_no_disk_could_hold_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="keep_local: must be at most"):
        laptop(tmp_path, keep_local=99999999999999999999999)
