"""The warm tier as every root-run flusher reaches it: the PFS, or the object store on a
site without one (``cfg.tiers.warm``).

The flushers (epilog, prolog rescue and staging, stager, root and user ``ckpt-slurm
flush``, ckpt-srun) name the warm tier through
:func:`~slurm_ckpt.tiers.registry.warm_tier`, never ``tiers["pfs"]``, and guard it
through the tier's own guards (:meth:`~slurm_ckpt.tiers.base.Tier.guard_user`,
:meth:`~slurm_ckpt.tiers.base.Tier.guard_step`): on a POSIX tier they look at owners,
modes and links (:mod:`slurm_ckpt.tiers.posix_guard`); an object store has none of
those and keeps the rule below (:meth:`slurm_ckpt.tiers.s3.S3Tier.guard_user`).

The object store's rule
-----------------------
Its keys hold the owner (``<prefix>/<user>/<key>/step-N/...``) and the store itself has
no owners: whoever holds the credentials may write any key. So root never writes user
data there itself. A copy runs in a child that has become the checkpoint's owner
(:func:`~slurm_ckpt.node.asuser.run_as`), and the tier's ``guard_user`` refuses unless that
process *is* the user whose prefix it is about to write (its uid is the owner's, and the
owner's name maps to that uid): data read with one user's permissions lands under that
user's prefix only.

The credentials in that child are root's, resolved by root before the fork
(:func:`lend_credentials`, called by :class:`~slurm_ckpt.node.work.NodeWork`): the child
has the user's ``HOME``, and must not read that user's ``~/.aws`` (a profile of the same
name there would send root's flush through the user's keys, and the user's config file
would shape the client), so it is pointed at no AWS files at all. A process that changed
its uid is not dumpable, so the user cannot read root's keys out of its memory.

Nor may the child's botocore read anything else of the user's: its service models (a
``~/.aws/models`` or ``AWS_DATA_PATH`` model can point any operation at another user's
keys), config or credential files. So root also builds the child's botocore session
before the fork (:func:`~slurm_ckpt.tiers.s3_seal.sealed_session`), and every request
the child's client makes is checked, as built, to stay below ``<prefix>/<owner>/``
(:func:`~slurm_ckpt.tiers.s3_seal.install_guard`).
"""

from __future__ import annotations

import os
import pwd
from typing import Any, Dict, Optional

from slurm_ckpt.core.config import Config
from slurm_ckpt.errors import TierError
from slurm_ckpt.tiers.base import Tier
from slurm_ckpt.tiers.registry import object_tier_class, tiers_from_config

__all__ = [
    "lend_credentials",
    "owner_tiers",
]

#: Root's object-store credentials, resolved before forking owner children (see the
#: module docstring); ``_LENT_SET`` says root has resolved them (even to nothing).
_LENT: Optional[Dict[str, str]] = None
_LENT_SET = False
#: Root's sealed botocore session for those children (see the module docstring).
_SEALED: Any = None


def lend_credentials(cfg: Config) -> None:
    """Root, before it forks children that become a checkpoint's owner: resolve the object
    tier's credentials (root's environment or profile) once, for :func:`owner_tiers` in
    those children. Nothing to do without an object tier or when not root. Resolved
    again by every NodeWork, so a long-running stager picks up rotated keys."""
    global _LENT, _LENT_SET, _SEALED
    if cfg.tiers.object is None or os.geteuid() != 0:
        return
    o = cfg.tiers.object
    object_tier_class()  # one line naming the [s3] extra when boto3 is missing
    from slurm_ckpt.tiers.s3_client import boto_config, resolve_credentials

    _LENT = resolve_credentials(
        o.profile, None if o.credentials_file is None else str(o.credentials_file)
    )
    if _SEALED is None:
        from slurm_ckpt.tiers.s3_seal import sealed_session

        _SEALED = sealed_session(o.endpoint, o.region, boto_config(o.region, 4))
    _LENT_SET = True


def owner_tiers(cfg: Config) -> Dict[str, Tier]:
    """The configured tiers for a child running as a checkpoint's owner: with root's lent
    object-store credentials and no AWS files of the user's (see the module docstring).
    Outside such a child (root itself, a user's own process) the plain tiers."""
    if not _LENT_SET or os.geteuid() == 0:
        return tiers_from_config(cfg)
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_DATA_PATH"):
        os.environ.pop(name, None)  # root's environment; the rest (a CA bundle) stays
    os.environ["AWS_CONFIG_FILE"] = os.devnull
    os.environ["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull
    try:
        owner = pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        raise TierError(f"uid {os.geteuid()} has no name: no object-store access") from None
    return tiers_from_config(cfg, credentials=_LENT or None, sealed_for=(_SEALED, owner))
