"""The one place that knows the tier kinds and lists the shared tiers.

A tier has a *name* (its role in the site: ``local``, ``pfs``, ``object``, ``cold``; the
config section that describes it) and a *kind* (what it is: ``posix``, ``s3``). The
config says which kind each tier is (:meth:`~slurm_ckpt.core.config_schema.TiersConfig.kind_of`);
:data:`KINDS` says what builds a tier of each kind. Callers never ask which kind a tier
is: they ask the tier (:class:`~slurm_ckpt.tiers.base.Tier`: its guards, its committed
manifest, its optional directories) and loop over :func:`shared_tiers` instead of naming
roles. A new kind is one module and one line in :data:`KINDS`.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Dict, List, Optional, Tuple

from slurm_ckpt.core.config import Config
from slurm_ckpt.core.config_schema import SECTION_KINDS
from slurm_ckpt.errors import ConfigError
from slurm_ckpt.tiers.archive import ArchiveTier
from slurm_ckpt.tiers.base import Tier
from slurm_ckpt.tiers.posix import PosixTier

__all__ = [
    "KINDS",
    "ORDER",
    "directory_tier",
    "kind_problems",
    "object_tier_class",
    "shared_tiers",
    "tiers_from_config",
    "warm_tier",
    "warm_tiers",
]

#: Tier names from hot to cold: restore looks in this order, flushes go down it.
ORDER = ("local", "pfs", "object", "cold")

#: What the builders get besides the tier's name and section: the copy engine's sizes,
#: and for an object store root's lent credentials and sealed session.
Build = Callable[..., Tier]


def _tree(cls: Any, name: str, section: Any, cfg: Config, **_owner: Any) -> Tier:
    """A tree of directories (node-local NVMe, a parallel filesystem, an HDD archive)."""
    tier: Tier = cls(
        name,
        str(section.root),
        bandwidth=getattr(section, "bandwidth_limit", None),
        chunk_size=cfg.copy.chunk_size,
        streams=cfg.copy.streams,
        buffer_size=cfg.copy.buffer_size,
    )
    return tier


def _s3(
    name: str,
    o: Any,
    cfg: Config,
    credentials: Optional[Dict[str, str]] = None,
    sealed_for: Optional[Tuple[Any, str]] = None,
) -> Tier:
    """An S3-compatible object store (boto3: the ``[s3]`` extra)."""
    S3Tier = object_tier_class()
    tier: Tier = S3Tier(
        name,
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
    return tier


#: The tier kinds: ``kind = "..."`` in a ``[tiers.<name>]`` section -> the keys it reads
#: (those of a ``posix`` section: a directory tree; of an ``s3`` one: an object store)
#: and what builds it. A new kind is one module and one line here.
KINDS: Dict[str, Tuple[str, Build]] = {
    "posix": ("posix", partial(_tree, PosixTier)),
    "s3": ("s3", _s3),
    "archive": ("posix", partial(_tree, ArchiveTier)),
}


def kind_problems(cfg: Config) -> List[str]:
    """One line per configured tier whose kind does not exist or does not read the keys
    its section has (``[tiers.cold] kind = "s3"``: the cold section describes a tree)."""
    out = []
    for name in ("local", *shared_tiers(cfg)):
        kind = cfg.tiers.kind_of(name)
        keys = SECTION_KINDS[name]
        if kind not in KINDS:
            out.append(
                f'tiers.{name}.kind: "{kind}" is not a tier kind (one of: {", ".join(KINDS)})'
            )
        elif KINDS[kind][0] != keys:
            fits = ", ".join(k for k, (reads, _b) in KINDS.items() if reads == keys)
            out.append(
                f'tiers.{name}.kind: a "{kind}" tier does not read the keys of [tiers.{name}] '
                f"(kinds that do: {fits})"
            )
    return out


def tiers_from_config(
    cfg: Config,
    credentials: Optional[Dict[str, str]] = None,
    sealed_for: Optional[Tuple[Any, str]] = None,
) -> Dict[str, Tier]:
    """The tiers the config names, hot to cold: local, then :func:`shared_tiers` (the
    warm tier first). Dict order is :data:`ORDER`.

    ``credentials`` (boto3's ``aws_access_key_id``/``aws_secret_access_key``/
    ``aws_session_token``) are the object tier's, given explicitly: root resolves its
    own before a child becomes the checkpoint's owner (:mod:`slurm_ckpt.node.warm`), so
    the child never reads the credentials or profile of the user it has become.
    ``sealed_for``: ``(session, owner)`` in such a child: root's sealed botocore session
    and the owner whose prefix alone its requests may touch (:mod:`slurm_ckpt.tiers.s3_seal`)."""
    problems = kind_problems(cfg)
    if problems:
        raise ConfigError(f"{cfg.source}: " + "; ".join(problems))
    tiers: Dict[str, Tier] = {}
    for name in ("local", *shared_tiers(cfg)):
        _keys, build = KINDS[cfg.tiers.kind_of(name)]
        tiers[name] = build(
            name, getattr(cfg.tiers, name), cfg, credentials=credentials, sealed_for=sealed_for
        )
    return tiers


def directory_tier(name: str, root: str, **kw: Any) -> Tier:
    """A tier of plain directories at ``root`` that no config names: a node's local tier
    seen by root's children, a restore's destination directory. It offers
    :meth:`~slurm_ckpt.tiers.base.Tier.directory`."""
    return PosixTier(name, root, **kw)


def object_tier_class() -> Any:
    """:class:`~slurm_ckpt.tiers.s3.S3Tier`, imported only for a site with an object tier:
    boto3 is the ``[s3]`` extra, so a laptop or a PFS-only site does without it."""
    try:
        from slurm_ckpt.tiers.s3 import S3Tier
    except ImportError as exc:
        raise ConfigError(
            f"the object tier needs boto3 ({exc.name or exc} is missing): "
            "install slurm_ckpt with its s3 extra (pip install '/path/to/slurm_ckpt[s3]')"
        ) from None
    return S3Tier


def shared_tiers(cfg: Config) -> List[str]:
    """The configured shared tiers in flush order (``[tiers] shared``): the first is the
    warm tier, aging goes down the rest."""
    return list(cfg.tiers.shared_tiers)


def warm_tier(cfg: Config, tiers: Dict[str, Tier]) -> Tier:
    """The tier every flush goes to: the first shared tier (the PFS, or the object store
    on a site without one)."""
    return tiers[shared_tiers(cfg)[0]]


def warm_tiers(cfg: Config) -> List[str]:
    """The shared tiers that take flushes, in flush order: the warm tier and the object
    store after a PFS (``pfs``, then ``object``); the cold tier takes aged copies only."""
    return [n for n in shared_tiers(cfg) if n != "cold"]
