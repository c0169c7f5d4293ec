"""What root-run code refuses to touch, as errors a tier's guards raise.

Root runs the hooks over data users write. Before it touches a checkpoint it asks the
checkpoint's tier (:meth:`~slurm_ckpt.tiers.base.Tier.guard_user`,
:meth:`~slurm_ckpt.tiers.base.Tier.guard_step`): each kind knows what can go wrong on it
(a planted symlink on a POSIX tree, a process that is not the owner on an object store).
A refusal is the owner's doing, so it is an :class:`Unflushable`: marked and left alone,
never a reason to keep a node drained. These live with the tiers because the tiers raise
them; the flush engine (:mod:`slurm_ckpt.node.flush_engine`) only reads their codes.
"""

from __future__ import annotations

from slurm_ckpt.errors import TierError

__all__ = ["SquattedUserDir", "Unflushable", "UnsafeCheckpoint", "UnsafeUserDir"]


class Unflushable(TierError):
    """The checkpoint can never be flushed as it is (it holds something root-run code must
    not touch, or belongs to no one it claims to). Marked ``BAD`` on its tier; it must
    not keep a node drained. ``hold_code`` names the reason in the ledger; a subclass
    whose fault is where the checkpoint goes says ``bad_source = False`` (its
    destination ``FAILED``, held, retried after the backoff)."""

    user_caused = True
    hold_code = "unsafe"
    bad_source = True


class UnsafeCheckpoint(Unflushable):
    """A checkpoint holds something root-run code must not touch (a symlink, a special
    file, a hard link, a file of another owner, more files than it may have, a manifest
    that lies about its files). It is the owner's own doing, so it is marked ``BAD`` on
    its tier and left alone - it must not keep a node drained."""


class UnsafeUserDir(Unflushable):
    """``<tier root>/<user>`` cannot be used: a symlink, not a directory, writable by
    others (the owner's doing), or owned by someone else (``squatted``: reported to the
    admin). Nothing of that user is flushed there until it is fixed."""

    hold_code = "unsafe_dir"
    bad_source = False


class SquattedUserDir(UnsafeUserDir):
    """Another user owns ``<tier root>/<user>`` (they created it first)."""

    hold_code = "squatted"
