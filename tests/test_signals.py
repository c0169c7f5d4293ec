"""Signals: a flag only, chained handlers, the save at the next step, deadlines, requeue.

Real signals, sent with ``os.kill(os.getpid(), ...)``; Python runs the handler in the main
thread before the next bytecode after ``os.kill`` returns.
"""

from __future__ import annotations

import os
import pwd
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import numpy as np
import pytest
from test_torch_resume import TrainProc

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


# -- Ctrl-C (SIGINT) ---------------------------------------------------------------------
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def sigint_default() -> Iterator[None]:
    """SIGINT as an interactive Python has it (a test runner started in the background
    inherits it ignored)."""
    saved = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, saved)


def test_sigint_first_saves_at_the_step_second_interrupts(
    tmp_path: Path, sigint_default: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without SLURM (a laptop) SIGINT is saved on by default: the first Ctrl-C only
    sets the flag (the save comes at the next step boundary), the second one raises
    KeyboardInterrupt at once. Under SLURM it is opt-in (``signals=``), same behaviour."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOBID", raising=False)
    ckpt = make(tmp_path)
    os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt: a flag only
    assert ckpt.signal_received == signal.SIGINT and ckpt.should_save(step=1)
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
    ckpt.close()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    for sub in ("slurm", "opted"):
        (tmp_path / sub).mkdir()
    under_slurm = make(tmp_path / "slurm")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # srun's to use
    under_slurm.close()
    opted = make(tmp_path / "opted", signals=["SIGTERM", "SIGINT"])
    os.kill(os.getpid(), signal.SIGINT)
    assert opted.signal_received == signal.SIGINT
    opted.close()


class LaptopProc(TrainProc):
    """examples/train_tiny.py as on a laptop: no SLURM variables, SIGINT not ignored."""

    def __init__(self, args: List[str], cwd: Path) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
        env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "examples" / "train_tiny.py"), *args],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        self.lines = []
        self._q: queue.Queue[Optional[str]] = queue.Queue()
        self._eof = False
        threading.Thread(target=self._read, daemon=True).start()


def test_ctrl_c_on_a_laptop_saves_at_the_next_step_and_resumes_losing_nothing(
    tmp_path: Path,
) -> None:
    """A real Ctrl-C to examples/train_tiny.py with a local tier only: it saves at the
    next step boundary and exits 0, no traceback; the next run resumes at that step with
    0 steps lost. (Before: KeyboardInterrupt at once, nothing saved.) The signal is sent
    once the job reported a step, and the job runs until it comes: no race."""
    base = ["--local", str(tmp_path / "local"), "--key", "laptop", "--interval-steps", "100000"]
    run = LaptopProc([*base, "--steps", "100000"], tmp_path)
    try:
        first = int(run.expect(r"^STEP (\d+) ").group(1))
        run.signal(signal.SIGINT)
        saved = int(run.expect(r"^SAVED step=(\d+)$").group(1))
        assert run.expect(r"^PREEMPTED step=(\d+)$").group(1) == str(saved)
        assert run.finish() == 0, run.tail()
    finally:
        run.close()
    assert saved >= first
    out = "\n".join(run.lines)
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-2000:]
    assert "[ckpt] Ctrl-C: saving at this step boundary" in out
    again = LaptopProc([*base, "--steps", str(saved + 2)], tmp_path)
    try:
        m = again.expect(r"^RESUMED step=(\d+) reached=(\d+) lost=(\d+) ")
        again.expect(r"^DONE step=")
        assert again.finish() == 0, again.tail()
    finally:
        again.close()
    assert m.groups() == (str(saved), str(saved), "0")


_CLOSE_SCRIPT = """
import os, signal, sys, threading, time
from pathlib import Path
import numpy as np
from slurm_ckpt import Checkpointer
local, warm = sys.argv[1], sys.argv[2]
c = Checkpointer(local=local, warm=warm, key="k", warm_bandwidth="200KB/s", end_time_fn=None)
c.save({"w": np.zeros(1_000_000, dtype=np.float32)}, step=1)
c.wait(flush=False)
series = Path(warm) / c.user / "k"
def ctrl_c_once_closing():  # close() has begun and the flush copy is on its way
    while not (c._ctx.closed and any(series.glob(".partial-*"))):
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGINT)
threading.Thread(target=ctrl_c_once_closing, daemon=True).start()
c.close()
print("CLOSED", flush=True)
"""


def test_ctrl_c_in_close_ends_cleanly_and_the_next_start_sweeps_the_copy(
    tmp_path: Path,
) -> None:
    """Ctrl-C while close() waits for a slow flush: exit status 130, one line, no
    traceback (before: a KeyboardInterrupt traceback); the copy it stopped halfway
    (``.partial-*`` on the warm tier) goes at the next start."""
    local, warm = tmp_path / "local", tmp_path / "warm"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env["PYTHONPATH"] = str(REPO)
    p = subprocess.run(
        [sys.executable, "-c", _CLOSE_SCRIPT, str(local), str(warm)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    out = p.stdout + p.stderr
    assert p.returncode == 130, out[-2000:]
    assert "Traceback" not in out and "CLOSED" not in out, out[-2000:]
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1 and "interrupted while closing: step 1 committed" in lines[0]
    assert "epilog" not in lines[0], lines  # a laptop has none (issue 31)
    series = warm / pwd.getpwuid(os.getuid()).pw_name / "k"

    def debris() -> list:
        # The copy's own work area, or (its abort under way at the exit) that area
        # renamed for removal; or nothing, when the abort finished before the exit.
        return list(series.glob(".partial-*")) + list(series.glob(".trash-*"))

    left = debris()
    Checkpointer(local=local, warm=warm, key="k", install_signals=False).close()
    assert not debris(), left  # whatever the interrupted close left, the next start swept


def test_a_standalone_start_sweeps_its_series_debris(tmp_path: Path) -> None:
    """Debris of an interrupted copy or save of this series (a work area, one renamed
    for removal, a half-written local save) on the local and warm tiers goes at the next
    start of a standalone Checkpointer; another series' is left alone."""
    local, warm = tmp_path / "local", tmp_path / "warm"
    user = pwd.getpwuid(os.getuid()).pw_name
    Checkpointer(local=local, warm=warm, key="k", install_signals=False).close()
    mine = [
        warm / user / "k" / ".partial-step-0000000001.host.1.abcd",
        warm / user / "k" / ".trash-partial-step-0000000001.host.1.abcd-1234",
        local / user / "k" / ".partial-step-0000000002",
    ]
    other = warm / user / "other" / ".partial-step-0000000001.host.1.abcd"
    for d in (*mine, other):
        (d / "rank-00000").mkdir(parents=True)
        (d / "rank-00000" / "data-0000.bin").write_bytes(b"x" * 10)
    Checkpointer(local=local, warm=warm, key="k", install_signals=False).close()
    assert [d for d in mine if d.exists()] == []
    assert other.exists()
