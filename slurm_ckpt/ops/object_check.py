"""``config check`` and ``doctor`` on a site with an object tier: is the store reachable
with this host's credentials, and, on a site without a PFS, where do the node statuses
and admission slots live (:mod:`slurm_ckpt.ledger.status_store`)."""

from __future__ import annotations

from typing import List, Tuple

from slurm_ckpt.core.config import Config
from slurm_ckpt.core.config_schema import OBJECT_SECTION
from slurm_ckpt.errors import CkptError

__all__ = ["object_findings"]


def object_findings(cfg: Config) -> List[Tuple[str, str, str]]:
    """``(severity, message, fix)`` with severity ``ok``, ``warn`` or ``error``; nothing
    without an object tier. Asks the store one question (``HeadBucket``)."""
    o = cfg.tiers.object
    if o is None:
        return []
    from slurm_ckpt.tiers.registry import tiers_from_config

    tier = tiers_from_config(cfg)[OBJECT_SECTION]
    url = f"s3://{o.bucket}/{o.prefix}".rstrip("/")
    out: List[Tuple[str, str, str]] = []
    try:
        tier.check()
        out.append(("ok", f"tiers.object {url} at {o.endpoint}: reachable", ""))
    except CkptError as exc:
        out.append(
            (
                "error",
                str(exc),
                "check tiers.object endpoint/bucket and the credentials (AWS_ACCESS_KEY_ID/"
                "AWS_SECRET_ACCESS_KEY or tiers.object.profile) of root on this host",
            )
        )
    if cfg.tiers.pfs is None:
        out.append(
            (
                "ok",
                f"no PFS: the object store is the warm tier; node statuses are signed objects "
                f"in {url}/.slurm_ckpt/nodes/ (root's credentials only: do not give users the "
                "site's keys)",
                "",
            )
        )
    return out
