"""Errors that reach a user as one line and an exit code.

Every failure a user or an admin can cause (bad config, bad name, full disk, missing
permission, a corrupt checkpoint) is raised as a :class:`CkptError` subclass whose message
is a single, self-contained line. The CLI prints that line and exits with ``exit_code``;
it never shows a traceback for these. Anything else is a bug and may show one.
"""

from __future__ import annotations

from typing import Optional

# --------------------------------------------------------------------------- exit codes
# The one exit-code table of every slurm_ckpt command (``ckpt-slurm``, ``ckpt-srun``'s own
# failures, the hook scripts). README.md shows it; tests/test_cli_bad_inputs.py holds each
# command to it.

#: Success: the operation did what was asked, and found nothing wrong.
EXIT_OK = 0
#: An operation failed, or a check found a problem (a corrupt checkpoint, a failed flush).
EXIT_FAILED = 1
#: Bad usage or configuration: unknown option, malformed value, invalid config file.
EXIT_USAGE = 2
#: SLURM is missing, unreachable or answered with an error.
EXIT_SLURM = 3
#: Not ready: jobs or unflushed checkpoints still on the node(s) (``maint``, ``guard``).
EXIT_NOT_READY = 4
#: Interrupted (Ctrl-C, SIGINT): 128 + 2, as shells report it.
EXIT_INTERRUPTED = 130

EXIT_CODES = {
    EXIT_OK: "ok",
    EXIT_FAILED: "failed operation, or a finding (corrupt or missing checkpoint, ...)",
    EXIT_USAGE: "usage or configuration error",
    EXIT_SLURM: "SLURM unreachable or answered with an error",
    EXIT_NOT_READY: "not ready (jobs or unflushed checkpoints still on the node)",
    EXIT_INTERRUPTED: "interrupted",
}


class CkptError(Exception):
    """Base class: a one-line message for humans plus the CLI exit code."""

    exit_code = EXIT_FAILED
    #: The failure was the doing of the user whose data it is (their permissions, their
    #: quota, their signal to root's child running as them): root holds that user's
    #: checkpoint instead of keeping a node drained (:mod:`slurm_ckpt.node.retry`).
    user_caused: bool = False
    #: The reason code a held checkpoint records (``hold`` in the ledger and status).
    hold_code: Optional[str] = None
    #: The checkpoint itself can never be copied as it is (corrupt, unsafe to touch): the
    #: flush engine marks it ``BAD`` where it is (under ``hold_code``) instead of marking
    #: its destination ``FAILED``; it must not keep a node drained.
    bad_source: bool = False

    def __init__(self, message: str) -> None:
        # Keep the message on one line whatever the caller passed in.
        super().__init__(" ".join(str(message).split()))


class ConfigError(CkptError):
    """The site configuration is missing, unreadable or invalid."""

    exit_code = EXIT_USAGE


class InvalidName(CkptError):
    """A key, user or file name is unsafe (``..``, absolute, control characters, ...)."""

    exit_code = EXIT_USAGE


class TierError(CkptError):
    """A tier cannot be used: missing root, no permission, no space, I/O error."""

    exit_code = EXIT_FAILED


class StepLocked(TierError):
    """A step's lock file (``.lock-step-N`` below the owner's own directory, so held by a
    process of the owner's) stayed locked for longer than root's copy waits: the owner's
    doing - that checkpoint is held (``locked``) and retried after its backoff; it never
    keeps a node drained."""

    user_caused = True
    hold_code = "locked"


class VerifyError(CkptError):
    """Bytes on a tier do not match their manifest (corrupt, truncated, missing, replaced)."""

    exit_code = EXIT_FAILED


class NotFound(CkptError):
    """No committed checkpoint matches the request."""

    exit_code = EXIT_FAILED


class StepConflict(CkptError):
    """The destination tier already holds a *different* checkpoint committed under this
    step (two runs of one series took different paths to it). It is never overwritten
    nor deleted: the copy is marked ``conflict`` (held - it keeps no node drained - and
    shown by ``status``), the local copy is kept, and it is tried again after the backoff
    (an older conflicting copy on the warm tier is replaced then, a newer one never)."""

    exit_code = EXIT_FAILED
    user_caused = True
    hold_code = "conflict"


class SlurmError(CkptError):
    """SLURM is missing, unreachable or answered with an error."""

    exit_code = EXIT_SLURM


class TimedOut(CkptError):
    """An operation ran into its deadline and was stopped (a child killed, a wait given up).
    Callers with more time later (the stager after the epilog) retry it."""

    exit_code = EXIT_FAILED


class UsageError(CkptError):
    """A command-line value is malformed or out of range (what click calls a usage error,
    raised where click's own checks cannot see it)."""

    exit_code = EXIT_USAGE


class NotReady(CkptError):
    """Jobs or unflushed checkpoints are still on the node(s): not safe to go ahead."""

    exit_code = EXIT_NOT_READY


class UnsupportedState(CkptError):
    """A value in the training state cannot be stored without pickle (lambda, object...).
    Raised by ``slurm_ckpt.torch.capture``; defined here so that catching it needs no
    torch."""

    exit_code = EXIT_USAGE
