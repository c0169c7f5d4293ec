"""Where a rank's partner link meets its peers, and opening the link at start-up.

Apart from :mod:`slurm_ckpt.job.partner` (the link at work: sending, serving, adopting
copies) because this is configuration and placement: which trusted directory the ranks
of one run rendezvous in (one per run of a job, so a requeued job never finds its old
addresses), and the rule that a link which cannot start turns partner copies off for the
run - logged and evented - instead of failing the training job.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Optional

from slurm_ckpt.core import trust
from slurm_ckpt.core.config import Config
from slurm_ckpt.errors import CkptError
from slurm_ckpt.job.bookkeeping import Bookkeeper
from slurm_ckpt.job.partner import PartnerLink
from slurm_ckpt.job.partner_net import Rendezvous, launch_tag, local_host
from slurm_ckpt.tiers.base import Tier

log = logging.getLogger(__name__)

__all__ = ["open_partner", "rendezvous_base", "rendezvous_dir"]


def rendezvous_base(cfg: Config) -> Optional[str]:
    """The trusted directory rendezvous lie below: ``[partner] dir`` (made by the admin,
    docs/admin-guide.md) or the PFS root; None without either."""
    if cfg.partner.dir is not None:
        return os.fspath(cfg.partner.dir)
    if cfg.tiers.pfs is not None:
        return os.fspath(cfg.tiers.pfs.root)
    return None


def rendezvous_dir(cfg: Config, user: str, base_key: str, job: Optional[str]) -> Optional[str]:
    """``<base>/<user>/<key>.<job>.<restart>``: one directory per run of a job (a
    requeued job keeps its id; its old addresses must not be found)."""
    root = rendezvous_base(cfg)
    if root is None:
        return None
    if cfg.partner.dir is not None:
        base = os.path.join(root, user)
    else:
        base = os.path.join(root, user, ".slurm_ckpt-partner")
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    if not restart.isdigit():
        restart = "0"
    return os.path.join(base, f"{base_key}.{job or 'standalone'}.{restart}")


def open_partner(
    cfg: Config,
    local: Tier,
    books: Bookkeeper,
    *,
    user: str,
    key: str,
    base_key: str,
    rank: int,
    world_size: int,
    node: str,
    job: Optional[str],
    host: Optional[str] = None,
) -> Optional[PartnerLink]:
    """The partner link of one rank, or None (one rank, no rendezvous directory, or it
    could not start: logged, training goes on without partner copies)."""
    if world_size < 2:
        log.info("[ckpt] partner copies: one rank, no partner")
        return None
    directory, base = rendezvous_dir(cfg, user, base_key, job), rendezvous_base(cfg)
    if directory is None or base is None:
        log.warning("[ckpt] partner copies off: no PFS; set [partner] dir")
        return None
    try:
        return PartnerLink(
            local,
            books.ledger,
            user=user,
            key=key,
            base_key=base_key,
            rank=rank,
            world_size=world_size,
            node=node,
            job=job,
            rendezvous=Rendezvous(directory, rank, world_size, launch_tag(), base=base, user=user),
            host=host or local_host(),
            bind=cfg.partner.bind or "",
            bandwidth=cfg.partner.bandwidth or 0.0,
            keep_partner=cfg.partner.keep_partner,
            piece=min(cfg.copy.buffer_size, 4 * 2**20),
            on_event=books.emit,
        )
    except (CkptError, OSError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        log.warning("[ckpt] partner copies off: %s", reason)
        # An event too (ckpt-slurm events, the job's status): a squatted rendezvous
        # directory is another user's doing and must not pass as a quiet log line.
        with contextlib.suppress(Exception):
            books.emit("partner_off", error=reason, squatted=isinstance(exc, trust.Squatted))
        return None
