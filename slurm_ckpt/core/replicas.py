"""Do replicas agree? The verdict over the digests that data-parallel replicas gathered.

Why: storage checksums catch a bit that flips on a disk, not one that flips in a GPU's
memory or arithmetic before the save. Data-parallel replicas of one shard (the ranks of
a DDP job; the replicated dimension of HSDP) must hold bit-identical parameters, and
every save already hashes each file it writes (xxh3-128, the manifest's ``hash``). So
the replicas exchange those 16-byte digests at each save and compare them: a rank whose
digest differs from its set's majority holds state that no longer matches the others',
and the step is **suspect** - kept, listed as such, never chosen by an automatic
restore (:mod:`slurm_ckpt.job.replicas` does the exchange, off the training's critical
path).

The verdict is the same on every rank (each one sees every rank's record), and it is
recorded in every rank's manifest of the step as ``meta.replicas`` (:func:`verdict_meta`),
so a restore anywhere, ``status`` and ``list`` see it without a side channel.

Who is named: within one replica set and one file, the ranks whose digest differs from
a strict majority's. With no strict majority (two replicas that differ, or a three-way
split) no one can tell which is right: every rank of the set is named. Pure: no I/O.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

__all__ = [
    "ReplicaRecord",
    "Verdict",
    "compare",
    "newest_pin",
    "not_automatic",
    "pin_of",
    "suspect_of",
    "suspect_text",
    "verdict_meta",
]

#: Ranks and nodes a manifest names at most (a job of 10,000 ranks where every one
#: differs must not make a manifest of megabytes; the count is kept).
MAX_NAMED = 64
#: A node name shown from a manifest (user-written text: nothing else is printed).
_NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass(frozen=True)
class ReplicaRecord:
    """What one rank contributes to a step's comparison: its replica set (any id the
    ranks of one set share), its node, the step it saved, and the digests of the files
    that must be identical across its set (relative to the rank's own payload
    directory; None when its write failed before they were hashed)."""

    rank: int
    node: str
    replica_set: int
    step: int
    digests: Optional[Mapping[str, str]]


@dataclass
class Verdict:
    """The outcome for one step: ``suspect`` with the ranks and nodes that differ from
    their set's majority, and the files that differ; ``checked`` replica sets of two
    or more ranks were compared; ``skipped`` says why a comparison could not be made
    (a rank's write failed, the ranks saved different steps)."""

    step: int
    suspect: bool = False
    ranks: List[int] = field(default_factory=list)
    nodes: List[str] = field(default_factory=list)
    files: List[str] = field(default_factory=list)
    checked: int = 0
    skipped: Optional[str] = None

    def describe(self) -> str:
        """One line for the log and the event."""
        if self.skipped:
            return f"step {self.step}: replicas not compared ({self.skipped})"
        if not self.suspect:
            return f"step {self.step}: {self.checked} replica set(s) agree"
        return (
            f"step {self.step} is suspect: rank(s) {_short(self.ranks)} on node(s) "
            f"{_short(self.nodes)} differ from their replicas in {_short(self.files)}"
        )


def _short(items: Sequence[Any], n: int = 8) -> str:
    head = ", ".join(str(x) for x in items[:n])
    return head + (f" (+{len(items) - n} more)" if len(items) > n else "")


def compare(step: int, records: Sequence[ReplicaRecord]) -> Verdict:
    """The verdict over every rank's record of ``step`` (the same on every rank)."""
    v = Verdict(step=step)
    other = sorted({r.step for r in records if r.step != step})
    if other:
        v.skipped = f"ranks saved other steps: {_short(other)}"
        return v
    failed = sorted(r.rank for r in records if r.digests is None)
    if failed:
        v.skipped = f"rank(s) {_short(failed)} wrote no checkpoint"
        return v
    sets: Dict[int, List[ReplicaRecord]] = {}
    for r in records:
        sets.setdefault(r.replica_set, []).append(r)
    differ: Dict[int, str] = {}
    files: set = set()
    for members in sets.values():
        if len(members) < 2:
            continue
        v.checked += 1
        names = sorted({n for r in members for n in (r.digests or {})})
        for name in names:
            votes = Counter((r.digests or {}).get(name) for r in members)
            if len(votes) == 1:
                continue
            files.add(name)
            top, count = votes.most_common(1)[0]
            majority = top if count * 2 > len(members) else object()
            for r in members:
                if (r.digests or {}).get(name) != majority:
                    differ[r.rank] = r.node
    if differ:
        v.suspect = True
        v.ranks = sorted(differ)
        v.nodes = sorted(set(differ.values()))
        v.files = sorted(files)
    return v


def verdict_meta(v: Verdict) -> Dict[str, Any]:
    """The manifest's ``meta.replicas`` for a verdict (bounded, JSON)."""
    out: Dict[str, Any] = {"checked": v.checked, "suspect": v.suspect}
    if v.skipped:
        out["skipped"] = v.skipped[:200]
    if v.suspect:
        out["ranks"] = v.ranks[:MAX_NAMED]
        out["nodes"] = v.nodes[:MAX_NAMED]
        out["files"] = v.files[:MAX_NAMED]
        out["differ"] = len(v.ranks)
    return out


def suspect_of(meta: Any) -> Optional[Tuple[List[Any], List[Any]]]:
    """``(ranks, nodes)`` when a manifest's ``meta`` records a suspect step, else None
    (anything malformed reads as not suspect: meta is a user's text)."""
    if not isinstance(meta, dict):
        return None
    rep = meta.get("replicas")
    if not isinstance(rep, dict) or rep.get("suspect") is not True:
        return None
    ranks = rep.get("ranks")
    nodes = rep.get("nodes")
    return (
        [r for r in ranks if isinstance(r, int)] if isinstance(ranks, list) else [],
        [n for n in nodes if isinstance(n, str) and _NODE.fullmatch(n)]
        if isinstance(nodes, list)
        else [],
    )


def pin_of(meta: Any) -> Optional[Tuple[int, float]]:
    """The ``last_healthy`` pin a manifest records, ``(step, when)``: the steps after
    ``step`` saved until ``when`` are unhealthy (a NaN or loss-spike detector said so,
    ``Checkpointer.pin_last_healthy``). None when it records none (or garbage)."""
    if not isinstance(meta, dict):
        return None
    pin = meta.get("last_healthy")
    if not isinstance(pin, dict):
        return None
    step, at = pin.get("step"), pin.get("at")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return None
    if isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at):
        return None
    return step, float(at)


def newest_pin(pins: Iterable[Optional[Tuple[int, float]]]) -> Optional[Tuple[int, float]]:
    """The pin in force: the one set last."""
    have = [p for p in pins if p is not None]
    return max(have, key=lambda p: (p[1], -p[0])) if have else None


def not_automatic(
    step: int, meta: Any, wall_time: float, pin: Optional[Tuple[int, float]]
) -> Optional[str]:
    """Why an automatic restore must not pick this step (None: it may): the replicas
    did not agree on it, or it lies after the ``last_healthy`` pin and was saved before
    the pin was set."""
    text = suspect_text(meta)
    if text is not None:
        return text
    if pin is not None and step > pin[0] and wall_time <= pin[1]:
        return f"after the last healthy step {pin[0]} (pinned)"
    return None


def suspect_text(meta: Any) -> Optional[str]:
    """What ``list`` and ``status`` say of a suspect step (None: it is not one)."""
    bad = suspect_of(meta)
    if bad is None:
        return None
    ranks, nodes = bad
    return f"suspect: replicas differ, rank(s) {_short(ranks)} on {_short(nodes)}"
