"""The flush engine: get checkpoints from one tier to the next, verified, and keep the
ledger true about it. Every flusher uses it: the Checkpointer's background flusher, the
epilog, the prolog's rescue, the stager, ``ckpt-slurm flush`` and ckpt-srun.

What differs between them is only *how* one checkpoint is copied, and that is a function
the caller passes in (:data:`CopyFn`): in the training process the copy runs in-process
(:func:`copy_in_process`); on the root side it runs in a child that has become the
checkpoint's owner (:class:`~slurm_ckpt.node.work.NodeWork`), with a deadline. The bytes
are always moved by :func:`slurm_ckpt.tiers.copy.copy_checkpoint`, the one module that
copies between tiers.

What the engine decides, once for everyone:

* **When not to start**: less time left than the copy needs (``min_s``, an estimate) or
  than :data:`MIN_SLICE_S`: the checkpoint is *handed off* (``FLUSH_PENDING`` with a note
  saying to whom: the epilog, the stager) rather than started and killed.
* **What a failure means** for the ledger:

  ========================================  ==========================================
  the copy raised                           the ledger says
  ========================================  ==========================================
  :class:`~slurm_ckpt.errors.TimedOut`      handed off (retried later, elsewhere); when
  *before* the deadline (a stopped or       it was not the deadline: also a failure with
  hung child)                               backoff, and the owner's other checkpoints
                                            wait too (the round goes on with others)
  :class:`~slurm_ckpt.errors.NotFound`      local copy ``DELETED`` (gone: nothing owed)
  source corrupt / unsafe to touch          local copy ``BAD``: never flushable as it is,
                                            so it must not keep a node drained (held,
                                            looked at again after its backoff)
  any other :class:`CkptError`              destination ``FAILED``, retried after a
                                            backoff (:mod:`slurm_ckpt.node.retry`)
  success                                   destination ``VERIFIED`` with ``flush_s``
  ========================================  ==========================================

  A failure that was the owner's doing (the exception class's ``user_caused``) is
  *held*: it never keeps a node drained.
* **Batches**: in :meth:`Flusher.flush_all` the ledger changes are buffered and written
  in one transaction at most once a second (:mod:`slurm_ckpt.node.marks`), hand-offs of
  a whole backlog in one, and every loop checks its deadline before each item.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, ContextManager, Dict, Iterable, List, Optional, Set, Tuple

try:  # Python 3.8+: typing has Protocol
    from typing import Protocol, runtime_checkable
except ImportError:  # pragma: no cover
    from typing_extensions import Protocol, runtime_checkable  # type: ignore[assignment]

from slurm_ckpt.core.progress import ProgressFn
from slurm_ckpt.core.units import format_bytes
from slurm_ckpt.errors import CkptError, NotFound, TimedOut
from slurm_ckpt.ledger import WARM_SLOT, Ident, Ledger, Record, State
from slurm_ckpt.node.marks import MarkBuffer, set_state
from slurm_ckpt.node.retry import RetryPolicy, clear_failures
from slurm_ckpt.tiers.base import Tier
from slurm_ckpt.tiers.copy import CopyResult, copy_checkpoint
from slurm_ckpt.tiers.unsafe import Unflushable

log = logging.getLogger(__name__)

__all__ = [
    "HANDED_TO_STAGER",
    "LEFT_TO_EPILOG",
    "MIN_SLICE_S",
    "CopyFn",
    "FlushOutcome",
    "FlushResult",
    "FlushStatus",
    "Flusher",
    "SlotGate",
    "Unflushable",
    "copy_in_process",
]

HANDED_TO_STAGER = "handed to stager"
LEFT_TO_EPILOG = "left to epilog"
#: Do not start a copy with less time than this left; hand it off instead.
MIN_SLICE_S = 0.5

#: ``copy(ident, left_s) -> CopyResult``; raises :class:`~slurm_ckpt.errors.TimedOut`
#: when it ran out of ``left_s``, and any :class:`~slurm_ckpt.errors.CkptError` for a
#: failure (whose class says what it means: ``user_caused``, ``hold_code``, ``bad_source``).
CopyFn = Callable[[Ident, Optional[float]], CopyResult]


@runtime_checkable
class SlotGate(Protocol):
    """What the engine needs of admission control: a slot held around one copy
    (:class:`slurm_ckpt.admission.gate.SlotGate` is the product's). ``slot(budget)``
    yields True once admitted, False when no slot came within ``budget`` seconds."""

    def slot(self, budget: Optional[float]) -> ContextManager[bool]: ...


class FlushStatus(str, Enum):
    """What happened to one checkpoint (str-valued: it prints, compares and goes into
    JSON as its value)."""

    #: Copied and verified now.
    FLUSHED = "flushed"
    #: The destination had the identical checkpoint already.
    ALREADY = "already"
    #: Left for later (``FLUSH_PENDING`` + who finishes it).
    HANDED = "handed"
    #: The destination is ``FAILED`` (retried after a backoff).
    FAILED = "failed"
    #: The source is ``BAD`` (never flushable as it is).
    BAD = "bad"
    #: No local copy any more (``DELETED``: nothing owed).
    GONE = "gone"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


#: The statuses of a checkpoint that is on the destination now.
_DONE = (FlushStatus.FLUSHED, FlushStatus.ALREADY)


@dataclass
class FlushResult:
    """What happened to one checkpoint (``status``: see :class:`FlushStatus`)."""

    ident: Ident
    status: FlushStatus
    nbytes: int = 0
    copied: int = 0
    seconds: float = 0.0
    error: Optional[str] = None
    #: The hold code when the failure was the owner's doing (it keeps no node drained).
    hold: Optional[str] = None
    #: The copy ran out of time before the deadline (a stopped or hung child).
    stuck: bool = False

    @property
    def ok(self) -> bool:
        return self.status in _DONE


@dataclass
class FlushOutcome:
    """What one flush round did."""

    results: List[FlushResult] = field(default_factory=list)
    seconds: float = 0.0

    def _with(self, *status: FlushStatus) -> List[FlushResult]:
        return [r for r in self.results if r.status in status]

    @property
    def flushed(self) -> List[Ident]:
        return [r.ident for r in self._with(*_DONE)]

    @property
    def flushed_bytes(self) -> int:
        return sum(r.copied for r in self._with(*_DONE))

    def summary(self) -> str:
        """``flushed 1 (8.0MiB), 1 already on the warm tier``: what was copied now, apart
        from what the warm tier already held (a copy of 0 bytes is not a flush; the epilog
        once said ``flushed 2 (0B)`` of two checkpoints ckpt-srun had flushed before)."""
        new = self._with(FlushStatus.FLUSHED)
        text = f"flushed {len(new)} ({format_bytes(sum(r.copied for r in new))})"
        already = self._with(FlushStatus.ALREADY)
        if already:
            text += f", {len(already)} already on the warm tier"
        return text

    @property
    def handed(self) -> List[Ident]:
        return [r.ident for r in self._with(FlushStatus.HANDED)]

    @property
    def failed(self) -> List[Tuple[Ident, str]]:
        return [
            (r.ident, r.error or r.status.value)
            for r in self._with(FlushStatus.FAILED, FlushStatus.BAD)
        ]

    @property
    def failing(self) -> int:
        """Failures that are real faults (not held for their owner's doing): what a drain
        reason counts."""
        return sum(1 for r in self._with(FlushStatus.FAILED, FlushStatus.BAD) if not r.hold)

    @property
    def dropped(self) -> List[Ident]:
        return [r.ident for r in self._with(FlushStatus.GONE)]

    @property
    def held(self) -> List[FlushResult]:
        """Results whose failure was the checkpoint owner's doing."""
        return [r for r in self.results if r.hold]


def copy_in_process(src: Tier, dst: Tier, progress: Optional[ProgressFn] = None) -> CopyFn:
    """A :data:`CopyFn` that copies in this process, with its own permissions (the
    training job, ckpt-srun, a user's ``ckpt-slurm flush``). ``left_s`` is not enforced
    mid-copy here: the engine only starts a copy that fits. ``progress(nbytes)`` hears of
    every byte copied."""

    def copy(ident: Ident, _left: Optional[float]) -> CopyResult:
        return copy_checkpoint(src, dst, *ident, replace_older=True, progress=progress)

    return copy


class Flusher:
    """Flushes checkpoints of one source tier to one destination tier (names as in the
    ledger: ``"local"`` -> :data:`~slurm_ckpt.ledger.WARM_SLOT`) through ``copy``,
    recording every outcome in ``ledger`` (optional: ckpt-srun and plain directories run
    without one).

    ``hand_off_note`` says who finishes what this process cannot (``"left to epilog"``
    in a job, ``"handed to stager"`` on the root side). ``clock`` is the clock deadlines
    are given in. ``slots`` (a :class:`SlotGate`, optional):
    every copy first waits for a cluster-wide PFS slot, never past what its deadline
    leaves after the copy's own ``min_s``; not admitted in time, it is handed off.
    ``allowance(nbytes)`` (optional; root's flushers): the time a copy of that size is
    always allowed. With it, while other owners' checkpoints wait behind it, one copy
    gets at most ``max(allowance, time left / owners waiting)``: what one user owes (or
    slows down) costs the others a bounded share of a hook's budget. A copy cut there
    is handed off (the stager has more time), not counted as a failure.
    """

    def __init__(
        self,
        copy: CopyFn,
        ledger: Optional[Ledger] = None,
        *,
        src: str = "local",
        dst: str = WARM_SLOT,
        hand_off_note: str = HANDED_TO_STAGER,
        clock: Callable[[], float] = time.monotonic,
        slots: Optional[SlotGate] = None,
        retry: Optional[RetryPolicy] = None,
        batch_s: float = 1.0,
        allowance: Optional[Callable[[int], float]] = None,
    ) -> None:
        self.copy = copy
        self.allowance = allowance
        self.slots = slots
        self.ledger = ledger
        self.src, self.dst = src, dst
        self.hand_off_note = hand_off_note
        self.clock = clock
        self.retry = retry or RetryPolicy()
        self._buf = MarkBuffer(ledger, batch_s, clock)
        self._batching = False

    # -- ledger --------------------------------------------------------------------
    def _mark(
        self,
        idents: List[Ident],
        tier: str,
        state: State,
        reason: Optional[str] = None,
        *,
        code: Optional[str] = None,
        then: Optional[Callable[[Record, float], None]] = None,
        **kw: Any,
    ) -> None:
        """Record a state (buffered inside :meth:`flush_all`, written at once otherwise);
        the ledger is a cache of the tiers, so a ledger that cannot be written (full
        disk, lock held) is logged, never fatal for the flush itself."""
        if self.ledger is None or not idents:
            return
        for ident in idents:
            self._buf.add(ident, set_state(ident, tier, state, reason, then, **kw), code)
        if not self._batching:
            self._buf.write()

    def hand_off(
        self,
        idents: Iterable[Ident],
        note: Optional[str] = None,
        then: Optional[Callable[[Record, float], None]] = None,
    ) -> None:
        """Leave these for later (``FLUSH_PENDING`` + note), in one ledger transaction."""
        self._mark(
            list(idents),
            self.dst,
            State.FLUSH_PENDING,
            note or self.hand_off_note,
            then=then,
            forced=True,
            selected_for_flush=True,
        )

    # -- one -----------------------------------------------------------------------
    def flush_one(
        self,
        ident: Ident,
        *,
        deadline: Optional[float] = None,
        min_s: float = 0.0,
        nbytes: int = 0,
    ) -> FlushResult:
        """Copy one checkpoint, unless less than ``max(min_s, MIN_SLICE_S)`` is left
        before ``deadline`` (then it is handed off)."""
        left = None if deadline is None else deadline - self.clock()
        if left is not None and left < max(min_s, MIN_SLICE_S):
            self.hand_off([ident])
            return FlushResult(ident, FlushStatus.HANDED, nbytes=nbytes)
        if self.slots is None:
            return self._copy_one(ident, left, nbytes)
        # Admission control: wait for a PFS slot with what the deadline leaves beyond the
        # copy's own need; no slot in time -> hand off, like any flush without time.
        budget = None if left is None else max(0.0, left - max(min_s, MIN_SLICE_S))
        t_ask = self.clock()
        with self.slots.slot(budget) as admitted:
            if not admitted:
                self.hand_off([ident])
                return FlushResult(
                    ident, FlushStatus.HANDED, nbytes=nbytes, error="no PFS slot in time"
                )
            if left is not None:
                left -= self.clock() - t_ask
            return self._copy_one(ident, left, nbytes)

    def _failed(self, hold: Optional[str]) -> Callable[[Record, float], None]:
        def then(rec: Record, now: float) -> None:
            self.retry.note_failure(rec, now, hold)

        return then

    def _copy_one(self, ident: Ident, left: Optional[float], nbytes: int) -> FlushResult:
        self._mark([ident], self.dst, State.FLUSHING)
        self._buf.write_if_due()  # a long copy shows as in flight (batched rounds)
        t0 = self.clock()
        try:
            res = self.copy(ident, left)
        except TimedOut as exc:
            took = self.clock() - t0
            hold = (exc.hold_code or "stopped") if exc.user_caused else None
            if hold is None and left is not None and took >= left - MIN_SLICE_S:
                self.hand_off([ident])  # the deadline's: the stager has more time
                return FlushResult(ident, FlushStatus.HANDED, nbytes=nbytes, error=str(exc))
            # Stopped by its owner, or hung: try later, and let the round go on.
            self.hand_off([ident], str(exc), then=self._failed(hold))
            return FlushResult(
                ident, FlushStatus.HANDED, nbytes=nbytes, error=str(exc), hold=hold, stuck=True
            )
        except NotFound as exc:
            self._mark([ident], self.src, State.DELETED, str(exc))
            return FlushResult(ident, FlushStatus.GONE, nbytes=nbytes, error=str(exc))
        except CkptError as exc:
            if exc.bad_source:
                return self._bad(ident, nbytes, exc)
            hold = (exc.hold_code or "owner") if exc.user_caused else None
            return self._fail(ident, nbytes, exc, hold, t0)

        def ok(rec: Record, _now: float) -> None:
            clear_failures(rec)

        self._mark(
            [ident],
            self.dst,
            State.VERIFIED,
            error=None,
            durations={"flush_s": res.seconds},
            then=ok,
        )
        return FlushResult(
            ident,
            FlushStatus.ALREADY if res.already_present else FlushStatus.FLUSHED,
            nbytes=res.nbytes,
            copied=res.copied_bytes,
            seconds=res.seconds,
        )

    def _bad(self, ident: Ident, nbytes: int, exc: CkptError) -> FlushResult:
        """Source ``BAD`` (the checkpoint itself can never be copied as it is: corrupt,
        unsafe), held under the exception's ``hold_code``."""
        code = exc.hold_code
        failed = self._failed(code)

        def bad(rec: Record, now: float) -> None:
            # Never copied: its destination state must not stay FLUSHING (status would
            # show it in flight forever).
            if rec.tiers.get(self.dst) == State.FLUSHING:
                del rec.tiers[self.dst]
            failed(rec, now)

        self._mark([ident], self.src, State.BAD, str(exc), code=code, then=bad)
        return FlushResult(ident, FlushStatus.BAD, nbytes=nbytes, error=str(exc), hold=code)

    def _fail(
        self, ident: Ident, nbytes: int, exc: CkptError, hold: Optional[str], t0: float
    ) -> FlushResult:
        """Destination ``FAILED``: retried after the backoff; ``hold`` when it was the
        owner's doing (then it never keeps the node drained)."""
        self._mark(
            [ident],
            self.dst,
            State.FAILED,
            str(exc),
            code=hold or "flush_failed",
            then=self._failed(hold),
        )
        return FlushResult(
            ident,
            FlushStatus.FAILED,
            nbytes=nbytes,
            error=str(exc),
            seconds=self.clock() - t0,
            hold=hold,
        )

    def _defer(self, ident: Ident, nbytes: int, first: FlushResult) -> FlushResult:
        """Put off a checkpoint whose owner's previous flush in this round got stuck:
        the round goes on with other users."""
        why = f"deferred: an earlier flush of {ident[0]} in this round did not finish"

        def then(rec: Record, now: float) -> None:
            self.retry.defer(rec, now, first.hold)

        self.hand_off([ident], why, then=then)
        return FlushResult(ident, FlushStatus.HANDED, nbytes=nbytes, error=why, hold=first.hold)

    def _turn_end(
        self, deadline: Optional[float], left: Optional[float], owners: int, nbytes: int
    ) -> Optional[float]:
        """The deadline of one copy while ``owners`` owners (its own included) still
        wait: its share of what is left, never less than its ``allowance``."""
        if deadline is None or left is None or self.allowance is None or owners <= 1:
            return deadline
        share = max(left / owners, self.allowance(nbytes))
        return min(deadline, self.clock() + share)

    # -- many ----------------------------------------------------------------------
    def flush_all(
        self,
        items: Iterable[Tuple[Ident, int]],
        deadline: Optional[float] = None,
        on_result: Optional[Callable[[FlushResult], None]] = None,
    ) -> FlushOutcome:
        """Flush ``(ident, nbytes)`` in order until ``deadline``; everything not started by
        then is handed off in one ledger transaction. Stops at the first KeyboardInterrupt
        (the rest stays owed)."""
        out = FlushOutcome()
        t0 = self.clock()
        todo = list(items)
        waiting = _owners_left([ident for ident, _n in todo])
        stuck: Dict[str, FlushResult] = {}  # owner -> their flush that got stuck
        self._batching = True
        try:
            for i, (ident, nbytes) in enumerate(todo):
                left = None if deadline is None else deadline - self.clock()
                if left is not None and left < MIN_SLICE_S:
                    rest = [it for it, _n in todo[i:]]
                    self.hand_off(rest)
                    out.results.extend(
                        FlushResult(it, FlushStatus.HANDED, nbytes=n) for it, n in todo[i:]
                    )
                    break
                first = stuck.get(ident[0])
                if first is not None:
                    res = self._defer(ident, nbytes, first)
                else:
                    turn = self._turn_end(deadline, left, waiting[i], nbytes)
                    res = self.flush_one(ident, deadline=turn, nbytes=nbytes)
                    if res.stuck:
                        stuck[ident[0]] = res
                out.results.append(res)
                if on_result is not None:
                    on_result(res)
                self._buf.write_if_due()
        finally:
            self._batching = False
            self._buf.write()
        out.seconds = self.clock() - t0
        return out


def _owners_left(idents: List[Ident]) -> List[int]:
    """For each position, how many distinct owners have checkpoints from there on."""
    out = [0] * len(idents)
    seen: Set[str] = set()
    for i in range(len(idents) - 1, -1, -1):
        seen.add(idents[i][0])
        out[i] = len(seen)
    return out
