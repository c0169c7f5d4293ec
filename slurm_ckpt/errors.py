"""Errors that reach a user as one line and an exit code.

Every failure a user or an admin can cause (bad config, bad name, full disk, missing
permission, a corrupt checkpoint) is raised as a :class:`CkptError` subclass whose message
is a single, self-contained line. The CLI prints that line and exits with ``exit_code``;
it never shows a traceback for these. Anything else is a bug and may show one.
"""

from __future__ import annotations


class CkptError(Exception):
    """Base class: a one-line message for humans plus the CLI exit code."""

    exit_code = 1

    def __init__(self, message: str) -> None:
        # Keep the message on one line whatever the caller passed in.
        super().__init__(" ".join(str(message).split()))


class ConfigError(CkptError):
    """The site configuration is missing, unreadable or invalid."""

    exit_code = 2


class InvalidName(CkptError):
    """A key, user or file name is unsafe (``..``, absolute, control characters, ...)."""

    exit_code = 2


class TierError(CkptError):
    """A tier cannot be used: missing root, no permission, no space, I/O error."""

    exit_code = 1


class VerifyError(CkptError):
    """Bytes on a tier do not match their manifest (corrupt, truncated, missing, replaced)."""

    exit_code = 1


class NotFound(CkptError):
    """No committed checkpoint matches the request."""

    exit_code = 1


class SlurmError(CkptError):
    """SLURM is missing, unreachable or answered with an error."""

    exit_code = 3


class TimedOut(CkptError):
    """An operation ran into its deadline and was stopped (a child killed, a wait given up).
    Callers with more time later (the stager after the epilog) retry it."""

    exit_code = 1
