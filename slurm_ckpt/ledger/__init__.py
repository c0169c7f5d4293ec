"""ledger layer: the per-node record of each checkpoint's state on each tier."""

from slurm_ckpt.ledger.ledger import (
    LEDGER_NAME,
    LOCK_NAME,
    Ledger,
    LedgerError,
    Record,
    State,
    read_node_statuses,
    status_path,
    validate_node_name,
)

__all__ = [
    "LEDGER_NAME",
    "LOCK_NAME",
    "Ledger",
    "LedgerError",
    "Record",
    "State",
    "read_node_statuses",
    "status_path",
    "validate_node_name",
]
