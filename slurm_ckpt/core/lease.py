"""The lease record of a checkpoint series, and the generation check every commit makes.

Why: two processes writing one series (the same key, the same tiers) each commit steps
that look sound, and the series ends up a mix of both runs that every check calls OK.
So one writer holds a **lease** on its series (:mod:`slurm_ckpt.job.lease` takes and
keeps it), and every acquisition gets the next **generation number**. The generation is
written into every manifest the writer commits (``meta.generation``) and into the lease
record, on the local tier and on the warm tier. Before a commit the writer reads the
record of the tier it commits to: a newer generation there means another writer took the
series over, and this one (a stale writer: stopped, hung, on a node that was given up)
must not commit: :func:`check_generation` raises :class:`StaleGeneration`.

This module is pure (no tier, no SLURM, no torch): the record, its strict parser (a
record is written by the user and read by whoever writes next: hostile input) and the
decision helpers, for the job layer and for in-job recovery alike.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Optional

from slurm_ckpt.core.manifest import has_control
from slurm_ckpt.errors import CkptError

__all__ = [
    "LEASE_FILE",
    "LeaseRecord",
    "StaleGeneration",
    "check_generation",
    "generation_of",
    "holder_text",
]

#: The record's name in a series directory (``<root>/<user>/<key>/``; an object below the
#: series prefix on an object store). The ``.lock-`` prefix: never listed as a step, and
#: kept by every sweep and by the node's reclaim, like the per-step lock files.
LEASE_FILE = ".lock-lease.json"
#: Largest record accepted (a few hundred bytes are written).
_MAX_BYTES = 4096


class StaleGeneration(CkptError):
    """A newer writer holds the series: this one may not commit (it was taken over)."""


@dataclass(frozen=True)
class LeaseRecord:
    """Who writes a series: where, since when, as which generation, and whether still.

    ``pid_start`` is the process's start time (clock ticks since boot, from
    ``/proc/<pid>/stat``) so that a reused pid is not taken for the holder.
    ``heartbeat`` is refreshed while the holder runs (warm tier: other nodes judge a
    holder by it); ``released`` is set by a clean ``close()``.
    """

    key: str
    node: str
    pid: int
    generation: int
    since: float
    heartbeat: float
    job: Optional[str] = None
    pid_start: Optional[int] = None
    released: bool = False

    def to_bytes(self) -> bytes:
        return (json.dumps(asdict(self), sort_keys=True) + "\n").encode()

    def beat(self, now: Optional[float] = None) -> LeaseRecord:
        return replace(self, heartbeat=time.time() if now is None else now)

    @classmethod
    def from_bytes(cls, data: bytes) -> Optional[LeaseRecord]:
        """The record, or None when it is not one (damaged, foreign, from the future):
        the caller then acts as if there were none, and the next writer rewrites it."""
        if len(data) > _MAX_BYTES:
            return None
        try:
            doc = json.loads(data.decode("utf-8"))
            return cls(
                key=_text(doc["key"]),
                node=_text(doc["node"]),
                pid=_count(doc["pid"]),
                generation=_count(doc["generation"]),
                since=_time(doc["since"]),
                heartbeat=_time(doc["heartbeat"]),
                job=None if doc.get("job") is None else _text(doc["job"]),
                pid_start=None if doc.get("pid_start") is None else _count(doc["pid_start"]),
                released=_flag(doc.get("released", False)),
            )
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
            return None


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value or len(value) > 256 or has_control(value):
        raise ValueError("not a label")
    return value


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError("not a count")
    return value


def _time(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("not a time")
    out = float(value)
    if not math.isfinite(out) or out < 0:
        raise ValueError("not a time")
    return out


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("not a flag")
    return value


def holder_text(rec: LeaseRecord) -> str:
    """``pid P on node N since T`` (T in UTC, to the second), plus the job when known."""
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(rec.since))
    job = f", job {rec.job}" if rec.job else ""
    return f"pid {rec.pid} on node {rec.node} since {since} (generation {rec.generation}{job})"


def generation_of(meta: Any) -> int:
    """The generation a manifest's ``meta`` records (0: written before there were any)."""
    value = meta.get("generation") if isinstance(meta, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return 0
    return value


def check_generation(current: Optional[LeaseRecord], mine: int, where: str) -> None:
    """Raise :class:`StaleGeneration` when ``current`` (the series' record on the tier
    about to be committed to) names a newer generation than ``mine``: this writer was
    taken over and must not commit. No record (a tier never leased) passes."""
    if current is None or current.generation <= mine:
        return
    raise StaleGeneration(
        f"{where}: key {current.key} was taken over by {holder_text(current)}; this writer "
        f"(generation {mine}) may not commit any more"
    )
