"""A tier root that does not exist is a wrong config, never "no checkpoints".

``list``, ``verify KEY``, ``status``, ``restore`` and ``drill`` used to read a missing
root as an empty tier: a typo in ``tiers.pfs.root`` (or a PFS not mounted on this node)
answered "no committed checkpoints" with exit status 0. :func:`require_roots` is called
before they read anything: a missing PFS root is a :class:`ConfigError` (exit 2) naming
it. A missing *local* root is normal on a login node, and a missing *cold* root is common
there too (the archive is mounted on data movers): each of those is left out, the cold
one with a warning the command prints, and is an error only when no other tier is left to
read (or ``--tier local``/``--tier cold`` asks for it alone). The object tier has no root
to look at; its errors come when it is asked.
"""

from __future__ import annotations

import os
from typing import List, Optional, Tuple

from slurm_ckpt.core.config import Config
from slurm_ckpt.core.config_schema import PFS
from slurm_ckpt.errors import ConfigError
from slurm_ckpt.tiers.registry import shared_tiers

__all__ = ["directory_roots", "missing_roots", "require_roots"]


def directory_roots(cfg: Config) -> List[Tuple[str, str]]:
    """``(tier, root)`` of every configured tier kept under a root directory, local
    first, then the shared ones in flush order (an object store has no root)."""
    out = []
    for name in ("local", *shared_tiers(cfg)):
        root = getattr(getattr(cfg.tiers, name), "root", None)
        if root is not None:
            out.append((name, str(root)))
    return out


def missing_roots(cfg: Config, tier: Optional[str] = None) -> List[Tuple[str, str]]:
    """``(tier, root)`` of every configured directory tier (or just ``tier``) whose root
    does not exist (a dangling symlink counts as existing: opening it gives the reason)."""
    return [
        (name, root)
        for name, root in directory_roots(cfg)
        if (tier is None or tier == name) and not os.path.lexists(root)
    ]


def require_roots(cfg: Config, tier: Optional[str] = None) -> List[str]:
    """Raise :class:`ConfigError` when the tiers a command reads (all, or ``tier``) are
    missing in a way that would read as "no checkpoints" (see the module docstring);
    return the warnings to print for tiers left out (a missing cold root)."""
    missing = missing_roots(cfg, tier)
    if not missing:
        return []
    fatal = [(n, r) for n, r in missing if n == PFS]
    readable = [n for n in ("local", *shared_tiers(cfg)) if tier in (None, n)]
    left = [n for n in readable if n not in {m for m, _ in missing}]
    if not fatal and left:
        return [
            f"tiers.{n}.root {r} does not exist on this node: the {n} tier is not read"
            for n, r in missing
            if n != "local"  # no local root: a login node, nothing to say
        ]
    bad = fatal or missing
    where = ", ".join(f"tiers.{n}.root {r}" for n, r in bad)
    source = "" if cfg.source.startswith("<") else f"{cfg.source}: "
    verb = "does" if len(bad) == 1 else "do"
    raise ConfigError(
        f"{source}{where} {verb} not exist on this node; nothing there can be listed "
        "(a typo in the config, or a filesystem not mounted here? ckpt-slurm config check)"
    )
