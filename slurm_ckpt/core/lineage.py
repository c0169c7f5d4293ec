"""Lineages of a checkpoint series: which steps are current, which are retired history.

Why: a job restores an older step (``restore(step=10)`` while step 20 exists: a
rollback) and saves on. Steps 11, 12 are then the series' present and step 20 its
abandoned past; an automatic restore after a crash must give 12, not 20. So every
manifest records the **lineage** it belongs to (``meta.lineage``), the lineages it
descends from with the last step it kept of each (``meta.ancestry``: nearest first), and
the writer's generation (``meta.generation``, :mod:`slurm_ckpt.core.lease`).

The rule, evaluated over the manifests of one series (on one tier or on all of them
together): the **head** is the manifest committed last - highest generation, then
latest ``wall_time`` (one writer's clock). Current ("active") are the steps of the
head's lineage and, of each ancestor, the steps up to the one it branched at - except
the steps a later writer of the same lineage went back behind: when generation G's
lowest step in a lineage is S, the steps >= S of older generations in it are superseded
(a requeued job that resumed from step 15 because step 20 never reached the warm tier,
and a stale writer's late steps, are the old timeline, not the new one). Every other
step is **retired**: kept as history, listed as such, restorable by naming its step and
lineage, never chosen by an automatic restore, never counted as the newest by retention.
Manifests without a generation (0: written before there were any, or by a writer that
records none) neither supersede nor are superseded.

A series that never rolled back has one lineage, ``main`` (manifests older than
lineages read as ``main``, generation 0). A branch is named ``g<generation>@<step>``
(the writer's generation and the step it went back to), the same on every rank of a job.
Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Tuple

from slurm_ckpt.core.lease import generation_of
from slurm_ckpt.core.manifest import has_control

__all__ = [
    "MAIN",
    "Lineage",
    "SeriesView",
    "branch_name",
    "lineage_of",
]

#: The lineage of a series that never rolled back.
MAIN = "main"
#: Ancestors a manifest records (the nearest; a chain of rollbacks longer than this
#: retires what lies beyond, which only costs an older fallback).
MAX_ANCESTRY = 32


@dataclass(frozen=True)
class Lineage:
    """A lineage and its ancestry: ``((parent, last step kept of it), ...)``, nearest
    first."""

    name: str = MAIN
    ancestry: Tuple[Tuple[str, int], ...] = ()

    def meta(self) -> Dict[str, Any]:
        """The manifest ``meta`` fields that record it."""
        return {"lineage": self.name, "ancestry": [[n, s] for n, s in self.ancestry]}

    def branch(self, name: str, at: int) -> Lineage:
        """A new lineage going on from step ``at`` of this one."""
        return Lineage(name, ((self.name, at),) + self.ancestry[: MAX_ANCESTRY - 1])


def _name(value: Any) -> Optional[str]:
    if isinstance(value, str) and 0 < len(value) <= 64 and not has_control(value):
        return value
    return None


def lineage_of(meta: Any) -> Lineage:
    """The lineage a manifest's ``meta`` records (``main`` when it records none or
    something malformed: a user writes manifests, anyone may read them)."""
    if not isinstance(meta, dict):
        return Lineage()
    name = _name(meta.get("lineage"))
    if name is None:
        return Lineage()
    out: List[Tuple[str, int]] = []
    raw = meta.get("ancestry")
    if isinstance(raw, list):
        for item in raw[:MAX_ANCESTRY]:
            if not (isinstance(item, list) and len(item) == 2):
                break
            parent, step = _name(item[0]), item[1]
            if parent is None or isinstance(step, bool) or not isinstance(step, int) or step < 0:
                break
            out.append((parent, step))
    return Lineage(name, tuple(out))


def branch_name(generation: int, step: int) -> str:
    """The name of a lineage branching at ``step`` in writer generation ``generation``."""
    return f"g{generation}@{step}"


@dataclass(frozen=True)
class _Entry:
    step: int
    lineage: Lineage
    generation: int
    wall_time: float


class SeriesView:
    """The lineages of one series' manifests: the head, and what is active (see the
    module docstring). Build it with :meth:`of` over ``(step, meta, wall_time)``."""

    def __init__(self, entries: List[_Entry]) -> None:
        self.entries = entries
        head = max(entries, key=lambda e: (e.generation, e.wall_time, e.step), default=None)
        self.head: Lineage = head.lineage if head is not None else Lineage()
        #: Active lineages -> the last step of each that is current (None: all of them).
        self.bounds: Dict[str, Optional[int]] = {self.head.name: None}
        for name, step in self.head.ancestry:
            if name not in self.bounds:
                self.bounds[name] = step
        # lineage -> generation -> its lowest step there (generations >= 1 only)
        low: Dict[str, Dict[int, int]] = {}
        for e in entries:
            if e.generation > 0:
                gens = low.setdefault(e.lineage.name, {})
                gens[e.generation] = min(e.step, gens.get(e.generation, e.step))
        #: lineage -> [(generation, lowest step of any newer generation)], ascending.
        self._later: Dict[str, List[Tuple[int, int]]] = {}
        for name, gens in low.items():
            rows, floor = [], None
            for g in sorted(gens, reverse=True):
                rows.append((g, floor))
                floor = gens[g] if floor is None else min(floor, gens[g])
            self._later[name] = [(g, f) for g, f in rows if f is not None]

    @classmethod
    def of(cls, items: Iterable[Tuple[int, Any, float]]) -> SeriesView:
        return cls(
            [_Entry(step, lineage_of(meta), generation_of(meta), wt) for step, meta, wt in items]
        )

    def active(self, step: int, meta: Any) -> bool:
        """Whether the checkpoint ``step`` with manifest ``meta`` is current."""
        return self._active(_Entry(step, lineage_of(meta), generation_of(meta), 0.0))

    def _superseded(self, e: _Entry) -> bool:
        if e.generation == 0:
            return False
        for g, floor in self._later.get(e.lineage.name, ()):
            if g == e.generation:
                return floor <= e.step
        return False

    def newest_active(self) -> Optional[int]:
        """The highest current step (None when there is none)."""
        steps = [e.step for e in self.entries if self._active(e)]
        return max(steps, default=None)

    def _active(self, e: _Entry) -> bool:
        if e.lineage.name not in self.bounds or self._superseded(e):
            return False
        bound = self.bounds[e.lineage.name]
        return bound is None or e.step <= bound
