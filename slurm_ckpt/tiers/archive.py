"""The ``archive`` kind: a POSIX tree whose committed checkpoints are read-only.

An archive (the cold tier on an HDD array or a tape-backed HSM) keeps history for weeks;
nothing should write into it but a copy that commits a whole checkpoint. On this kind a
checkpoint's payload files lose every write bit *before* its manifest is published, so
from the moment a checkpoint counts no tool of its owner (an ``rsync --inplace``, a
script that "fixes" a file) can change its bytes by accident; deleting it (gc,
``keep_for``) still works, since unlinking needs the directory's write bit, not the
file's. Everything else is the POSIX tier: the same layout, commit, locks and guards.

Chosen in the config with ``kind = "archive"`` in a section whose keys describe a
directory tree (``[tiers.cold]``); it is one module and one line of
:data:`slurm_ckpt.tiers.registry.KINDS`, the shape of any new kind.
"""

from __future__ import annotations

import os
import stat
from typing import Any, Optional

from slurm_ckpt.core import fsio
from slurm_ckpt.core.commit import CheckpointWriter
from slurm_ckpt.core.manifest import Manifest
from slurm_ckpt.core.verify import open_payload
from slurm_ckpt.tiers.posix import PosixTier

__all__ = ["ArchiveTier", "ArchiveWriter"]

#: Every write bit: what a committed payload file of the archive loses.
WRITE_BITS = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH


class ArchiveWriter(CheckpointWriter):
    """A POSIX writer that makes the payload read-only just before the commit."""

    def commit(self) -> Manifest:
        if not self._done:
            files, _problems = fsio.walk_files(self._tmp_fd)  # problems: refused at commit
            for rel, st in files:
                fd = open_payload(self._tmp_fd, rel)
                try:
                    os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~WRITE_BITS)
                finally:
                    os.close(fd)
        return super().commit()


class ArchiveTier(PosixTier):
    """A POSIX tier of read-only checkpoints (see the module docstring)."""

    kind = "archive"

    def writer(
        self, user: str, key: str, step: int, *, copy_of: Optional[Manifest] = None, **kw: Any
    ) -> ArchiveWriter:
        kw.setdefault("chunk_size", self.chunk_size)
        kw.setdefault("streams", self.streams)
        return ArchiveWriter(self.root, user, key, step, where=self.name, copy_of=copy_of, **kw)
