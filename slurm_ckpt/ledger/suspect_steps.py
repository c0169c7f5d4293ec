"""Suspect steps counted once each: the memory behind ``slurm_ckpt_suspect_steps_total``.

Why a memory and not a count of events: every rank of a job emits a ``replicas_suspect``
event for the same step (the verdict is the same on every rank), and root's hooks find
the same flagged manifest at every scan - prolog, epilog, stager, root's flush. The
counter must say how many *steps* were suspect, so the event log's summary remembers
which ``(user, key, step)`` it counted; a rank's series ``KEY.rankNNNNN`` (or
``KEY.dcp.rankNNNNN``) counts as ``KEY``.

The memory is bounded whoever writes the events: root's summary holds what users'
manifests say, and a user may forge as many suspect steps as they like. Per series it
keeps the newest :data:`STEPS_KEPT` steps, and a step older than all of them once that
is full counts as counted already (so a scan that lists thousands of forged steps,
newest first, records at most that many); per user :data:`SERIES_PER_USER` series, and
:data:`SERIES_KEPT` in all, the least recently counted going first. What is forgotten
may be counted again if it is seen again: the count is a fact to alert on, never a
decision. Pure: works on the summary document; :mod:`slurm_ckpt.ledger.events` holds
the lock around it.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from slurm_ckpt.core.names import base_key

__all__ = [
    "SERIES_KEPT",
    "SERIES_PER_USER",
    "STEPS_KEPT",
    "SUSPECT",
    "count_of",
    "remember",
    "seen",
]

#: The replicas of a saved step did not agree (:mod:`slurm_ckpt.core.replicas`).
SUSPECT = "replicas_suspect"
STEPS_KEPT = 32
SERIES_PER_USER = 8
SERIES_KEPT = 128
_FIELD = "suspect"


def count_of(doc: Dict[str, Any]) -> int:
    """The suspect steps a summary counted (0 for one that counted none, or garbage)."""
    n = doc.get("suspect_steps")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0


def _ident(event: Dict[str, Any]) -> Optional[Tuple[str, int]]:
    """``(user/KEY, step)`` of a suspect event, or None when it names no series and
    step (then it counts, unremembered: nothing to tell it apart by)."""
    user, key, step = event.get("user"), event.get("key"), event.get("step")
    if not (isinstance(user, str) and user and isinstance(key, str) and key):
        return None
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return None
    return f"{user[:64]}/{base_key(key)[:128]}", step


def _memory(doc: Dict[str, Any]) -> Dict[str, Any]:
    mem = doc.get(_FIELD)
    if not isinstance(mem, dict):
        mem = doc[_FIELD] = {}
    return mem


def _steps(entry: Any) -> List[int]:
    steps = entry.get("steps") if isinstance(entry, dict) else None
    if not isinstance(steps, list):
        return []
    return sorted({s for s in steps if isinstance(s, int) and not isinstance(s, bool)})


def _when(entry: Any) -> float:
    ts = entry.get("ts") if isinstance(entry, dict) else None
    return float(ts) if isinstance(ts, (int, float)) and not isinstance(ts, bool) else 0.0


def seen(doc: Dict[str, Any], event: Dict[str, Any]) -> bool:
    """Whether the summary ``doc`` counted this suspect step already: it remembers it,
    or its series' memory is full of newer steps."""
    ident = _ident(event)
    if ident is None:
        return False
    steps = _steps(_memory(doc).get(ident[0]))
    return ident[1] in steps or (len(steps) >= STEPS_KEPT and ident[1] < steps[0])


def remember(doc: Dict[str, Any], event: Dict[str, Any]) -> bool:
    """Remember a suspect step in ``doc``; True when it was not counted before."""
    if seen(doc, event):
        return False
    ident = _ident(event)
    if ident is None:
        return True
    label, step = ident
    mem = _memory(doc)
    steps = sorted([*_steps(mem.pop(label, None)), step])[-STEPS_KEPT:]
    mem[label] = {"steps": steps, "ts": _when(event)}
    user = label.split("/", 1)[0] + "/"
    mine = [k for k in mem if k.startswith(user) and k != label]
    while len(mine) >= SERIES_PER_USER:
        drop = min(mine, key=lambda k: _when(mem[k]))
        mine.remove(drop)
        del mem[drop]
    while len(mem) > SERIES_KEPT:
        del mem[min((k for k in mem if k != label), key=lambda k: _when(mem[k]))]
    return True
