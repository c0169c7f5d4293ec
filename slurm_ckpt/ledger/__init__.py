"""ledger layer: the per-node record of each checkpoint's state on each tier.

The names below are resolved on first use (PEP 562): ``ckpt-slurm status`` needs the
record types and the status readers, not every module of the ledger at import time.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, List

if TYPE_CHECKING:  # pragma: no cover
    from slurm_ckpt.ledger.ledger import LEDGER_NAME, LOCK_NAME, Ledger, LedgerError
    from slurm_ckpt.ledger.node_status import (
        node_status,
        publish_status,
        read_node_statuses,
        status_path,
    )
    from slurm_ckpt.ledger.record import WARM_SLOT, Ident, Record, State

_LAZY = {
    "LEDGER_NAME": "slurm_ckpt.ledger.ledger",
    "LOCK_NAME": "slurm_ckpt.ledger.ledger",
    "Ledger": "slurm_ckpt.ledger.ledger",
    "LedgerError": "slurm_ckpt.ledger.ledger",
    "publish_status": "slurm_ckpt.ledger.node_status",
    "read_node_statuses": "slurm_ckpt.ledger.node_status",
    "status_path": "slurm_ckpt.ledger.node_status",
    "WARM_SLOT": "slurm_ckpt.ledger.record",
    "Ident": "slurm_ckpt.ledger.record",
    "Record": "slurm_ckpt.ledger.record",
    "State": "slurm_ckpt.ledger.record",
}

__all__ = [
    "LEDGER_NAME",
    "LOCK_NAME",
    "Ident",
    "Ledger",
    "LedgerError",
    "Record",
    "State",
    "WARM_SLOT",
    "node_status",
    "publish_status",
    "read_node_statuses",
    "status_path",
]


# Bound now, not lazily: the submodule of the same name would shadow it (Python binds a
# submodule on its package once anything imports it, and __getattr__ is then never asked).
from slurm_ckpt.ledger.node_status import node_status  # noqa: E402


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'slurm_ckpt.ledger' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_LAZY))
