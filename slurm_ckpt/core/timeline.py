"""A job's timeline, and the goodput measured from it (``ckpt-slurm goodput JOB``).

Why a timeline of its own: the model in :mod:`slurm_ckpt.core.goodput` says what failures
*should* cost; this says what they *did* cost one job. Two writers append JSON lines to a
directory of the job (``<warm root>/<user>/.slurm_ckpt/jobs/<job>/``, which ckpt-srun makes
and names in ``$SLURM_CKPT_TIMELINE``):

* ckpt-srun (``srun.jsonl``): ``start``; ``step_start`` (each launch, ``relaunch`` = how
  many before); ``node_lost`` (the nodes, when they were last heard from, how they were
  found, ``at`` when the verdict fell); ``step_end`` (its status); ``end``;
* rank 0's Checkpointer (``rank0.jsonl``): ``restored`` (step, tier, seconds) and
  ``progress`` (the step, at most every :data:`PROGRESS_S` seconds, from
  ``should_save``).

In-job recovery (``ckpt-srun --in-job``) adds ``in_job_reform`` to ckpt-srun's records
(the new epoch written: the spare named in the lost rank's place) and, from rank 0's
recovery layer, ``reform_end`` (epoch, the step all ranks agreed on, the tier it came
from, ``recomputed`` steps, ``seconds`` since the failure, ``restore_s``). A loss repaired
in the job is reported with ``mode = "in_job"``: **recovery** is the verdict to the new
epoch, **re-form** the new epoch to the ranks' agreement minus the restore, **restore**
and **steps recomputed** as the ranks measured them.

From them, per failure: **detection** (last heartbeat to the verdict), **recovery** (the
verdict to the relaunched step's start), **restore** (the restored rank 0's read),
**training again** (the node's last heartbeat to the first progress after the restore)
and the **steps recomputed** (the newest step reported before the loss minus the step
restored; progress is reported every few seconds, so this is exact to that granularity).
**Productive time** is wall time minus every failure's downtime, minus the time spent
recomputing lost steps (at the job's mean step time), minus the start-up before the first
step. Everything here is plain arithmetic on what the files say; the files are the
user's, so every field is checked and a malformed line is skipped, never trusted.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterable, List, Optional

__all__ = [
    "PROGRESS_S",
    "Failure",
    "Goodput",
    "analyze",
    "parse_lines",
]

#: Seconds between two ``progress`` records of rank 0.
PROGRESS_S = 5.0
#: Lines read per file at most (a hostile file costs bounded time and memory).
MAX_LINES = 200_000


def _num(v: Any) -> Optional[float]:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def parse_lines(lines: Iterable[str]) -> List[Dict[str, Any]]:
    """The records of one file: JSON objects with a finite ``t`` and a string ``event``;
    anything else is skipped. Sorted by time."""
    out = []
    for i, line in enumerate(lines):
        if i >= MAX_LINES:
            break
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("event"), str):
            continue
        t = _num(rec.get("t"))
        if t is None:
            continue
        rec["t"] = t
        out.append(rec)
    out.sort(key=lambda r: r["t"])
    return out


@dataclass
class Failure:
    """What one node loss cost (seconds; None where the timeline does not say)."""

    nodes: List[str]
    last_heard: float
    detected: float
    detection_s: float
    recovery_s: Optional[float] = None
    restore_s: Optional[float] = None
    training_again_s: Optional[float] = None
    restored_step: Optional[int] = None
    steps_recomputed: Optional[int] = None
    found_by: str = "?"
    #: ``relaunch`` (the step relaunched) or ``in_job`` (a spare took the rank in the job).
    mode: str = "relaunch"
    #: In-job: the new epoch to the ranks' agreement on a step, without the restore.
    reform_s: Optional[float] = None


@dataclass
class Goodput:
    """A job's goodput, measured (see the module docstring)."""

    job: str
    wall_s: float
    productive_s: float
    startup_s: float
    mean_step_s: Optional[float]
    failures: List[Failure] = field(default_factory=list)

    @property
    def goodput(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def steps_recomputed(self) -> int:
        return sum(f.steps_recomputed or 0 for f in self.failures)

    def to_json(self) -> Dict[str, Any]:
        doc = {k: v for k, v in asdict(self).items() if k != "failures"}
        doc["goodput"] = round(self.goodput, 4)
        doc["steps_recomputed"] = self.steps_recomputed
        doc["failures"] = [asdict(f) for f in self.failures]
        return doc


def _int(v: Any) -> Optional[int]:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def analyze(job: str, srun: List[Dict[str, Any]], rank0: List[Dict[str, Any]]) -> Goodput:
    """The goodput of ``job`` from its two record lists (:func:`parse_lines`)."""
    everything = srun + rank0
    if not everything:
        raise ValueError("empty timeline")
    start = next((r["t"] for r in srun if r["event"] == "start"), everything[0]["t"])
    end = next((r["t"] for r in reversed(srun) if r["event"] == "end"), None)
    end = end if end is not None else max(r["t"] for r in everything)
    progress = [(r["t"], _int(r.get("step"))) for r in rank0 if r["event"] == "progress"]
    progress = [(t, s) for t, s in progress if s is not None]
    restores = [r for r in rank0 if r["event"] == "restored"]
    starts = [r["t"] for r in srun if r["event"] == "step_start"]
    reforms = [r for r in srun if r["event"] == "in_job_reform"]
    reform_ends = [r for r in rank0 if r["event"] == "reform_end"]
    first_progress = progress[0][0] if progress else end
    startup = max(0.0, first_progress - start)
    mean_step = _mean_step(progress)
    failures: List[Failure] = []
    for r in srun:
        if r["event"] != "node_lost":
            continue
        at = _num(r.get("at"))  # the verdict, before the dead step was stopped
        detected = at if at is not None and at <= r["t"] else r["t"]
        heard = _num(r.get("last_heard"))
        heard = detected if heard is None or heard > detected else heard
        nodes = [n for n in r.get("nodes", []) if isinstance(n, str)][:64]
        f = Failure(nodes, heard, detected, detected - heard, found_by=str(r.get("by", "?"))[:32])
        relaunch = next((t for t in starts if t >= detected), None)
        reform = next((x for x in reforms if x["t"] >= r["t"]), None)
        if reform is not None and (relaunch is None or reform["t"] <= relaunch):
            _in_job(f, reform, reform_ends, progress, heard)
        elif relaunch is not None:
            f.recovery_s = relaunch - detected
            rest = next((x for x in restores if x["t"] >= relaunch), None)
            if rest is not None:
                f.restore_s = _num(rest.get("seconds"))
                f.restored_step = _int(rest.get("step"))
                again = next((t for t, _ in progress if t >= rest["t"]), rest["t"])
                f.training_again_s = again - heard
        before = [s for t, s in progress if t <= heard]
        if f.mode == "relaunch" and before and f.restored_step is not None:
            f.steps_recomputed = max(0, max(before) - f.restored_step)
        failures.append(f)
    down = sum(f.training_again_s or (end - f.last_heard) for f in failures)
    redo = sum((f.steps_recomputed or 0) * (mean_step or 0.0) for f in failures)
    wall = max(0.0, end - start)
    productive = max(0.0, wall - startup - down - redo)
    return Goodput(job, wall, productive, startup, mean_step, failures)


def _in_job(
    f: Failure,
    reform: Dict[str, Any],
    ends: List[Dict[str, Any]],
    progress: List[Any],
    heard: float,
) -> None:
    """Fill ``f`` for a loss repaired inside the job: the coordinator's new epoch, then
    rank 0's ``reform_end`` of that epoch (its step, restore time, steps recomputed)."""
    f.mode = "in_job"
    f.recovery_s = reform["t"] - f.detected
    epoch = _int(reform.get("epoch"))
    done = next((x for x in ends if x["t"] >= reform["t"] and _int(x.get("epoch")) == epoch), None)
    if done is None:
        return
    f.restore_s = _num(done.get("restore_s"))
    f.restored_step = _int(done.get("step"))
    f.steps_recomputed = _int(done.get("recomputed"))
    f.reform_s = max(0.0, done["t"] - reform["t"] - (f.restore_s or 0.0))
    again = next((t for t, _ in progress if t >= done["t"]), done["t"])
    f.training_again_s = again - heard


def _mean_step(progress: List[Any]) -> Optional[float]:
    """Seconds per step over the reports that advanced (a restart's step back is skipped)."""
    secs = steps = 0.0
    for (t0, s0), (t1, s1) in zip(progress, progress[1:]):
        if s1 > s0:
            secs += t1 - t0
            steps += s1 - s0
    return secs / steps if steps else None


#: The environment variable ckpt-srun sets for the step: the job's timeline directory.
TIMELINE_ENV = "SLURM_CKPT_TIMELINE"


def append_record(path: str, event: str, **fields: Any) -> None:
    """Append one record (a JSON line, the time added) to ``path``: ``O_APPEND`` (one
    ``write`` per record), never following a symlink, created 0600. OSError goes to the
    caller (the writers log it once and go on: a timeline never stops training)."""
    import os
    import time

    line = json.dumps({"t": time.time(), "event": event, **fields}, separators=(",", ":"))
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)
