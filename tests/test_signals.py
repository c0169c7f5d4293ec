"""Signals: a flag only, chained handlers, the save at the next step, deadlines, requeue.

Real signals, sent with ``os.kill(os.getpid(), ...)``; Python runs the handler in the main
thread before the next bytecode after ``os.kill`` returns.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any, Dict, Iterator, List

import numpy as np
import pytest

from slurm_ckpt.job import Checkpointer
from slurm_ckpt.job.signals import Deadline, SignalFlag, signal_number
from slurm_ckpt.ledger import State

SIGS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


@pytest.fixture(autouse=True)
def keep_handlers() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in SIGS}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def make(tmp_path: Path, **kw: Any) -> Checkpointer:
    (tmp_path / "local").mkdir(exist_ok=True)
    (tmp_path / "pfs").mkdir(exist_ok=True)
    kw.setdefault("end_time_fn", None)
    kw.setdefault("interval_steps", 10**9)
    return Checkpointer(local=tmp_path / "local", warm=tmp_path / "pfs", key="run", **kw)


STATE = {"model": {"w": np.arange(1000, dtype=np.float32)}, "opt": {"step": 1}}


def test_signal_sets_a_flag_chains_and_saves_at_the_next_step(tmp_path: Path) -> None:
    calls: List[int] = []

    def previous(signum: int, frame: Any) -> None:
        calls.append(signum)

    signal.signal(signal.SIGTERM, previous)
    usr1 = signal.getsignal(signal.SIGUSR1)
    ckpt = make(tmp_path)
    assert signal.getsignal(signal.SIGTERM) is not previous
    assert not ckpt.should_save(step=1)
    os.kill(os.getpid(), signal.SIGTERM)
    # The handler ran (the previous one was chained) but saved nothing by itself.
    assert calls == [signal.SIGTERM]
    assert ckpt.signal_received == signal.SIGTERM
    assert ckpt.local.steps(ckpt.user, "run") == []
    assert not ckpt.preempted
    assert ckpt.should_save(step=2)  # no interval is due: the signal asks for the save
    assert ckpt.should_save(step=2)  # still, until the save is taken
    rec = ckpt.save(STATE, step=2)
    assert rec.preemption
    assert ckpt.preempted
    assert not ckpt.should_save(step=3)
    ckpt.close()
    assert [s.step for s in ckpt.warm.steps(ckpt.user, "run")] == [2]
    r = ckpt.ledger.get(ckpt.user, "run", 2)
    assert r.forced and r.state("pfs") is State.VERIFIED
    # Handlers are put back on close.
    assert signal.getsignal(signal.SIGTERM) is previous
    assert signal.getsignal(signal.SIGUSR1) == usr1


def test_default_disposition_is_not_chained(tmp_path: Path) -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)  # would terminate the process
    ckpt = make(tmp_path)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert ckpt.signal_received == signal.SIGUSR1
    ckpt.close()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def test_signals_are_configurable(tmp_path: Path) -> None:
    sentinel = signal.getsignal(signal.SIGUSR1)
    ckpt = make(tmp_path, signals=["USR2"])
    assert signal.getsignal(signal.SIGUSR1) == sentinel
    os.kill(os.getpid(), signal.SIGUSR2)
    assert ckpt.signal_received == signal.SIGUSR2 and ckpt.should_save(step=1)
    ckpt.close()
    none = make(tmp_path, signals=[])
    assert signal.getsignal(signal.SIGUSR1) == sentinel
    none.close()


def test_flag_unit() -> None:
    flag = SignalFlag()
    assert flag.install(["SIGUSR2", signal.SIGUSR2, 12]) == [int(signal.SIGUSR2)]
    os.kill(os.getpid(), signal.SIGUSR2)
    os.kill(os.getpid(), signal.SIGUSR2)
    assert (flag.received, flag.count) == (signal.SIGUSR2, 2)
    assert flag.received_at is not None
    flag.uninstall()
    with pytest.raises(ValueError):
        signal_number("SIGKILL")
    assert signal_number("usr1") == signal.SIGUSR1


def test_deadline_sources() -> None:
    flag = SignalFlag()
    now = [1000.0]
    d = Deadline(flag, lambda: 2000.0, kill_wait_s=30, clock=lambda: now[0])
    assert d.deadline() == 2030.0 and d.time_left() == 1030.0
    flag.received, flag.received_at = int(signal.SIGTERM), 1500.0  # preemption
    assert d.deadline() == 1530.0
    flag.received = int(signal.SIGUSR1)  # --signal=USR1@300: lead known -> lower bound
    d2 = Deadline(flag, None, kill_wait_s=30, signal_lead_s=300, clock=lambda: now[0])
    assert d2.deadline() == 1830.0
    assert Deadline(flag, None).deadline() is None  # USR1 without lead or end time
    assert Deadline(SignalFlag(), lambda: 1 / 0).deadline() is None  # broken provider


def test_too_little_time_left_leaves_the_flush_to_the_epilog(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    monkeypatch.setenv("SLURM_JOB_ID", "4242")  # in a SLURM job: its epilog flushes
    end = time.time() - 100  # the job's end time has passed: no time for any flush
    ckpt = make(tmp_path, end_time_fn=lambda: end, kill_wait_s=0)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert ckpt.should_save(step=5)
    ckpt.save(STATE, step=5)
    stats = ckpt.close()
    assert stats.left_to_epilog == 1 and stats.flushes == 0
    # Saved locally and committed; the PFS copy is owed, and the ledger says who does it.
    assert [s.step for s in ckpt.local.steps(ckpt.user, "run")] == [5]
    assert ckpt.warm.steps(ckpt.user, "run") == []
    rec = ckpt.ledger.get(ckpt.user, "run", 5)
    assert rec.state("local") is State.COMMITTED
    assert rec.state("pfs") is State.FLUSH_PENDING and rec.error == "left to epilog"
    assert [r.step for r in ckpt.ledger.pending_flush(ckpt.user, "run")] == [5]


def test_on_a_laptop_the_flush_is_left_to_the_next_run_never_an_epilog(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Outside SLURM nothing runs an epilog: the owed flush is the next run's, and no
    message says otherwise; the next run of the series flushes it at its start."""
    import logging
    import time

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOBID", raising=False)
    caplog.set_level(logging.INFO, logger="slurm_ckpt")
    end = time.time() - 100
    ckpt = make(tmp_path, end_time_fn=lambda: end, kill_wait_s=0)
    os.kill(os.getpid(), signal.SIGUSR1)
    ckpt.save(STATE, step=5)
    stats = ckpt.close()
    assert stats.left_to_epilog == 1 and ckpt.warm.steps(ckpt.user, "run") == []
    rec = ckpt.ledger.get(ckpt.user, "run", 5)
    assert rec.state("pfs") is State.FLUSH_PENDING and rec.error == "left for the next run"
    assert "next run" in caplog.text and "epilog" not in caplog.text.lower()
    again = make(tmp_path)  # the next run: picks it up in the background at start
    again.close()
    assert [s.step for s in again.warm.steps(again.user, "run")] == [5]
    assert again.ledger.get(again.user, "run", 5).state("pfs") is State.VERIFIED
    assert "epilog" not in caplog.text.lower()


