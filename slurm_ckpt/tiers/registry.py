"""Build the configured tiers, in order from hottest to coldest."""

from __future__ import annotations

from typing import Dict

from slurm_ckpt.core.config import Config
from slurm_ckpt.tiers.posix import PosixTier

#: Tier names from hot to cold: restore looks in this order, flushes go down it.
ORDER = ("local", "pfs", "cold")


def tiers_from_config(cfg: Config) -> Dict[str, PosixTier]:
    """The POSIX tiers the config names (local, pfs, and cold when configured)."""
    common = {
        "chunk_size": cfg.copy.chunk_size,
        "streams": cfg.copy.streams,
        "buffer_size": cfg.copy.buffer_size,
    }
    tiers = {
        "local": PosixTier("local", str(cfg.tiers.local.root), **common),
        "pfs": PosixTier(
            "pfs", str(cfg.tiers.pfs.root), bandwidth=cfg.tiers.pfs.bandwidth_limit, **common
        ),
    }
    if cfg.tiers.cold is not None:
        tiers["cold"] = PosixTier("cold", str(cfg.tiers.cold.root), **common)
    return tiers
