"""Preemption and time-limit signals, and how much time is left to act on them.

SLURM warns a job before it ends: ``SIGTERM`` at cancel, preemption or the time limit
(followed by ``SIGKILL`` after ``KillWait``/``GraceTime``), and any signal the user asked
for with ``#SBATCH --signal=USR1@300`` (which may come up to 60 s *earlier* than asked,
never later). A Python signal handler runs between two bytecodes of the main thread, in
the middle of whatever the training loop is doing; writing a checkpoint from there would
snapshot a half-updated state and could deadlock on locks the interrupted code holds.

So the handler here only records *that* a signal arrived and *when* (plain attribute
stores: no locks, no allocation worth mentioning, no I/O), then chains to the handler that
was installed before it. The checkpoint itself is taken at the next step boundary, when
the training loop calls ``should_save()``.

Ctrl-C (``SIGINT``) is the one signal whose previous handler ends the program at once
(``KeyboardInterrupt``). When it is among the signals saved on (the default without
SLURM, on a laptop), its *first* arrival only sets the flag - the save at the next step
boundary then ends the run cleanly - and the next one goes on to the previous handler:
a second Ctrl-C interrupts at once. While the Checkpointer closes (``interrupt_now``)
there is no step boundary left to wait for: every Ctrl-C interrupts at once.

:class:`Deadline` turns what is known (the job's end time from an injectable provider,
``KillWait``, the signal's arrival and lead time) into the latest moment by which work
must be done, so the Checkpointer can decide to leave the PFS flush to the epilog rather
than be killed halfway through it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Union

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_SIGNALS", "Deadline", "SignalFlag", "signal_number"]

DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2")

Handler = Union[Callable[[int, Any], Any], int, None]


def relayed_signal() -> Optional[signal.Signals]:
    """The warning signal ckpt-srun relays to the job's tasks (``SLURM_CKPT_SIGNAL``, e.g.
    ``USR1``), or None outside ckpt-srun. A value that names no catchable signal is
    logged and ignored: the job then saves on its configured signals only."""
    raw = os.environ.get("SLURM_CKPT_SIGNAL", "").strip()
    if not raw:
        return None
    try:
        return signal_number(raw)
    except ValueError:
        log.warning("[ckpt] SLURM_CKPT_SIGNAL=%r names no signal that can be caught", raw)
        return None


def signal_number(sig: Union[str, int, signal.Signals]) -> signal.Signals:
    """``"USR1"``, ``"SIGUSR1"``, ``10`` or ``signal.SIGUSR1`` -> ``signal.SIGUSR1``."""
    if isinstance(sig, signal.Signals):
        return sig
    if isinstance(sig, int) and not isinstance(sig, bool):
        return signal.Signals(sig)
    name = str(sig).strip().upper()
    if not name.startswith("SIG"):
        name = "SIG" + name
    value = getattr(signal, name, None)
    if not isinstance(value, signal.Signals) or name in ("SIGKILL", "SIGSTOP"):
        raise ValueError(f"signal {sig!r} cannot be caught")
    return value


class SignalFlag:
    """Installs handlers that only set a flag, chaining to the previous Python handlers.

    ``received`` is the first signal number seen (None until one arrives), ``received_at``
    its wall-clock time, ``count`` how many arrived. :meth:`uninstall` puts the original
    handlers back (unless someone replaced ours meanwhile: then theirs stay).
    """

    def __init__(self) -> None:
        self.received: Optional[int] = None
        self.received_at: Optional[float] = None
        self.last: Optional[int] = None
        self.count = 0
        #: Set while the Checkpointer closes: a Ctrl-C then interrupts at once.
        self.interrupt_now = False
        self._interrupts = 0
        self._previous: Dict[int, Handler] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        # Only attribute stores here: no locks, no logging, no I/O (see module docstring).
        if self.received is None:
            self.received_at = time.time()
            self.received = signum
        self.last = signum
        self.count += 1
        prev = self._previous.get(signum)
        if signum == signal.SIGINT:
            self._interrupts += 1
            if self._interrupts == 1 and not self.interrupt_now:
                return  # the first Ctrl-C: saved at the next step boundary
            if prev == signal.SIG_DFL or prev is None:
                raise KeyboardInterrupt
        if callable(prev):
            prev(signum, frame)

    def install(self, signals: Iterable[Union[str, int, signal.Signals]]) -> List[int]:
        """Install on each signal; returns the numbers installed (none off the main
        thread, where Python cannot install handlers: that is logged)."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("[ckpt] not on the main thread: signal handlers not installed")
            return []
        done = []
        for sig in signals:
            num = int(signal_number(sig))
            if num in self._previous:
                continue
            prev = signal.getsignal(num)
            signal.signal(num, self._handler)
            self._previous[num] = prev
            done.append(num)
        return done

    def uninstall(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning("[ckpt] not on the main thread: signal handlers left installed")
            return
        for num, prev in list(self._previous.items()):
            current = signal.getsignal(num)
            if current == self._handler:
                signal.signal(num, prev if prev is not None else signal.SIG_DFL)
            del self._previous[num]

    def clear(self) -> None:
        self.received = self.received_at = self.last = None
        self.count = self._interrupts = 0


class Deadline:
    """The latest wall-clock time by which the job's work must be done, or None.

    Sources, the earliest wins:

    * ``end_time_fn()`` (epoch seconds; default: ``SLURM_JOB_END_TIME``) plus
      ``kill_wait_s``: at the end time SLURM sends SIGTERM and kills ``KillWait`` later;
    * a SIGTERM that arrived at ``t``: ``t + kill_wait_s`` (preemption, scancel);
    * another signal at ``t`` when its lead time is known (``--signal=USR1@300`` ->
      ``signal_lead_s=300``): ``t + signal_lead_s + kill_wait_s``. The signal may come up
      to 60 s early, so this is a lower bound: safe. A Ctrl-C sets no deadline.
    """

    def __init__(
        self,
        flag: SignalFlag,
        end_time_fn: Optional[Callable[[], Optional[float]]] = None,
        kill_wait_s: float = 30.0,
        signal_lead_s: Optional[float] = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.flag = flag
        self.end_time_fn = end_time_fn
        self.kill_wait_s = float(kill_wait_s)
        self.signal_lead_s = signal_lead_s
        self.clock = clock

    def end_time(self) -> Optional[float]:
        if self.end_time_fn is None:
            return None
        try:
            value = self.end_time_fn()
        except Exception as exc:  # noqa: BLE001 - a provider must never stop training
            log.warning("[ckpt] end-time provider failed: %s", exc)
            return None
        return None if value is None else float(value)

    def deadline(self) -> Optional[float]:
        candidates = []
        end = self.end_time()
        if end is not None:
            candidates.append(end + self.kill_wait_s)
        t = self.flag.received_at
        if t is not None:
            if self.flag.received == signal.SIGTERM:
                candidates.append(t + self.kill_wait_s)
            elif self.flag.received != signal.SIGINT and self.signal_lead_s is not None:
                candidates.append(t + float(self.signal_lead_s) + self.kill_wait_s)
        return min(candidates) if candidates else None

    def time_left(self) -> Optional[float]:
        """Seconds until the deadline (may be negative), None when unknown."""
        d = self.deadline()
        return None if d is None else d - self.clock()
