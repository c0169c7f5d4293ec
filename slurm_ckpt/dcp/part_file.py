"""Opening one committed DCP part file on a tier, for the loader to read.

Both ways of loading (:mod:`slurm_ckpt.dcp.reading`: whole parts, verified up front;
:mod:`slurm_ckpt.dcp.ranged`: only the chunks a plan needs) start the same way: open the
step's reader on the tier, check that the manifest's file is the part the DCP metadata
names (its content hash), and hand the fast reader an fd (a POSIX tier) or the stream (an
object store). Written once here so that the binding check cannot differ between them.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, NamedTuple

from slurm_ckpt.core.fastread import ReadJob
from slurm_ckpt.errors import VerifyError
from slurm_ckpt.tiers.base import Tier

__all__ = ["OpenPart", "open_part"]


class OpenPart(NamedTuple):
    """A part open for reading: the fast reader's job, the step's chunk size and the
    place to name in errors."""

    job: ReadJob
    chunk_size: int
    where: str


@contextmanager
def open_part(
    tier: Tier, user: str, key: str, step: int, relpath: str, want: str
) -> Iterator[OpenPart]:
    """``relpath`` of ``key``'s ``step`` on ``tier``, open while the block runs.

    Raises :class:`VerifyError` when the committed file's hash is not ``want`` (another
    part than the metadata names), :class:`KeyError` when the manifest has no such file,
    and what the tier raises when it cannot open the step (TierError, NotFound, OSError):
    the caller decides whether another tier may serve it."""
    where = tier.where(user, key, step)
    with tier.reader(user, key, step) as tr:
        entry = tr.manifest.file(relpath)
        if entry.hash != want:
            raise VerifyError(f"{where}: {relpath} is not the part the metadata names")
        src = tr.open(relpath)
        try:
            fd = src.fileno()
            job = ReadJob(relpath, entry, fd, None if fd is not None else src)
            yield OpenPart(job, tr.manifest.chunk_size, where)
        finally:
            src.close()
