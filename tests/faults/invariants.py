"""The campaign's invariants, checked from the outside (files on the tiers, SLURM).

I1  no partial or corrupt checkpoint is ever listed or restored: every step a tier lists
    verifies (except copies the scenario damaged on purpose), and every restart loads a
    state bitwise equal to the uninterrupted run's state at that step;
I2  no checkpoint that was verified on any tier is lost: a step once seen verified on a
    tier stays verified there or on the PFS - unless a newer step is kept there instead
    (retention) - except copies the scenario destroyed (damage, a wiped node);
I3  every checkpoint committed locally when a job ended is verified on the PFS once the
    epilog (or, after it, the stager) has run - or the node is still drained with our
    reason (``slurm_ckpt:``), and then verified once the fault is gone and the stager ran;
I4  a restart resumes at the newest step that verifies on a tier it can read (local
    first, the PFS) and loses no more than one interval of work when the newest save
    before the fault had been committed - none at all after SIGTERM;
I5  with partner copies on, a single node loss loses at most the steps since the newest
    step whose partner copy was committed: the requeued job resumes at a step no older
    than the newest one of which every rank's shard was verified, at the loss, on a node
    that survived or on the PFS (the lost node's shards as partner copies on its partner).
    After a second loss (the partner too) or a damaged partner copy it resumes at the
    newest step complete and verified on what is left, and never loads anything wrong (I1).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Set, Tuple

from tests.faults.site import FaultSite

Snapshot = Dict[str, Dict[int, bool]]


class Tracker:
    """What the tiers held over a run; records violations instead of raising, so that a
    campaign reports all of them."""

    def __init__(self, site: FaultSite, key: str, keys: Optional[List[str]] = None) -> None:
        self.site = site
        self.keys = keys or [key]
        self.ever: Set[Tuple[str, str, int]] = set()
        self.damaged: Set[Tuple[str, str, int]] = set()
        self.lost_tiers: Set[str] = set()
        #: tiers whose reads fail on purpose for a while (EIO): not judged meanwhile
        self.unreadable: Set[str] = set()
        self.violations: List[str] = []
        self.last: Dict[str, Snapshot] = {}

    def violation(self, text: str) -> None:
        self.violations.append(text)

    def snapshot(self, key: str) -> Snapshot:
        return {tid: self.site.verified(tier, key) for tid, tier in self.site.tiers().items()}

    def observe(self, when: str) -> Dict[str, Snapshot]:
        """I1 and I2 over every tier; returns the snapshot per key."""
        out: Dict[str, Snapshot] = {}
        for key in self.keys:
            snap = out[key] = self.snapshot(key)
            good = set()
            for tid, steps in snap.items():
                for step, ok in steps.items():
                    if ok:
                        good.add((tid, step))
                    elif (tid, key, step) not in self.damaged and tid not in self.unreadable:
                        self.violation(
                            f"I1 {when}: {tid} lists {key} step {step}, which does not verify"
                        )
            for tid, k, step in sorted(self.ever):
                if k != key or tid in self.lost_tiers or (tid, k, step) in self.damaged:
                    continue
                if tid in self.unreadable:
                    continue
                if not any(s2 >= step and t2 in (tid, "pfs") for t2, s2 in good):
                    self.violation(
                        f"I2 {when}: {key} step {step} was verified on {tid} and is gone, "
                        "with nothing as new kept there or on the PFS"
                    )
            self.ever |= {(tid, key, step) for tid, step in good}
        self.last = out
        return out

    def newest_readable(self, node: str, key: str) -> Optional[int]:
        """The step a restart on ``node`` must resume at (I4), from the last snapshot."""
        snap = self.last.get(key) or self.snapshot(key)
        ok = [s for tid in (f"local:{node}", "pfs") for s, v in snap.get(tid, {}).items() if v]
        return max(ok, default=None)

    def committed_local(self, node: str, key: str) -> Set[int]:
        snap = self.last.get(key) or self.snapshot(key)
        return {s for s, ok in snap.get(f"local:{node}", {}).items() if ok}

    def unflushed(self, node: str, key: str, committed: Set[int]) -> Set[int]:
        """Of ``committed``, the steps with no verified PFS copy now (damaged ones aside)."""
        pfs = self.snapshot(key)["pfs"]
        return {
            s for s in committed if not pfs.get(s) and (f"local:{node}", key, s) not in self.damaged
        }

    def check_flushed(self, node: str, key: str, committed: Set[int], when: str) -> bool:
        """I3 after an epilog or stager: True when all of ``committed`` is on the PFS;
        False (no violation) while the node is drained with our reason."""
        missing = self.unflushed(node, key, committed)
        if not missing:
            return True
        reason = self.site.node_reason(node) or ""
        if not reason.startswith("slurm_ckpt:"):
            self.violation(
                f"I3 {when}: {key} steps {sorted(missing)} committed on {node} are not on the "
                f"PFS and the node is not drained by us (reason {reason or None!r})"
            )
        return False

    # -- I5: partner copies ---------------------------------------------------------------
    def surviving(self, tiers: Set[str]) -> Optional[int]:
        """The newest step of which every key (rank shard) has an intact verified copy on
        one of ``tiers`` in the last snapshot - what a node loss must not lose (I5)."""
        best: Optional[int] = None
        per_key = []
        for key in self.keys:
            snap = self.last.get(key) or self.snapshot(key)
            per_key.append(
                {
                    s
                    for tid in tiers
                    for s, ok in snap.get(tid, {}).items()
                    if ok and (tid, key, s) not in self.damaged
                }
            )
        if per_key:
            common = set.intersection(*per_key)
            best = max(common, default=None)
        return best

    def newest_complete(self, tiers: List[str]) -> Optional[int]:
        """The newest step whose every shard verifies on one and the same tier of
        ``tiers`` (the restore's rule without an agreement function), last snapshot."""
        best: Optional[int] = None
        for tid in tiers:
            sets = []
            for key in self.keys:
                snap = self.last.get(key) or self.snapshot(key)
                sets.append({s for s, ok in snap.get(tid, {}).items() if ok})
            common = set.intersection(*sets) if sets else set()
            if common and (best is None or max(common) > best):
                best = max(common)
        return best

    def check_node_loss(
        self, got: Optional[int], bound: Optional[int], reached: int, when: str
    ) -> bool:
        """I5: a restart after one node loss resumed no older than ``bound`` (the newest
        step whose partner copy was committed). True when it holds."""
        if (got or 0) >= (bound or 0):
            return True
        self.violation(
            f"I5 {when}: a single node loss lost {reached - (got or 0)} steps (resumed at "
            f"{got}); the newest step whose partner copy was committed was {bound}"
        )
        return False
