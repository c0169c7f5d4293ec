"""``config check``: what can be checked from the node it runs on (issue 11, item 3).

A config whose syntax and values are valid can still point at nothing: a tier root
that does not exist, is a regular file or a symlink, belongs to a user who could then
replace anyone's checkpoint directories, or a local tier that is a plain directory on the
root filesystem. Every later command would answer "nothing found" with exit 0; so
:func:`check_roots` looks:

* every tier root (local, pfs, cold) exists, is a directory and not a symlink (roots are
  opened with ``O_NOFOLLOW``: a symlinked root fails everything later);
* it is owned by root and not writable by group or others unless sticky (mode 1777):
  otherwise whoever can write it can rename a user's directory away;
* the local root is a mount of its own when ``tiers.local.require_mount`` (as the prolog
  demands), and has ``min_free`` (+ ``hooks.expected_checkpoint_size``) free;
* the ledger directory's parent exists (it is made on first use).

* the config file and the ``ckpt-slurm`` executable running now (and its interpreter)
  can be changed by no one but root, at any level of their paths
  (:func:`~slurm_ckpt.core.trust.path_problems`): the hooks run as root with both. An
  error when ``config check`` runs as root (the hooks refuse such a config), a warning
  otherwise (a user checking a config of their own).

A missing *local* root is a warning, not an error: on a login node there is none, and
that is fine. Everything else that is wrong is an error (``config check`` exits 2).
Free space is a warning (it changes by the minute). ``--offline`` skips all of this.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import List, Optional

from slurm_ckpt.core import trust
from slurm_ckpt.core.config import Config
from slurm_ckpt.core.units import format_bytes
from slurm_ckpt.errors import CkptError
from slurm_ckpt.ops.object_check import object_findings
from slurm_ckpt.ops.tier_roots import directory_roots

__all__ = ["ERROR", "WARNING", "Finding", "check_roots", "check_trust", "own_config"]

ERROR = "error"
WARNING = "warning"


@dataclass(frozen=True)
class Finding:
    """One problem: ``level`` is :data:`ERROR` or :data:`WARNING`; ``text`` one line."""

    level: str
    text: str


def _root(
    name: str, key: str, root: str, local: bool, out: List[Finding], owner: Optional[int] = None
) -> Optional[os.stat_result]:
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        if local:
            out.append(
                Finding(
                    WARNING,
                    f"{key} {root} does not exist on this node (fine on a login node; the "
                    "prolog refuses jobs on a compute node without it)",
                )
            )
        else:
            out.append(Finding(ERROR, f"{key} {root} does not exist"))
        return None
    except PermissionError:
        out.append(Finding(ERROR, f"{key} {root}: permission denied (a directory on the way)"))
        return None
    if stat.S_ISLNK(st.st_mode):
        real = os.path.realpath(root)
        out.append(
            Finding(
                ERROR,
                f"{key} {root} is a symlink (to {real}); tier roots are opened without "
                f"following symlinks: set {key} = {real!r}",
            )
        )
        return None
    if not stat.S_ISDIR(st.st_mode):
        out.append(Finding(ERROR, f"{key} {root} is not a directory"))
        return None
    if st.st_uid != 0 and st.st_uid != owner:
        out.append(
            Finding(
                ERROR,
                f"{key} {root} is owned by uid {st.st_uid}, not root: its owner could replace "
                f"any user's checkpoint directory (chown root {root})",
            )
        )
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        out.append(
            Finding(
                ERROR,
                f"{key} {root} has mode {stat.S_IMODE(st.st_mode):04o}: writable by others "
                f"without the sticky bit, anyone can rename a user's directory away "
                f"(chmod 0755, or 1777 for a shared scratch root)",
            )
        )
    return st


def check_roots(cfg: Config, owner: Optional[int] = None) -> List[Finding]:
    """Check the configured roots on this node (see the module docstring).

    ``owner``: a user's own configuration (:func:`own_config`), checked for that user's
    commands: roots owned by that uid are fine too (they hold only that user's
    checkpoints; no one else writes there) and the config file's trust is not asked
    (root never reads a user's config). Root-run code passes nothing: roots must be root's.
    """
    out: List[Finding] = []
    local = cfg.tiers.local
    lroot = str(local.root)
    st = _root("local", "tiers.local.root", lroot, True, out, owner)
    if st is not None:
        if local.require_mount and st.st_dev == os.stat("/").st_dev:
            out.append(
                Finding(
                    ERROR,
                    f"tiers.local.root {lroot} is on the root filesystem, not a mount of its "
                    "own (mount the local disk there, or set tiers.local.require_mount = false)",
                )
            )
        sv = os.statvfs(lroot)
        free = sv.f_bavail * sv.f_frsize
        need = local.min_free + (cfg.hooks.expected_checkpoint_size or 0)
        if free < need:
            out.append(
                Finding(
                    WARNING,
                    f"tiers.local.root {lroot}: {format_bytes(free)} free, below the "
                    f"{format_bytes(need)} the prolog requires (tiers.local.min_free"
                    + (
                        " + hooks.expected_checkpoint_size)"
                        if cfg.hooks.expected_checkpoint_size
                        else ")"
                    ),
                )
            )
    for name, root in directory_roots(cfg)[1:]:  # the shared directory tiers
        _root(name, f"tiers.{name}.root", root, False, out, owner)
    for sev, msg, _fix in object_findings(cfg):  # the object tier answers (warm or not)
        if sev != "ok":
            out.append(Finding(ERROR if sev == "error" else WARNING, msg))
    ledger_parent = os.path.dirname(str(cfg.ledger.dir).rstrip("/")) or "/"
    if st is not None and not os.path.isdir(ledger_parent):
        out.append(Finding(ERROR, f"ledger.dir {cfg.ledger.dir}: {ledger_parent} does not exist"))
    out.extend(check_trust(cfg, own=owner is not None))
    return out


def own_config(cfg: Config) -> Optional[int]:
    """The caller's uid when ``cfg`` is their own (not root; the file is theirs, or the
    tiers came from tier flags): what :func:`check_roots` accepts as ``owner``."""
    uid = os.geteuid()
    if uid == 0:
        return None
    if cfg.source.startswith("<"):
        return uid
    try:
        return uid if os.stat(cfg.source).st_uid == uid else None
    except OSError:
        return None


def check_trust(cfg: Config, own: bool = False) -> List[Finding]:
    """The config file and the running ckpt-slurm must be root's alone (see the module
    docstring): errors as root, warnings for anyone else. ``own``: a user's own config,
    whose file root never reads (so its trust is not asked)."""
    from slurm_ckpt.ops.install import ckpt_slurm_path, interpreter_of

    level = ERROR if os.geteuid() == 0 else WARNING
    problems: List[str] = []
    if not cfg.source.startswith("<") and not own:  # a file, not a dict or the standalone config
        problems += trust.path_problems(os.path.abspath(cfg.source), "config")
    try:
        exe: Optional[str] = ckpt_slurm_path()
    except CkptError:
        exe = None
    install: List[str] = []
    if exe is not None:
        install += trust.path_problems(exe, "ckpt-slurm executable")
        interp = interpreter_of(exe)
        if interp is not None:
            install += trust.path_problems(interp, "interpreter of ckpt-slurm")
    out = [Finding(level, f"root must not use it: {p}") for p in problems]
    if install:
        # The fix for an installation someone else owns is not to hand it to root (a
        # user's home or venv): it is a root-owned installation for the hooks.
        fix = (
            "for root's hooks and stager, install slurm_ckpt into a root-owned venv "
            "(for example /opt/slurm-ckpt/venv, as scripts/setup does) and run that one"
        )
        first = _strip_fix(install[0])
        more = f" (and {len(install) - 1} more)" if len(install) > 1 else ""
        out.append(Finding(level, f"root must not use this installation: {first}{more}; {fix}"))
    return out


def _strip_fix(problem: str) -> str:
    """A trust problem without its ``(fix: chown root ...)`` advice."""
    cut = problem.rfind(" (fix: ")
    return problem[:cut] if cut > 0 else problem
