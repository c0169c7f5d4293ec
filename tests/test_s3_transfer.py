"""The object tier's transfer paths on the session's SeaweedFS: ranged reads land in
the caller's buffer straight from the socket (and give their connection back to the
pool), the client asks for no response checksum of its own, and a round trip through
the tier is byte-exact at odd offsets and sizes."""

from __future__ import annotations

import os
from pathlib import Path

from slurm_ckpt.tiers.copy import copy_checkpoint
from slurm_ckpt.tiers.posix import PosixTier
from slurm_ckpt.tiers.s3 import S3Tier
from slurm_ckpt.tiers.s3_client import read_body_into

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


def test_a_ranged_get_is_read_from_the_socket_into_the_buffer_and_pooled(s3_server) -> None:
    t = tier(s3_server)
    data = os.urandom(3 * MiB + 123)
    c = t.client()
    # Every byte is hashed against the manifest by whoever reads it: no CRC of botocore's
    # own over each response (nor one it adds to requests).
    assert c.meta.config.response_checksum_validation == "when_required"
    assert c.meta.config.request_checksum_calculation == "when_required"
    okey = t.object_key("alice", "run", 1, "blob")
    c.put_object(Bucket=t.bucket, Key=okey, Body=data)
    for lo, n in ((0, 1), (1, MiB), (MiB + 7, 2 * MiB), (len(data) - 5, 5)):
        r = c.get_object(Bucket=t.bucket, Key=okey, Range=f"bytes={lo}-{lo + n - 1}")
        body = r["Body"]
        raw = body._raw_stream
        buf = bytearray(n + 10)  # more room than the range: only n bytes are there
        got = read_body_into(body, memoryview(buf), n)
        assert got == n
        assert bytes(buf[:n]) == data[lo : lo + n]
        assert buf[n:] == bytearray(10)
        # Read to its end: the connection went back to the pool (urllib3 clears it).
        assert raw._connection is None
        # ... and urllib3 never saw the bytes (its read-then-copy path counts them).
        assert raw._fp_bytes_read == 0
        body.close()


def test_a_body_read_short_says_how_much_came(s3_server) -> None:
    t = tier(s3_server)
    c = t.client()
    okey = t.object_key("alice", "run", 1, "short")
    c.put_object(Bucket=t.bucket, Key=okey, Body=b"abc")
    body = c.get_object(Bucket=t.bucket, Key=okey)["Body"]
    buf = bytearray(8)
    assert read_body_into(body, memoryview(buf), 8) == 3
    assert bytes(buf[:3]) == b"abc"
    body.close()


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
