"""The registry is the one place that knows the tier kinds: a section's ``kind`` picks
what builds its tier, a kind that does not exist or does not read the section's keys is
one line, and the archive kind (one module, one registry line) is a real tier whose
committed payload nobody can write."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from slurm_ckpt.core.config import Config
from slurm_ckpt.errors import ConfigError
from slurm_ckpt.tiers.base import Tier
from slurm_ckpt.tiers.registry import KINDS, kind_problems, shared_tiers, tiers_from_config

from .test_contract import KEY, USER, payload, save


def site(tmp_path: Path, cold_kind: str = "archive", pfs_kind: str = "posix") -> Config:
    for sub in "lpc":
        (tmp_path / sub).mkdir(exist_ok=True)
    return Config.from_dict(
        {
            "tiers": {
                "local": {"root": str(tmp_path / "l"), "require_mount": False, "min_free": 0},
                "pfs": {"kind": pfs_kind, "root": str(tmp_path / "p")},
                "cold": {"kind": cold_kind, "root": str(tmp_path / "c")},
            }
        }
    )


def test_each_section_is_built_by_its_kind(tmp_path: Path) -> None:
    cfg = site(tmp_path)
    tiers = tiers_from_config(cfg)
    assert list(tiers) == ["local", *shared_tiers(cfg)] == ["local", "pfs", "cold"]
    assert [t.kind for t in tiers.values()] == ["posix", "posix", "archive"]
    assert all(isinstance(t, Tier) and t.directory() is t for t in tiers.values())
    plain = tiers_from_config(site(tmp_path, cold_kind="posix"))["cold"]
    assert plain.kind == "posix"


@pytest.mark.parametrize(
    "cold, pfs, message",
    [
        ("gcs", "posix", 'tiers.cold.kind: "gcs" is not a tier kind (one of: posix, s3, archive)'),
        ("archive", "s3", 'a "s3" tier does not read the keys of [tiers.pfs] (kinds that do: '),
    ],
)
def test_a_kind_that_does_not_exist_or_fit_is_one_line(
    tmp_path: Path, cold: str, pfs: str, message: str
) -> None:
    cfg = site(tmp_path, cold_kind=cold, pfs_kind=pfs)
    assert len(kind_problems(cfg)) == 1
    with pytest.raises(ConfigError) as exc:
        tiers_from_config(cfg)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_the_archive_commits_read_only_payload_and_still_deletes(mounts) -> None:
    root = mounts.tmpfs("16m", "archive")
    cfg = site(Path(str(root)))
    tier = tiers_from_config(cfg)["cold"]
    assert tier.kind == "archive" and KINDS["archive"][0] == "posix"
    save(tier, 3)
    step_dir = Path(tier.location(USER, KEY, 3))
    for rel in payload(3):
        mode = os.stat(step_dir / rel).st_mode
        assert stat.S_IMODE(mode) & 0o222 == 0, rel
    assert tier.verify(USER, KEY, 3).ok
    tier.delete(USER, KEY, 3)
    assert tier.steps(USER, KEY) == [] and not step_dir.exists()
