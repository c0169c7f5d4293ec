"""The ledger's warm-tier slot: where a record keeps the state of its copy on the tier
every flush goes to.

A :class:`~slurm_ckpt.ledger.record.Record` keeps that state under ``"pfs"`` whatever the
warm tier is: the parallel filesystem, or the object store on a site without one
(``cfg.tiers.warm``). The slot means "owed to / verified on the warm tier": the flush
engine, local retention (never drop a local copy whose warm copy is not verified), the
hooks' backlog and the node statuses all read it there, and a site that moves from a PFS
to an object store keeps its pending flushes owed to the new warm tier. (Ledgers written
before this was said are read exactly as before: the slot has always been named so.)

What people see says the truth: wherever the slot shows (``ckpt-slurm status``: copies
in flight, failures; metrics' help texts), it is named after the configured warm tier
with :func:`shown_tier`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["WARM_SLOT", "shown_tier"]

#: The ledger's name for the warm tier's slot (see the module docstring).
WARM_SLOT = "pfs"


def shown_tier(slot: Any, warm: str) -> Any:
    """The tier a ledger slot name stands for on a site whose warm tier is ``warm``."""
    return warm if slot == WARM_SLOT else slot
