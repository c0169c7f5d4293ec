"""ledger layer: the per-node record of each checkpoint's state on each tier."""

from slurm_ckpt.ledger.ledger import LEDGER_NAME, LOCK_NAME, Ledger, LedgerError
from slurm_ckpt.ledger.node_status import (
    node_status,
    publish_status,
    read_node_statuses,
    status_path,
)
from slurm_ckpt.ledger.record import WARM_SLOT, Ident, Record, State

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
