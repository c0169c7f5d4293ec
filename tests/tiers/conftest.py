"""Tier kinds for the contract suite: each yields a factory ``make(name) -> Tier`` that
builds a fresh, empty tier of that kind, on real storage.

To run the whole contract suite on a new kind of tier, add one fixture function to
:data:`KINDS`: ``s3`` is the object tier on a real SeaweedFS server, ``cold`` a POSIX
tier on a loop-mounted filesystem whose device is bandwidth-capped like an HDD,
``archive`` the read-only POSIX kind (:mod:`slurm_ckpt.tiers.archive`) built the way a
site gets it, from ``[tiers.cold] kind = "archive"`` through the registry.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, Iterator

import pytest

from slurm_ckpt.core.config import Config
from slurm_ckpt.tiers.base import Tier
from slurm_ckpt.tiers.posix import PosixTier
from slurm_ckpt.tiers.registry import tiers_from_config
from slurm_ckpt.tiers.s3 import S3Tier

MakeTier = Callable[[str], Tier]
#: Small chunks, so that multi-chunk files and parallel ranges are cheap to test.
CHUNK = 64 * 1024
#: The cold tier's device bandwidth (bytes/s, reads and writes each): HDD-like.
COLD_BPS = 40 * 10**6


def _posix_tmpfs(request, mounts, tmp_path: Path) -> Iterator[MakeTier]:
    def make(name: str) -> Tier:
        root = mounts.tmpfs("64m", name)
        return PosixTier(name, str(root), chunk_size=CHUNK, streams=3, buffer_size=16 * 1024)

    yield make


def _posix_ext4(request, mounts, tmp_path: Path) -> Iterator[MakeTier]:
    def make(name: str) -> Tier:
        root = mounts.loopfs(64, "ext4", name)
        return PosixTier(name, str(root), chunk_size=CHUNK, streams=3, buffer_size=16 * 1024)

    yield make


def _cold(request, mounts, tmp_path: Path) -> Iterator[MakeTier]:
    """The cold tier: a POSIX tree on an xfs loop mount capped at 40 MB/s each way."""

    def make(name: str) -> Tier:
        root = mounts.loopfs(320, "xfs", name, bps=COLD_BPS)
        return PosixTier(name, str(root), chunk_size=CHUNK, streams=2, buffer_size=16 * 1024)

    yield make


def _archive(request, mounts, tmp_path: Path) -> Iterator[MakeTier]:
    """The archive kind as a site configures it: ``kind = "archive"`` in [tiers.cold]."""

    def make(name: str) -> Tier:
        copy = {"chunk_size": CHUNK, "streams": 3, "buffer_size": 16 * 1024}
        local = {"root": str(tmp_path / f"{name}-local"), "require_mount": False, "min_free": 0}
        pfs = {"kind": "posix", "root": str(tmp_path / f"{name}-pfs")}
        cold = {"kind": "archive", "root": str(mounts.tmpfs("64m", name))}
        tiers = {"local": local, "pfs": pfs, "cold": cold}
        return tiers_from_config(Config.from_dict({"tiers": tiers, "copy": copy}))["cold"]

    yield make


def _s3(request, mounts, tmp_path: Path) -> Iterator[MakeTier]:
    """The object tier on the session's SeaweedFS, one fresh prefix per tier."""
    server = request.getfixturevalue("s3_server")
    bucket = server.bucket("contract")

    def make(name: str) -> Tier:
        return S3Tier(
            name,
            endpoint=server.endpoint,
            bucket=bucket,
            prefix=f"{server.fresh_prefix()}/{name}",
            chunk_size=CHUNK,
            concurrency=3,
            buffer_size=16 * 1024,
        )

    yield make


KINDS: Dict[str, Callable[..., Iterator[MakeTier]]] = {
    "archive": _archive,
    "posix-tmpfs": _posix_tmpfs,
    "posix-ext4": _posix_ext4,
    "cold": _cold,
    "s3": _s3,
}


@pytest.fixture(params=sorted(KINDS))
def make_tier(request, mounts, tmp_path: Path) -> Iterator[MakeTier]:
    """A factory of fresh tiers of one kind (the suite runs once per kind)."""
    yield from KINDS[request.param](request, mounts, tmp_path)