def test_enough_time_flushes_normally(tmp_path: Path) -> None:
    import time

    end = time.time() + 3600
    ckpt = make(tmp_path, end_time_fn=lambda: end, kill_wait_s=30)
    os.kill(os.getpid(), signal.SIGUSR1)
    ckpt.save(STATE, step=5)
    stats = ckpt.close()
    assert stats.left_to_epilog == 0 and stats.flushes == 1


@pytest.mark.parametrize(
    ("state", "expect"), [("TIMEOUT", True), ("PREEMPTED", False), (None, False)]
)
def test_requeue_only_after_a_time_limit(tmp_path: Path, state: Any, expect: bool) -> None:
    reasons: List[str] = []
    ckpt = make(tmp_path, requeue=True, requeue_fn=reasons.append, job_state_fn=lambda: state)
    os.kill(os.getpid(), signal.SIGTERM)
    ckpt.save(STATE, step=9)
    ckpt.close()
    ckpt.close()  # idempotent: the hook runs at most once
    assert len(reasons) == (1 if expect else 0)
    if expect:
        assert "step 9" in reasons[0] and "TIMEOUT" in reasons[0]


def test_no_requeue_without_a_preemption_save(tmp_path: Path) -> None:
    reasons: List[str] = []
    ckpt = make(tmp_path, requeue=True, requeue_fn=reasons.append, job_state_fn=lambda: "TIMEOUT")
    ckpt.save(STATE, step=1)
    ckpt.close()
    assert reasons == []


def test_default_requeue_is_a_no_op_outside_slurm(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    events: Dict[str, Any] = {}
    ckpt = make(
        tmp_path,
        requeue=True,
        job_state_fn=lambda: "TIMEOUT",
        on_event=lambda n, i: events.setdefault(n, i),
    )
    os.kill(os.getpid(), signal.SIGTERM)
    ckpt.save(STATE, step=1)
    ckpt.close()  # job is None: logs and does not run scontrol
    assert "requeue" in events
