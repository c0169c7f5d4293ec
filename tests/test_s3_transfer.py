"""The object tier's transfer paths on the session's SeaweedFS: the client adds no
checksum pass of its own, and a round trip through the tier is byte-exact at odd sizes
(0, 1 byte, one part, two parts and 17 bytes)."""

from __future__ import annotations

import os
from pathlib import Path

from slurm_ckpt.tiers.copy import copy_checkpoint
from slurm_ckpt.tiers.posix import PosixTier
from slurm_ckpt.tiers.s3 import S3Tier

MiB = 2**20


def tier(s3_server, **kw) -> S3Tier:
    return S3Tier(
        "object",
        endpoint=s3_server.endpoint,
        bucket=s3_server.bucket(),
        prefix=s3_server.fresh_prefix("xfer"),
        part_size=5 * MiB,
        min_part=5 * MiB,
        chunk_size=1 * MiB,
        **kw,
    )


def test_the_client_adds_no_checksum_pass_of_its_own(s3_server) -> None:
    """Every byte is hashed against the manifest by whoever reads it, and every part
    carries the CRC32 we computed as it filled: botocore (>= 1.36) would otherwise add a
    CRC of its own to requests and check one over every response, another pass over each
    byte. Set explicitly, so a user's ``AWS_*_CHECKSUM_*`` environment cannot change it."""
    c = tier(s3_server).client()
    assert c.meta.config.response_checksum_validation == "when_required"
    assert c.meta.config.request_checksum_calculation == "when_required"


def test_an_upload_and_download_through_the_tier_is_byte_exact(s3_server, tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    local = PosixTier("local", str(tmp_path / "a"), chunk_size=1 * MiB)
    sizes = {"a.bin": 11 * MiB + 17, "b.bin": 1, "c.bin": 0, "d.bin": 5 * MiB}
    payload = {name: os.urandom(n) for name, n in sizes.items()}
    with local.writer("alice", "run", 3) as w:
        w.write_buffers(payload)
    obj = tier(s3_server, concurrency=3)
    copy_checkpoint(local, obj, "alice", "run", 3)
    assert obj.verify("alice", "run", 3).ok
    back = PosixTier("back", str(tmp_path / "b"))
    copy_checkpoint(obj, back, "alice", "run", 3)
    step = tmp_path / "b" / "alice" / "run" / "step-0000000003"
    for name, data in payload.items():
        assert (step / name).read_bytes() == data
