"""Tier kinds for the contract suite: each yields a factory ``make(name) -> Tier`` that
builds a fresh, empty tier of that kind, on real storage.

To run the whole contract suite on a new kind of tier, add one fixture function to
:data:`KINDS` (the object tier adds ``s3``, on a real SeaweedFS server).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, Iterator

import pytest

from slurm_ckpt.tiers.base import Tier
from slurm_ckpt.tiers.posix import PosixTier

MakeTier = Callable[[str], Tier]
#: Small chunks, so that multi-chunk files and parallel ranges are cheap to test.
CHUNK = 64 * 1024


def _posix_tmpfs(mounts, tmp_path: Path) -> Iterator[MakeTier]:
    def make(name: str) -> Tier:
        root = mounts.tmpfs("64m", name)
        return PosixTier(name, str(root), chunk_size=CHUNK, streams=3, buffer_size=16 * 1024)

    yield make


def _posix_ext4(mounts, tmp_path: Path) -> Iterator[MakeTier]:
    def make(name: str) -> Tier:
        root = mounts.loopfs(64, "ext4", name)
        return PosixTier(name, str(root), chunk_size=CHUNK, streams=3, buffer_size=16 * 1024)

    yield make


KINDS: Dict[str, Callable[..., Iterator[MakeTier]]] = {
    "posix-tmpfs": _posix_tmpfs,
    "posix-ext4": _posix_ext4,
}


@pytest.fixture(params=sorted(KINDS))
def make_tier(request, mounts, tmp_path: Path) -> Iterator[MakeTier]:
    """A factory of fresh tiers of one kind (the suite runs once per kind)."""
    yield from KINDS[request.param](mounts, tmp_path)
