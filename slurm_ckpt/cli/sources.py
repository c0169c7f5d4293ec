"""Where ``ckpt-slurm`` takes its configuration from: the site, the user, or the command line.

On a cluster the site config (``/etc/slurm-ckpt/config.toml``, ``$SLURM_CKPT_CONFIG`` or
``--config``) names the tiers. A user on a laptop or workstation has none, and their
checkpoints sit in directories they chose (``Checkpointer(local=..., warm=...)``). So the
*user commands* (:data:`USER_COMMANDS`: ``list``, ``status``, ``restore``, ``drill``,
``verify``, ``adopt``, ``report``, ``goodput``, ``config show|check``, ``flush``, ``gc``) also take:

* tier flags ``--local DIR [--warm DIR] [--cold DIR]``: the tiers, no file at all (a local
  tier alone is fine: a laptop may have no second disk);
* a per-user config, ``$XDG_CONFIG_HOME/slurm-ckpt/config.toml`` (default
  ``~/.config/slurm-ckpt/config.toml``), same format as the site's, read only when no site
  config exists and the caller is not root.

Root never reads a user's config, and ``gc``/``flush`` refuse tier flags as root: root-run
code (hooks, stager, gc, flush, maint) decides with the site config alone, whose trust
``config check`` and the hooks keep checking. The order is: ``--config``, then tier flags
(both at once is a usage error), then ``$SLURM_CKPT_CONFIG``, then the site default, then
(user commands, non-root) the user config.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Dict, Optional, Sequence, Tuple

import click

from slurm_ckpt.cli.registry import user_paths
from slurm_ckpt.core.config import Config, load_config, own_config_path, user_config_path
from slurm_ckpt.core.config_schema import DEFAULT_CONFIG_PATH, ENV_CONFIG
from slurm_ckpt.errors import ConfigError, UsageError

__all__ = [
    "TIER_FLAGS",
    "USER_COMMANDS",
    "is_user_command",
    "load_cli_config",
    "tier_flag_config",
    "user_config_path",
]

#: Commands (as their words after ``ckpt-slurm``) that act on the caller's own
#: checkpoints and so accept tier flags and the per-user config (:mod:`.registry`).
USER_COMMANDS = user_paths()

#: User commands that root runs on a cluster's site tiers: as root they take the site
#: config alone (tier flags name directories a user controls).
SITE_AS_ROOT = frozenset({("flush",), ("gc",)})

#: The tier flags, as ``(options, tier)``. ``--pfs`` is the old name of ``--warm``
#: (deprecated, kept one release).
TIER_FLAGS: Tuple[Tuple[Tuple[str, ...], str], ...] = (
    (("--local",), "local"),
    (("--warm", "--pfs"), "warm"),
    (("--cold",), "cold"),
)


def is_user_command(words: Sequence[str]) -> bool:
    """True when ``words`` (the command path after ``ckpt-slurm``) is a user command."""
    return tuple(words) in USER_COMMANDS


def tier_flag_config(roots: Dict[str, str]) -> Config:
    """A configuration made of tier flags alone (``{"local": DIR, "warm": DIR, ...}``).

    Like :meth:`Config.standalone` (a plain directory as the local tier, no mount or
    free-space demand), but the warm tier is optional: a laptop user may have only the
    directory they gave ``Checkpointer(local=...)``.
    """
    local = roots.get("local")
    if local is None:
        given = ", ".join(f"--{t}" for t in roots)
        raise UsageError(f"{given} needs --local DIR too (the Checkpointer's local directory)")
    extra: Dict[str, Dict[str, str]] = {}
    if "cold" in roots:
        extra["cold"] = {"root": os.path.abspath(roots["cold"])}
    warm = roots.get("warm")
    # Config.standalone insists on a warm tier; without --warm build with a stand-in that
    # is dropped at once (never touched: it overlaps nothing and is removed before use).
    stand_in = warm if warm is not None else os.path.abspath(local).rstrip("/") + ".no-pfs"
    cfg = Config.standalone(local, stand_in, tiers=extra)
    if warm is None:
        cfg = dataclasses.replace(cfg, tiers=dataclasses.replace(cfg.tiers, pfs=None))
    return dataclasses.replace(cfg, source="<tier flags>")


def load_cli_config(
    config_path: Optional[str], roots: Dict[str, str], words: Sequence[str]
) -> Config:
    """The configuration of one ``ckpt-slurm`` invocation (see the module docstring)."""
    if config_path is not None and roots:
        flags = " ".join(f"--{t}" for t in roots)
        raise UsageError(f"give --config or {flags}, not both")
    if config_path is not None:
        if not config_path.strip():
            raise UsageError("--config: empty path (name a config file)")
        return load_config(config_path)
    if roots:
        if os.geteuid() == 0 and tuple(words) in SITE_AS_ROOT:
            raise UsageError(
                f"{' '.join(words)}: tier flags are for your own checkpoints; as root, "
                f"{' '.join(words)} works on the site's tiers (--config or the site config)"
            )
        return tier_flag_config(roots)
    if os.environ.get(ENV_CONFIG, "").strip() or os.geteuid() == 0:
        return load_config(None)
    if not os.path.lexists(DEFAULT_CONFIG_PATH) and is_user_command(words):
        own = own_config_path()  # the same rule as Checkpointer.from_env()
        if own is not None:
            return load_config(own)
        user = user_config_path()
        raise ConfigError(
            f"no config: {DEFAULT_CONFIG_PATH} not found and no {user} (pass --config, "
            f"set {ENV_CONFIG}, or give the tiers: --local DIR [--warm DIR])"
        )
    return load_config(None)


def command_words(ctx: Optional[click.Context]) -> Tuple[str, ...]:
    """The words of the running command after the program name (``("config", "check")``)."""
    if ctx is None:
        return ()
    words = []
    while ctx is not None and ctx.parent is not None:
        words.append(ctx.info_name or "")
        ctx = ctx.parent
    return tuple(reversed(words))
