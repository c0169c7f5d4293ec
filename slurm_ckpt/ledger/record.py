"""One checkpoint as a node's ledger knows it: its identity and its state on each tier.

``Ident`` ``(user, key, step)`` names a checkpoint everywhere in the toolkit; a
:class:`Record` holds what one node knows of it (the ledger stores many of them), and
:class:`State` is the life cycle of one copy on one tier.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, Optional, Tuple

from slurm_ckpt.core.retention import CkptInfo
from slurm_ckpt.errors import InvalidName

__all__ = [
    "FAILED_STATES",
    "LIVE_LOCAL",
    "NOT_PENDING_WARM",
    "Ident",
    "Record",
    "State",
    "check_ident",
    "check_tier",
    "is_held",
    "is_pending",
    "WARM_SLOT",
    "apply_fields",
    "merge_durations",
    "one_line",
    "shown_tier",
]

MAX_REASON = 500
_TIER_RE = re.compile(r"[a-z][a-z0-9_-]{0,31}")

#: The ledger's on-disk key for the warm tier's slot in a record's ``tiers`` (and its
#: ``committed_at``/``verified_at``/... dicts): "owed to / verified on the warm tier",
#: whatever that tier is (the PFS, or the object store on a site without one:
#: ``cfg.tiers.warm``). It stays ``"pfs"`` because ledgers already on disk say so; code
#: says ``WARM_SLOT`` and never the literal, and what people see names the configured
#: warm tier (:func:`shown_tier`).
WARM_SLOT = "pfs"

#: A checkpoint's identity: ``(user, key, step)``.
Ident = Tuple[str, str, int]


class State(str, Enum):
    """State of one checkpoint on one tier."""

    WRITING = "WRITING"  # being written, no manifest yet
    COMMITTED = "COMMITTED"  # manifest committed, not (re)verified
    VERIFIED = "VERIFIED"  # bytes checked against the manifest
    FLUSH_PENDING = "FLUSH_PENDING"  # selected for copying to this tier, not started
    FLUSHING = "FLUSHING"  # a copy to this tier is in progress
    FAILED = "FAILED"  # the last copy attempt failed (may be retried)
    BAD = "BAD"  # failed verification on this tier
    DELETED = "DELETED"  # removed from this tier (retention, GC, or found missing)


STATES = {s.value: s for s in State}
LIVE_LOCAL = (State.COMMITTED.value, State.VERIFIED.value)
NOT_PENDING_WARM = (State.VERIFIED.value, State.DELETED.value)
FAILED_STATES = (State.FAILED.value, State.BAD.value)


def one_line(text: object, limit: int = MAX_REASON) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def check_tier(tier: str) -> str:
    if not isinstance(tier, str) or not _TIER_RE.fullmatch(tier):
        raise InvalidName(f"tier name {tier!r}: use lower-case letters, digits, '-', '_'")
    return tier


# -- records ------------------------------------------------------------------------------


@dataclass
class Record:
    """One checkpoint ``(user, key, step)`` as this node knows it.

    ``tiers`` maps a tier name to a :class:`State` (a state written by a newer version of
    this software that this one does not know stays a plain string). ``committed_at``,
    ``flush_started_at`` and ``verified_at`` map a tier name to epoch seconds. ``seq`` is the
    0-based position of the save in its run (-1: unknown). ``durations`` holds metrics such
    as ``snapshot_s``, ``local_s``, ``flush_s``. ``extra`` keeps fields this version does
    not know, so they survive a rewrite.
    """

    user: str
    key: str
    step: int
    tiers: Dict[str, str] = field(default_factory=dict)
    nbytes: int = 0
    seq: int = -1
    selected_for_flush: bool = False
    forced: bool = False
    pinned: bool = False
    job: Optional[str] = None
    committed_at: Dict[str, float] = field(default_factory=dict)
    flush_started_at: Dict[str, float] = field(default_factory=dict)
    verified_at: Dict[str, float] = field(default_factory=dict)
    error: Optional[str] = None
    attempts: int = 0
    durations: Dict[str, float] = field(default_factory=dict)
    created_at: float = 0.0
    updated_at: float = 0.0
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def ident(self) -> Ident:
        return (self.user, self.key, self.step)

    def state(self, tier: str) -> Optional[State]:
        """The state on ``tier`` (None: no state there, or one this version does not know)."""
        value = self.tiers.get(tier)
        return None if value is None else STATES.get(getattr(value, "value", value))

    @property
    def needs_flush(self) -> bool:
        return bool(self.selected_for_flush or self.forced)

    @property
    def pending_flush(self) -> bool:
        """Committed locally, must reach the PFS, and has no verified (or retired) copy there."""
        return is_pending(self.tiers, self.selected_for_flush, self.forced)

    def set_state(self, tier: str, state: State, now: float, reason: Optional[str] = None) -> None:
        """Move this checkpoint's copy on ``tier`` to ``state`` at ``now``: the one place
        the timestamps and the attempt count follow a state change. ``COMMITTED`` stamps
        ``committed_at``, ``FLUSHING`` stamps ``flush_started_at`` and counts an attempt,
        ``VERIFIED`` stamps ``verified_at``. ``reason`` (one line) becomes the last error;
        a failure without one records its state name."""
        self.tiers[tier] = state
        if state is State.COMMITTED:
            self.committed_at[tier] = now
        elif state is State.FLUSHING:
            self.flush_started_at[tier] = now
            self.attempts += 1
        elif state is State.VERIFIED:
            self.verified_at[tier] = now
            self.committed_at.setdefault(tier, now)
        if reason is not None:
            self.error = one_line(reason)
        elif state in (State.FAILED, State.BAD) and self.error is None:
            self.error = state.value

    def to_local_info(self) -> CkptInfo:
        """This record as the local retention planner sees it."""
        return CkptInfo(
            step=self.step,
            wall_time=self.committed_at.get("local", self.created_at),
            seq=self.seq,
            nbytes=self.nbytes,
            selected_for_flush=self.selected_for_flush,
            forced=self.forced,
            pinned=self.pinned,
            verified=self.tiers.get("local") == State.VERIFIED.value,
            warm_verified=self.tiers.get(WARM_SLOT) == State.VERIFIED.value,
            next_tier_verified=None,
        )


def is_pending(tiers: Dict[str, Any], selected: Any, forced: Any) -> bool:
    return bool(
        (selected or forced)
        and tiers.get("local") in LIVE_LOCAL
        and tiers.get(WARM_SLOT) not in NOT_PENDING_WARM
    )


def shown_tier(slot: Any, warm: str) -> Any:
    """The tier a ledger slot name stands for on a site whose warm tier is ``warm``."""
    return warm if slot == WARM_SLOT else slot


def is_held(fields: Any) -> bool:
    """Owed to the warm tier but no reason to keep a node drained: held because of its owner's
    doing (``hold``), or given up after the retry limit (``gave_up``); see
    :mod:`slurm_ckpt.node.retry`. ``fields``: a raw record or a record's ``extra``."""
    return bool(fields.get("hold") or fields.get("gave_up"))


def check_ident(user: str, key: str, step: int) -> None:
    if not isinstance(user, str) or not user or not isinstance(key, str) or not key:
        raise InvalidName(f"ledger record needs a user and a key, got {user!r}/{key!r}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InvalidName(f"checkpoint step must be a whole number >= 0, got {step!r}")


def merge_durations(rec: Record, durations: Optional[Dict[str, float]]) -> None:
    for name, value in (durations or {}).items():
        v = float(value)
        if math.isfinite(v):
            rec.durations[str(name)] = v


def apply_fields(rec: Record, fields: Dict[str, Any]) -> None:
    """Set the mutable fields a mark carries: durations merge (a later phase adds its own
    timing without erasing the earlier ones), a job id is stored as text."""
    for name, value in fields.items():
        if name == "durations":
            merge_durations(rec, value)
        elif name == "job":
            rec.job = None if value is None else str(value)
        else:
            setattr(rec, name, value)
