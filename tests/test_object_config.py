"""``[tiers.object]`` and ``[tiers.cold]``: validated with one-line errors; a config with
a local and an object tier and no PFS is a site without a parallel filesystem."""

from __future__ import annotations

import pytest

from slurm_ckpt.core.config import Config
from slurm_ckpt.errors import ConfigError
from slurm_ckpt.tiers.registry import ORDER, tiers_from_config, warm_tiers
from slurm_ckpt.tiers.s3 import S3Tier

LOCAL = {"root": "/l", "require_mount": False, "min_free": 0}
OBJ = {"endpoint": "http://127.0.0.1:8333", "bucket": "ckpt", "prefix": "site/a"}


def test_object_without_pfs_is_the_warm_tier() -> None:
    cfg = Config.from_dict({"tiers": {"local": LOCAL, "object": OBJ}})
    assert cfg.tiers.pfs is None and cfg.tiers.warm == "object"
    tiers = tiers_from_config(cfg)
    assert list(tiers) == ["local", "object"] and isinstance(tiers["object"], S3Tier)
    assert warm_tiers(cfg) == ["object"]
    o = cfg.tiers.object
    assert (o.part_size, o.concurrency, o.region, o.every) == (16 * 2**20, 8, "us-east-1", 0.0)
    assert Config.from_dict(cfg.to_dict()) == cfg


def test_both_warm_tiers_and_cold_in_order() -> None:
    cfg = Config.from_dict(
        {
            "tiers": {
                "local": LOCAL,
                "pfs": {"root": "/p"},
                "object": {**OBJ, "every": "6h", "part_size": "32MiB"},
                "cold": {"root": "/c", "every": "1d", "keep_for": "30d"},
            }
        }
    )
    assert cfg.tiers.warm == "pfs" and warm_tiers(cfg) == ["pfs", "object"]
    assert list(tiers_from_config(cfg)) == list(ORDER)
    assert cfg.tiers.object.every == 6 * 3600 and cfg.tiers.cold.keep_for == 30 * 86400
    # parts are whole hash chunks, never below S3's 5 MiB
    t = tiers_from_config(cfg)["object"]
    assert t.part_len(64 * 2**20) == 64 * 2**20 and t.part_len(2**20) == 32 * 2**20
    # A copy may split large chunks into whole fractions of about part_size (>= 5 MiB).
    assert t.part_len(256 * 2**20, split=True) == 32 * 2**20
    assert t.part_len(48 * 2**20, split=True) == 48 * 2**20  # < 2 parts: whole chunks


@pytest.mark.parametrize(
    "bad, msg",
    [
        ({"bucket": "Bad_Bucket"}, "tiers.object.bucket: not a bucket name"),
        ({"endpoint": "s3.example.org"}, "expected an http:// or https:// URL"),
        ({"prefix": "/abs"}, "must be a relative key prefix"),
        ({"prefix": "a/../b"}, "must be a relative key prefix"),
        ({"part_size": "1MiB"}, "tiers.object.part_size: must be at least 5242880 bytes"),
        ({"concurrency": 0}, "tiers.object.concurrency: must be at least 1"),
        ({"colour": 1}, "unknown key 'tiers.object.colour'"),
    ],
)
def test_bad_object_config_is_one_line(bad, msg) -> None:
    with pytest.raises(ConfigError) as ei:
        Config.from_dict({"tiers": {"local": LOCAL, "object": {**OBJ, **bad}}})
    text = str(ei.value)
    assert msg in text and "\n" not in text


def test_no_warm_tier_at_all() -> None:
    with pytest.raises(ConfigError, match=r"\[tiers.pfs\] is missing .*tiers.object"):
        Config.from_dict({"tiers": {"local": LOCAL}})
