"""Whose a copy's work directory is, and whether that writer is gone.

A copy's work directory is named after its writer, ``<host>.<pid>.<rand>``, so that a
copy killed midway can be resumed by the next copy of that step on the same node
(:meth:`slurm_ckpt.core.commit.CheckpointWriter.resumable`). Apart from
:mod:`slurm_ckpt.core.commit` because it is a question about processes (this node's
name, a pid that may be gone, the writers of this process alive now), not about the
commit protocol, which only asks "may I claim this directory?".
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
from typing import Set

__all__ = ["dead_here", "hold_partial", "host_tag", "release_partial", "writer_id"]

#: Work directories of copies this process is writing now (by path): a writer of this
#: process never claims another's (two threads copying one step from two sources).
_LIVE_PARTIALS: Set[str] = set()
_LIVE_LOCK = threading.Lock()


def host_tag() -> str:
    """This node's name as it goes into a work directory's name: the short host name,
    letters, digits, ``-`` and ``_`` only (a copy's writer id is ``<host>.<pid>.<rand>``)."""
    name = socket.gethostname().split(".")[0]
    tag = "".join(c for c in name if c.isascii() and (c.isalnum() or c in "-_"))[:64]
    return tag or "host"


def writer_id() -> str:
    """A copy's writer id, unique among all writers of all nodes: ``<host>.<pid>.<rand>``."""
    return f"{host_tag()}.{os.getpid()}.{secrets.token_hex(4)}"


def dead_here(writer: str) -> bool:
    """Is the writer ``<host>.<pid>.<rand>`` one of this node's that is gone (so its work
    directory may be resumed)? Never for another node's (its liveness is unknowable here)."""
    parts = writer.split(".")
    if len(parts) != 3 or parts[0] != host_tag() or not parts[1].isdigit():
        return False
    pid = int(parts[1])
    if pid == os.getpid():
        return True  # ours: an earlier writer of this process (live ones are excluded)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def hold_partial(path: str) -> Set[str]:
    """Register ``path`` as the work directory of a copy this process writes now; returns
    every such path (none of them may be claimed by another writer of this process)."""
    with _LIVE_LOCK:
        _LIVE_PARTIALS.add(path)
        return set(_LIVE_PARTIALS)


def release_partial(path: str) -> None:
    """The copy writing ``path`` ended (committed or aborted)."""
    with _LIVE_LOCK:
        _LIVE_PARTIALS.discard(path)
