"""Build the configured tiers, in order from hottest to coldest."""

from __future__ import annotations

from typing import Dict, List

from slurm_ckpt.core.config import Config
from slurm_ckpt.tiers.base import Tier
from slurm_ckpt.tiers.posix import PosixTier
from slurm_ckpt.tiers.s3 import S3Tier

#: Tier names from hot to cold: restore looks in this order, flushes go down it.
ORDER = ("local", "pfs", "object", "cold")


def tiers_from_config(cfg: Config) -> Dict[str, Tier]:
    """The tiers the config names, hot to cold: local; pfs and/or object (the warm
    tier: ``cfg.tiers.warm``); cold when configured. Dict order is :data:`ORDER`."""
    common = {
        "chunk_size": cfg.copy.chunk_size,
        "streams": cfg.copy.streams,
        "buffer_size": cfg.copy.buffer_size,
    }
    tiers: Dict[str, Tier] = {"local": PosixTier("local", str(cfg.tiers.local.root), **common)}
    if cfg.tiers.pfs is not None:
        tiers["pfs"] = PosixTier(
            "pfs", str(cfg.tiers.pfs.root), bandwidth=cfg.tiers.pfs.bandwidth_limit, **common
        )
    o = cfg.tiers.object
    if o is not None:
        tiers["object"] = S3Tier(
            "object",
            endpoint=o.endpoint,
            bucket=o.bucket,
            prefix=o.prefix,
            region=o.region,
            profile=o.profile,
            part_size=o.part_size,
            concurrency=o.concurrency,
            chunk_size=cfg.copy.chunk_size,
            bandwidth=o.bandwidth_limit,
            buffer_size=cfg.copy.buffer_size,
        )
    c = cfg.tiers.cold
    if c is not None:
        tiers["cold"] = PosixTier("cold", str(c.root), bandwidth=c.bandwidth_limit, **common)
    return tiers


def warm_tiers(cfg: Config) -> List[str]:
    """The shared tiers after the hot one, in flush order (``pfs``, then ``object``)."""
    return [n for n in ("pfs", "object") if getattr(cfg.tiers, n) is not None]
