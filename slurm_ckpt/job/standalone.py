"""Laptop mode: what standalone use (no site config, no SLURM hooks) must do itself.

On a site the admin makes the tier roots and the epilog sweeps what a killed job left.
A ``Checkpointer(local=...)`` on a workstation has neither, so it creates a missing root
the way ``torch.save`` and DCP would (but private: mode 0700, owned by the user) and
removes its own series' debris of killed saves before it writes. Never used with a site
config: there a missing root is the admin's to fix, and root-run code refuses it.
"""

from __future__ import annotations

import logging
import os
from typing import Sequence

from slurm_ckpt.core.config import Config
from slurm_ckpt.errors import CkptError
from slurm_ckpt.tiers.base import Tier

log = logging.getLogger(__name__)

__all__ = ["make_roots", "sweep_debris"]


def make_roots(config: Config) -> None:
    """Standalone use only: create missing POSIX tier roots as ``torch.save`` would, owned
    by the user running the job and mode 0700 (nobody else needs into a laptop's
    checkpoints). Never used for a site config: there a missing root is the admin's to
    fix, and root-run code refuses it."""
    for tier in (config.tiers.local, config.tiers.pfs):
        if tier is None:
            continue
        root = os.fspath(tier.root)
        if os.path.lexists(root):
            continue
        parent = os.path.dirname(root)
        try:
            os.makedirs(parent, exist_ok=True)
            os.mkdir(root, 0o700)
            os.chmod(root, 0o700)  # mkdir's mode passes through the umask
        except FileExistsError:
            continue  # another rank made it first
        except OSError as exc:
            raise CkptError(
                f"Checkpointer: cannot create the tier root {root}: {exc.strerror}"
            ) from None


def sweep_debris(tier: Tier, user: str, keys: Sequence[str]) -> None:
    """Remove the debris of these series on ``tier``, as the hooks do on a site:
    ``.tmp-step-*`` whose writer is gone (its pid is dead on this node, or it is older
    than an hour; a live writer's is kept) and ``.partial-*``, a copy (a flush, a fetch)
    that a kill or a Ctrl-C stopped halfway: standalone, this Checkpointer is the only
    one that copies into its own series, and it has not started one yet. Never fails
    the job: a sweep that cannot run is logged."""
    sweep = getattr(tier, "sweep", None)
    if sweep is None:
        return
    for key in keys:
        try:
            removed = sweep(user, key, partials=True)
        except (CkptError, OSError) as exc:
            log.warning("[ckpt] could not sweep the debris of killed saves: %s", exc)
            continue
        if removed:
            log.info(
                "[ckpt] %s: removed the debris of %d killed save(s) or copies: %s",
                tier.where(user, key),
                len(removed),
                removed,
            )
