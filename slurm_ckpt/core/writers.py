"""Which processes have a file open for writing: the "is anyone still writing this?" scan.

Why: ``seal`` puts our manifest on a directory another tool wrote (DCP, HF, Lightning,
Orbax). A manifest over bytes that are still changing would be a lie that ``verify``
later reports as corruption. Two scans of sizes and times catch a writer that is busy
while we hash; a writer that has a file open and is idle between two writes (a rank
that has not flushed its last buffer yet) changes nothing we could see. The kernel knows
better: every open file of every process is listed under ``/proc/PID/fd``, with its
access mode in ``/proc/PID/fdinfo/FD``. Root sees every process; any other user sees
their own, which is where their own trainer runs.

Only descriptors open for writing count (``O_WRONLY``/``O_RDWR``): a reader (a
``verify`` in another shell, a data loader) is no reason to refuse. Files are matched by
``(st_dev, st_ino)``, never by name: a name can be renamed away while the writer keeps
writing to the inode.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, List, Mapping, Optional, Tuple

__all__ = ["OpenWriter", "open_writers"]

Ident = Tuple[int, int]


@dataclass(frozen=True)
class OpenWriter:
    """A process holding one of the files open for writing."""

    pid: int
    fd: int
    name: str  # the caller's name for the file (relpath), not the process's


def _writable(pid: str, fd: str) -> bool:
    """True when ``/proc/PID/fdinfo/FD`` says the descriptor is open for writing."""
    try:
        with open(f"/proc/{pid}/fdinfo/{fd}", "rb") as fh:
            info = fh.read(4096)
    except OSError:
        return False
    for line in info.splitlines():
        if line.startswith(b"flags:"):
            try:
                flags = int(line.split()[1], 8)
            except (IndexError, ValueError):
                return False
            return flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)
    return False


def open_writers(
    files: Mapping[Ident, str],
    skip: Iterable[int] = (),
    proc: str = "/proc",
) -> List[OpenWriter]:
    """Every (process, descriptor) that has one of ``files`` (``(st_dev, st_ino)`` ->
    name) open for writing. This process is skipped, and so are ``skip``. Processes that
    vanish or cannot be read mid-scan are passed over (not ours to see)."""
    if not files:
        return []
    ignore = {os.getpid(), *skip}
    out: List[OpenWriter] = []
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return []
    for pid in pids:
        if int(pid) in ignore:
            continue
        try:
            fds = os.listdir(f"{proc}/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            st = _stat(f"{proc}/{pid}/fd/{fd}")
            if st is None:
                continue
            name = files.get((st.st_dev, st.st_ino))
            if name is not None and _writable(pid, fd):
                out.append(OpenWriter(int(pid), int(fd), name))
    return out


def _stat(link: str) -> Optional[os.stat_result]:
    """stat through a ``/proc/PID/fd/N`` link (the kernel's own reference to the open
    file, valid even when its name was removed); None when it went away."""
    try:
        return os.stat(link)
    except OSError:
        return None
