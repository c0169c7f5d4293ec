"""The ``partner`` entry of a ``ckpt-slurm status`` job row: the newest step of the job
that also has a partner copy on a neighbour node, and which nodes hold it.

Why a module of its own: :mod:`slurm_ckpt.ops.status` joins many sources and is at its
size limit; this is one concept (partner copies, docs/partner.md) with one input, the
per-job ``partner_copies`` / ``latest_partner_step`` that each node publishes in its
status (:mod:`slurm_ckpt.ledger.node_status`, from the ledger records that carry
``partner_of``: committed locally through the partner receiver, every chunk hashed
against the owner's manifest, so a counted copy is a verified one).

A partner copy is shown, not counted as protection: ``steps_at_risk`` stays "newest
local step minus the newest step safe on the warm tier" as documented, because a partner
copy survives the loss of one node, not of two (the partner node lost too).

JSON (``partner`` in each job row): null when no node reports a partner copy of the job,
else::

    copies  partner copies of the job's checkpoints, summed over the nodes holding them
    step    the newest step that has a partner copy
    nodes   the nodes that hold a partner copy of that step (sorted)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["PartnerCopies", "PartnerSeen"]


def _step(value: Any) -> Optional[int]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value)


@dataclass(frozen=True, slots=True)
class PartnerCopies:
    """A job's partner copies as status shows them (module docstring)."""

    copies: int
    step: int
    nodes: Tuple[str, ...]

    def to_json(self) -> Dict[str, Any]:
        return {"copies": self.copies, "step": self.step, "nodes": list(self.nodes)}


@dataclass
class PartnerSeen:
    """What the node statuses say about one job's partner copies, gathered node by node."""

    copies: int = 0
    step: Optional[int] = None
    nodes: List[str] = field(default_factory=list)

    def add(self, node: str, js: Dict[str, Any]) -> None:
        """Count one node's job entry (``js``: its published per-job fields)."""
        copies = _step(js.get("partner_copies")) or 0
        step = _step(js.get("latest_partner_step"))
        if copies <= 0 or step is None:
            return  # an entry that claims no copy (or no step) shows none
        self.copies += copies
        if self.step is None or step > self.step:
            self.step, self.nodes = step, [node]
        elif step == self.step and node not in self.nodes:
            self.nodes.append(node)

    def entry(self) -> Optional[PartnerCopies]:
        """What status shows (module docstring), or None without partner copies."""
        if not self.copies or self.step is None:
            return None
        return PartnerCopies(self.copies, self.step, tuple(sorted(self.nodes)))
