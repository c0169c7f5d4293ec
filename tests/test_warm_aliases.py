"""The warm tier is called "warm" in code; the old "pfs" names users may have written
keep working for one release (each with a DeprecationWarning), and the ledger's on-disk
slot stays "pfs" so ledgers already on disk read as before."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from slurm_ckpt import Checkpointer, CkptError
from slurm_ckpt.core.config import Config
from slurm_ckpt.job.options import Options, build_config, resolve_aliases
from slurm_ckpt.ledger.record import WARM_SLOT, shown_tier

STATE = {"w": np.arange(256, dtype=np.float32)}
OBJ = {"endpoint": "http://127.0.0.1:8333", "bucket": "ckpt", "prefix": "site/a"}


def test_old_pfs_keywords_and_attribute_still_work_with_a_warning(tmp_path: Path) -> None:
    with pytest.warns(DeprecationWarning, match=r"pfs= is deprecated, say warm="):
        ckpt = Checkpointer(
            local=tmp_path / "l",
            pfs=tmp_path / "p",
            key="run",
            install_signals=False,
            end_time_fn=None,
        )
    assert ckpt.warm is not None and ckpt.config.tiers.pfs is not None
    assert str(ckpt.config.tiers.pfs.root) == str(tmp_path / "p")
    ckpt.save(STATE, step=1)
    ckpt.close()
    with pytest.warns(DeprecationWarning, match=r"Checkpointer\.pfs is deprecated"):
        old = ckpt.pfs
    assert old is ckpt.warm
    assert [i.step for i in ckpt.warm.steps(ckpt.user, "run")] == [1]


def test_pfs_bandwidth_is_an_alias_of_warm_bandwidth(tmp_path: Path) -> None:
    with pytest.warns(DeprecationWarning, match=r"pfs_bandwidth= is deprecated"):
        ckpt = Checkpointer(
            local=tmp_path / "l",
            warm=tmp_path / "p",
            key="run",
            pfs_bandwidth="20MB/s",
            install_signals=False,
            end_time_fn=None,
        )
    assert ckpt.config.tiers.pfs is not None
    assert ckpt.config.tiers.pfs.bandwidth_limit == 20e6
    ckpt.close()


def test_the_new_names_warn_nothing(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        ckpt = Checkpointer(
            local=tmp_path / "l",
            warm=tmp_path / "p",
            key="run",
            warm_bandwidth="20MB/s",
            install_signals=False,
            end_time_fn=None,
        )
        assert ckpt.warm is not None and ckpt.warm.name == ckpt.config.tiers.warm
        ckpt.close()


def test_old_and_new_name_together_is_a_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(CkptError, match=r"give warm= or its old name pfs=, not both"):
        Checkpointer(local=tmp_path / "l", warm=tmp_path / "a", pfs=tmp_path / "b", key="r")
    opts = Options(warm_bandwidth="1MB/s", pfs_bandwidth="2MB/s")
    with pytest.raises(CkptError, match=r"warm_bandwidth= or its old name pfs_bandwidth="):
        resolve_aliases(None, opts)


def test_warm_bandwidth_caps_the_object_store_on_a_site_without_a_pfs() -> None:
    cfg = Config.from_dict(
        {"tiers": {"local": {"root": "/l", "require_mount": False, "min_free": 0}, "object": OBJ}}
    )
    got = build_config(cfg, None, None, Options(warm_bandwidth="3MB/s"))
    assert got.tiers.warm == "object" and got.tiers.object is not None
    assert got.tiers.object.bandwidth_limit == 3e6
    with pytest.raises(CkptError, match=r"warm= \(a directory\) needs a \[tiers.pfs\] site"):
        build_config(cfg, None, "/somewhere", Options())


def test_the_ledger_slot_stays_pfs_on_disk_and_shows_as_the_warm_tier() -> None:
    assert WARM_SLOT == "pfs"  # ledgers already on disk say so; never change it
    assert shown_tier(WARM_SLOT, "object") == "object"
    assert shown_tier("local", "object") == "local"


def test_restore_tiers_warm_names_the_warm_tier_and_pfs_is_its_alias(tmp_path: Path) -> None:
    from slurm_ckpt.job.restore import check_tier_names

    assert check_tier_names(["warm"], ["local", "pfs"], "pfs") == ["pfs"]
    assert check_tier_names(["pfs"], ["local", "pfs"], "pfs") == ["pfs"]  # the PFS itself
    assert check_tier_names(["warm", "local"], ["local", "object"], "object") == [
        "object",
        "local",
    ]
    with pytest.warns(DeprecationWarning, match=r'say "warm"'):
        assert check_tier_names(["pfs"], ["local", "object"], "object") == ["object"]
    with pytest.raises(CkptError, match=r"no tier 'warm' here"):
        check_tier_names(["warm"], ["local"], "object")  # laptop mode: no warm tier
    ckpt = Checkpointer(local=tmp_path / "l", warm=tmp_path / "p", key="run", install_signals=False)
    ckpt.save(STATE, step=4)
    ckpt.wait()
    ckpt.close()
    again = Checkpointer(
        local=tmp_path / "l2", warm=tmp_path / "p", key="run", install_signals=False
    )
    got = again.restore(tiers=["warm"])
    assert got is not None and got.step == 4 and got.tier == "pfs"
    again.close()


def test_site_config_keep_pfs_keys_are_read_as_keep_warm_for_one_release(tmp_path: Path) -> None:
    base = {
        "tiers": {
            "shared": ["pfs"],
            "local": {"root": str(tmp_path / "l")},
            "pfs": {"kind": "posix", "root": str(tmp_path / "p")},
        }
    }
    with pytest.warns(DeprecationWarning, match=r"retention\.keep_pfs is deprecated"):
        cfg = Config.from_dict({**base, "retention": {"keep_pfs": 7, "keep_pfs_every": "2h"}})
    assert cfg.retention.keep_warm == 7 and cfg.retention.keep_warm_every == 7200.0
    assert cfg.retention.keep_pfs == 7  # the Python attribute's old name too
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        new = Config.from_dict({**base, "retention": {"keep_warm": 7, "keep_warm_every": "2h"}})
    assert new == cfg
    with pytest.raises(CkptError, match=r"retention\.keep_pfs is the old name of keep_warm"):
        Config.from_dict({**base, "retention": {"keep_pfs": 1, "keep_warm": 2}})
