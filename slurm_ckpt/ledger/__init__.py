"""ledger layer."""
