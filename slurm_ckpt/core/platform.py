"""The one supported operating system: Linux.

Why Linux only: verification and copies rely on Linux system calls and files
(``copy_file_range``, ``posix_fadvise``, ``O_DIRECT``, ``/proc`` for the processes root
watches, ``flock`` semantics, ``statvfs`` of node-local mounts), and SLURM runs there.
Elsewhere these fail late and obscurely (an ``AttributeError`` deep in a copy), so the
entry points refuse at once with one line instead.
"""

from __future__ import annotations

import sys

from slurm_ckpt.errors import CkptError

__all__ = ["SUPPORTED", "require_supported_os"]

#: ``sys.platform`` values slurm_ckpt runs on.
SUPPORTED = ("linux",)


def require_supported_os(platform: str = sys.platform) -> None:
    """CkptError (one line) unless this is Linux."""
    if not platform.startswith(SUPPORTED):
        raise CkptError(
            f"slurm_ckpt runs on Linux only (this is {platform!r}): use a Linux machine, "
            "a Linux VM or a container"
        )
