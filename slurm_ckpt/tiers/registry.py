"""Build the configured tiers, in order from hottest to coldest."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from slurm_ckpt.core.config import Config
from slurm_ckpt.core.config_schema import PFS
from slurm_ckpt.tiers.base import Tier
from slurm_ckpt.tiers.posix import PosixTier

#: Tier names from hot to cold: restore looks in this order, flushes go down it.
ORDER = ("local", PFS, "object", "cold")


def tiers_from_config(
    cfg: Config,
    credentials: Optional[Dict[str, str]] = None,
    sealed_for: Optional[Tuple[Any, str]] = None,
) -> Dict[str, Tier]:
    """The tiers the config names, hot to cold: local; pfs and/or object (the warm
    tier: ``cfg.tiers.warm``); cold when configured. Dict order is :data:`ORDER`.

    ``credentials`` (boto3's ``aws_access_key_id``/``aws_secret_access_key``/
    ``aws_session_token``) are the object tier's, given explicitly: root resolves its
    own before a child becomes the checkpoint's owner (:mod:`slurm_ckpt.node.warm`), so
    the child never reads the credentials or profile of the user it has become.
    ``sealed_for``: ``(session, owner)`` in such a child: root's sealed botocore session
    and the owner whose prefix alone its requests may touch (:mod:`slurm_ckpt.tiers.s3_seal`)."""
    common = {
        "chunk_size": cfg.copy.chunk_size,
        "streams": cfg.copy.streams,
        "buffer_size": cfg.copy.buffer_size,
    }
    tiers: Dict[str, Tier] = {"local": PosixTier("local", str(cfg.tiers.local.root), **common)}
    if cfg.tiers.pfs is not None:
        tiers[PFS] = PosixTier(
            PFS, str(cfg.tiers.pfs.root), bandwidth=cfg.tiers.pfs.bandwidth_limit, **common
        )
    o = cfg.tiers.object
    if o is not None:
        # Imported here: boto3/botocore cost a CLI run on a site without an object tier
        # tens of milliseconds for nothing.
        from slurm_ckpt.tiers.s3 import S3Tier

        tiers["object"] = S3Tier(
            "object",
            endpoint=o.endpoint,
            bucket=o.bucket,
            prefix=o.prefix,
            region=o.region,
            profile=None if credentials else o.profile,
            part_size=o.part_size,
            concurrency=o.concurrency,
            chunk_size=cfg.copy.chunk_size,
            bandwidth=o.bandwidth_limit,
            buffer_size=cfg.copy.buffer_size,
            credentials=credentials,
            credentials_file=None if o.credentials_file is None else str(o.credentials_file),
            sealed_for=sealed_for,
        )
    c = cfg.tiers.cold
    if c is not None:
        tiers["cold"] = PosixTier("cold", str(c.root), bandwidth=c.bandwidth_limit, **common)
    return tiers


def warm_tier(cfg: Config, tiers: Dict[str, Tier]) -> Tier:
    """The tier every flush goes to (``cfg.tiers.warm``): the PFS, or the object store on
    a site without one."""
    return tiers[cfg.tiers.warm]


def warm_tiers(cfg: Config) -> List[str]:
    """The shared tiers after the hot one, in flush order (``pfs``, then ``object``)."""
    return [n for n in (PFS, "object") if getattr(cfg.tiers, n) is not None]
