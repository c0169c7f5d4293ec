"""tiers layer."""
