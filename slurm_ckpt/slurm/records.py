"""What SLURM tells us about jobs and nodes, parsed from its text and JSON outputs.

:class:`JobInfo` and :class:`NodeInfo` are what every part of the toolkit gets, whichever
backend asked (``scontrol -o`` one-liners, ``squeue``/``sinfo --json``, pyslurm). The
drain-reason prefixes live here too: they are how a node's state says "ours".
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

from slurm_ckpt.errors import CkptError, SlurmError
from slurm_ckpt.slurm import hostlist

__all__ = [
    "FINAL_STATES",
    "MAINT_PREFIX",
    "REASON_PREFIX",
    "JobInfo",
    "JobNotFound",
    "NodeInfo",
    "job_from_json",
    "job_from_oneliner",
    "node_from_json",
    "node_from_oneliner",
    "parse_duration",
    "parse_oneliner",
    "parse_time",
]

REASON_PREFIX = "slurm_ckpt:"
#: Drains made by ``ckpt-slurm maint``: ours, but held for the admin's maintenance, so the
#: epilog and the stager neither overwrite nor resume them.
MAINT_PREFIX = "slurm_ckpt: maint:"

#: Job states after which the job will not run again by itself.
FINAL_STATES = frozenset(
    {
        "COMPLETED",
        "CANCELLED",
        "FAILED",
        "TIMEOUT",
        "NODE_FAIL",
        "BOOT_FAIL",
        "DEADLINE",
        "OUT_OF_MEMORY",
    }
)


class JobNotFound(SlurmError):
    """SLURM does not (or no longer) know this job."""


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class JobInfo:
    """A job as SLURM reports it. Times are epoch seconds; None when SLURM has none."""

    job_id: str
    state: str
    reason: Optional[str] = None
    name: Optional[str] = None
    user: Optional[str] = None
    restarts: int = 0
    start_time: Optional[float] = None
    end_time: Optional[float] = None
    #: Seconds; None = unlimited or unknown.
    time_limit: Optional[float] = None
    nodes: List[str] = field(default_factory=list)
    batch_host: Optional[str] = None
    requeue: Optional[bool] = None
    exit_code: Optional[str] = None
    raw: Dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def timed_out(self) -> bool:
        """Ended (or is ending) because it hit its time limit."""
        return self.state == "TIMEOUT" or (self.reason or "") == "TimeLimit"

    @property
    def preempted(self) -> bool:
        """Preempted (SLURM requeues or cancels it per PreemptMode; not our business)."""
        return self.state == "PREEMPTED" or "preempt" in (self.reason or "").lower()

    def seconds_left(self, now: Optional[float] = None) -> Optional[float]:
        """Time until the scheduled end, or None when it has no end time."""
        if self.end_time is None:
            return None
        return self.end_time - (time.time() if now is None else now)


@dataclass(frozen=True)
class NodeInfo:
    """A node as SLURM reports it: base state (``IDLE``), flags (``DRAIN``...), reason."""

    name: str
    state: str
    flags: FrozenSet[str] = frozenset()
    reason: Optional[str] = None
    reason_user: Optional[str] = None
    reason_time: Optional[float] = None
    raw: Dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def drained(self) -> bool:
        """DRAIN set (draining while jobs run, or drained)."""
        return "DRAIN" in self.flags

    @property
    def reason_is_ours(self) -> bool:
        return (self.reason or "").startswith(REASON_PREFIX)

    @property
    def held_for_maint(self) -> bool:
        return (self.reason or "").startswith(MAINT_PREFIX)

    @property
    def state_string(self) -> str:
        return "+".join([self.state, *sorted(self.flags)])


# --------------------------------------------------------------------------- parsing

_KEY_RE = re.compile(r"^([A-Z][A-Za-z0-9_:/()]*)=(.*)$", re.S)
# scontrol appends "[user@time]" to a node's reason.
_REASON_TAIL_RE = re.compile(r"^(.*?)\s*\[([^\]@\s]+)@([0-9T:-]+)\]\s*$", re.S)
_TIME_UNSET = {"", "Unknown", "None", "N/A", "(null)", "0"}


def parse_oneliner(line: str) -> Dict[str, str]:
    """``scontrol show ... -o`` output -> dict.

    Fields are separated by single spaces and keys are CamelCase (``JobState=``,
    ``NodeList=``); a space-separated token that does not start with ``Key=`` continues
    the previous value (``Reason=`` of a node, ``Command=``, a job name with spaces).
    Lower-case ``word=value`` tokens inside such a value do not start a new field.
    """
    out: Dict[str, str] = {}
    key: Optional[str] = None
    for tok in line.rstrip("\n").split(" "):
        m = _KEY_RE.match(tok)
        if m and (key is None or m.group(1) not in out):
            key = m.group(1)
            out[key] = m.group(2)
        elif key is not None:
            out[key] += " " + tok
    return out


def parse_time(text: Optional[str]) -> Optional[float]:
    """``2026-11-29T08:52:04`` (local time, SLURM's standard format) -> epoch seconds."""
    if text is None or text.strip() in _TIME_UNSET:
        return None
    value = text.strip()
    if value.isdigit():
        return float(value)
    try:
        return time.mktime(time.strptime(value, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def parse_duration(text: Optional[str]) -> Optional[float]:
    """SLURM's ``[days-]hours:minutes:seconds`` (also ``minutes:seconds``) -> seconds.

    ``UNLIMITED``, ``Partition_Limit``, ``NOT_SET`` and the like give None.
    """
    if text is None:
        return None
    value = text.strip()
    m = re.match(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$", value)
    if not m:
        return None
    days = int(m.group(1) or 0)
    parts = [int(p) for p in m.group(2, 3, 4) if p is not None]
    if m.group(1) is not None:
        while len(parts) < 3:
            parts.append(0)  # "1-2" = 1 day 2 hours
        h, mi, s = parts
    elif len(parts) == 3:
        h, mi, s = parts
    elif len(parts) == 2:
        h, mi, s = 0, parts[0], parts[1]
    else:
        h, mi, s = 0, parts[0], 0  # a bare number is minutes
    return float(((days * 24 + h) * 60 + mi) * 60 + s)


def split_state(text: str) -> Tuple[str, FrozenSet[str]]:
    parts = [p for p in text.strip().upper().split("+") if p]
    if not parts:
        return "UNKNOWN", frozenset()
    base = parts[0].rstrip("*~#!%$@^-")
    return base, frozenset(parts[1:])


def _user_of(text: Optional[str]) -> Optional[str]:
    """``ckptuser1(1001)`` -> ``ckptuser1``."""
    if not text:
        return None
    return text.split("(", 1)[0] or None


def nodes_of(text: Optional[str]) -> List[str]:
    if not text or text in ("(null)", "None", ""):
        return []
    try:
        return hostlist.expand(text)
    except CkptError:
        return []


def job_from_oneliner(fields: Dict[str, str]) -> JobInfo:
    """A :class:`JobInfo` from ``scontrol show job -o`` fields."""
    try:
        restarts = int(fields.get("Restarts", "0"))
    except ValueError:
        restarts = 0
    requeue = fields.get("Requeue")
    reason = fields.get("Reason")
    return JobInfo(
        job_id=fields.get("JobId", ""),
        state=fields.get("JobState", "UNKNOWN").upper(),
        reason=None if reason in (None, "None", "(null)") else reason,
        name=fields.get("JobName"),
        user=_user_of(fields.get("UserId")),
        restarts=restarts,
        start_time=parse_time(fields.get("StartTime")),
        end_time=parse_time(fields.get("EndTime")),
        time_limit=parse_duration(fields.get("TimeLimit")),
        nodes=nodes_of(fields.get("NodeList")),
        batch_host=None if fields.get("BatchHost") in (None, "(null)") else fields["BatchHost"],
        requeue=None if requeue is None else requeue == "1",
        exit_code=fields.get("ExitCode"),
        raw=dict(fields),
    )


def node_from_oneliner(fields: Dict[str, str]) -> NodeInfo:
    """A :class:`NodeInfo` from ``scontrol show node -o`` fields."""
    state, flags = split_state(fields.get("State", "UNKNOWN"))
    reason = fields.get("Reason")
    who = when = None
    if reason is not None:
        m = _REASON_TAIL_RE.match(reason)
        if m:
            reason, who = m.group(1), m.group(2)
            when = parse_time(m.group(3))
        reason = reason.strip() or None
    return NodeInfo(
        name=fields.get("NodeName", ""),
        state=state,
        flags=flags,
        reason=reason,
        reason_user=who,
        reason_time=when,
        raw=dict(fields),
    )


def epoch_seconds(value: Any) -> Optional[float]:
    if isinstance(value, dict):  # newer JSON: {"set": true, "number": N}
        if not value.get("set", True):
            return None
        value = value.get("number")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    return None


def job_from_json(j: Dict[str, Any]) -> JobInfo:
    """A :class:`JobInfo` from one entry of ``squeue --json``."""
    state = j.get("job_state")
    if isinstance(state, list):
        state = state[0] if state else "UNKNOWN"
    limit = j.get("time_limit")
    limit_min = epoch_seconds(limit)
    reason = j.get("state_reason")
    return JobInfo(
        job_id=str(j.get("job_id", "")),
        state=str(state or "UNKNOWN").upper(),
        reason=None if reason in (None, "None") else str(reason),
        name=j.get("name"),
        user=j.get("user_name"),
        restarts=int(j.get("restart_cnt") or 0),
        start_time=epoch_seconds(j.get("start_time")),
        end_time=epoch_seconds(j.get("end_time")),
        time_limit=None if limit_min is None else limit_min * 60.0,
        nodes=nodes_of(j.get("nodes")),
        batch_host=j.get("batch_host") or None,
        requeue=j.get("requeue"),
        raw=j,
    )


def node_from_json(n: Dict[str, Any]) -> NodeInfo:
    """A :class:`NodeInfo` from one entry of ``sinfo --json``."""
    state = n.get("state")
    if isinstance(state, list):  # newer SLURMs: ["IDLE", "DRAIN"]
        base, flags = (state[0] if state else "UNKNOWN"), state[1:]
    else:
        base, flags = str(state or "UNKNOWN"), n.get("state_flags") or []
    reason = n.get("reason") or None
    return NodeInfo(
        name=str(n.get("name", "")),
        state=str(base).upper(),
        flags=frozenset(str(f).upper() for f in flags),
        reason=reason,
        reason_user=n.get("reason_set_by_user") or None,
        reason_time=epoch_seconds(n.get("reason_changed_at")),
        raw=n,
    )
