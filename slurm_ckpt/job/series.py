"""A writer's place in its checkpoint series: its generation and its lineage.

Why apart from the pipeline: both are facts about the *series* that every manifest the
writer commits records (``meta.generation``, ``meta.lineage``, ``meta.ancestry``), and
both decide whether a commit may happen: the generation through the lease's fence
(:mod:`slurm_ckpt.job.lease`: a writer taken over commits nothing), the lineage through
the rollback rule (:mod:`slurm_ckpt.core.lineage`: a restore of an older step, then a
save, starts a new lineage and retires the newer steps). The restore side tells it what
was restored (:meth:`SeriesPlace.follow`, :meth:`SeriesPlace.branch_from`); the local
writer asks it for each save's lineage and for the fence before each commit.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional, Set, Tuple

from slurm_ckpt.core.lease import StaleGeneration, generation_of
from slurm_ckpt.core.lineage import Lineage, SeriesView, branch_name, lineage_of
from slurm_ckpt.errors import CkptError
from slurm_ckpt.job.lease import SeriesLease
from slurm_ckpt.tiers.base import Tier

log = logging.getLogger(__name__)

__all__ = ["SeriesPlace"]


class SeriesPlace:
    """Generation and lineage of one writer's saves (see the module docstring)."""

    def __init__(
        self, local: Tier, warm: Optional[Tier], user: str, key: str, lease: Optional[SeriesLease]
    ) -> None:
        self.local, self.warm, self.user, self.key = local, warm, user, key
        self.lease = lease
        self._lock = threading.Lock()
        #: The lineage new saves belong to (None: the series' head, found at the first
        #: save); a pending branch (parent, step) after a restore of an older step.
        self.lineage: Optional[Lineage] = None
        self._branch: Optional[Tuple[Lineage, int]] = None
        self._branch_names: Set[str] = set()

    @property
    def generation(self) -> int:
        return self.lease.generation if self.lease is not None else 0

    def follow(self, lineage: Lineage) -> None:
        """After a restore of the series' newest current step: saves go on in its lineage."""
        with self._lock:
            self.lineage, self._branch = lineage, None

    def branch_from(self, parent: Lineage, step: int) -> None:
        """After a restore of an older step: the next save starts a new lineage from it
        (:mod:`slurm_ckpt.core.lineage`), which retires the parent's newer steps."""
        with self._lock:
            self._branch = (parent, step)

    def save_lineage(self) -> Lineage:
        """The lineage of the save being written: a pending branch is made now (the first
        save after the rollback), else the one followed, else the series' head."""
        with self._lock:
            branch, self._branch = self._branch, None
            if branch is not None:
                parent, at = branch
                name = base = branch_name(self.generation, at)
                n = 1
                while name in self._branch_names:
                    n += 1
                    name = f"{base}.{n}"
                self._branch_names.add(name)
                self.lineage = parent.branch(name, at)
                log.warning(
                    "[ckpt] restored step %d is older than the series' newest: saves now "
                    "start lineage %s; the newer steps of lineage %s are retired",
                    at,
                    name,
                    parent.name,
                )
            if self.lineage is not None:
                return self.lineage
        head = self.series_view().head
        with self._lock:
            if self.lineage is None:
                self.lineage = head
            return self.lineage

    def series_view(self) -> SeriesView:
        """The lineages of this series over the local and warm tiers (unreadable tiers are
        left out: the lineage only decides which steps are current)."""
        items = []
        for tier in (self.local, self.warm):
            if tier is None:
                continue
            try:
                infos = tier.steps(self.user, self.key)
            except (CkptError, OSError):
                continue
            items += [(i.step, i.manifest.meta, i.manifest.wall_time) for i in infos]
        return SeriesView.of(items)

    def fence(self, tier: str) -> None:
        """Right before a commit to ``tier`` ("local"/"warm"): StaleGeneration when a
        newer writer took the series over (:mod:`slurm_ckpt.job.lease`)."""
        if self.lease is not None:
            self.lease.check(tier)

    def may_replace(self, step: int, lineage: Lineage, own: bool) -> None:
        """Whether a save of ``step`` in ``lineage`` may replace the local copy of that step
        already committed: never a newer writer's (StaleGeneration); the same run's earlier
        save, a retired lineage's step whose number the new lineage reached (the new one
        supersedes it: docs/user-guide.md, "Rolling back"), or an earlier writer's of this
        lineage are replaced (logged)."""
        try:
            theirs = self.local.manifest(self.user, self.key, step).meta
        except (CkptError, OSError):
            theirs = {}
        gen, their_gen = self.generation, generation_of(theirs)
        if their_gen > gen:
            raise StaleGeneration(
                f"{self.local.where(self.user, self.key, step)}: committed by a newer writer "
                f"(generation {their_gen} > {gen}): kept"
            )
        if own:
            log.info("[ckpt] step=%d saved again in this run: replacing the earlier save", step)
        elif lineage_of(theirs).name != lineage.name:
            log.warning(
                "[ckpt] step=%d of retired lineage %s replaced by the step of lineage %s",
                step,
                lineage_of(theirs).name,
                lineage.name,
            )
        else:
            log.warning(
                "[ckpt] step=%d already committed on the local tier by an earlier writer "
                "(generation %d): replacing it",
                step,
                their_gen,
            )
