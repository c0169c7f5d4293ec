"""The hot spare's rank-independent setup (slurm_ckpt.job.spare_prep, issue 30): built
while the spare waits, so that taking a rank only binds the identity.

Real things: a real site config and tiers in tmp_path, a real recovery directory, torch
imported as a training script does.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List

import pytest
import torch  # noqa: F401 - a training script has torch: Prebuilt then warms its first use

from slurm_ckpt.core.membership import Coordinator, Member, RecoveryDir
from slurm_ckpt.errors import CkptError
from slurm_ckpt.job.recovery import Recovery
from slurm_ckpt.job.spare_prep import TORCH_IMPORTS, Prebuilt


def site(tmp_path: Path) -> Path:
    for d in ("local", "pfs"):
        (tmp_path / d).mkdir()
    cfg = tmp_path / "config.toml"
    cfg.write_text(
        f'[tiers]\nshared = ["pfs"]\n[tiers.local]\nroot = "{tmp_path / "local"}"\n'
        f'[tiers.pfs]\nkind = "posix"\nroot = "{tmp_path / "pfs"}"\n'
    )
    return cfg


def test_a_misspelt_option_fails_when_the_spare_starts_not_at_the_recovery(
    tmp_path: Path,
) -> None:
    with pytest.raises(CkptError, match="unknown option 'partnr'.*did you mean 'partner'"):
        Prebuilt(config_path=site(tmp_path), partnr=True)


def test_taking_a_rank_binds_it_to_the_prebuilt_configuration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = site(tmp_path)
    pre = Prebuilt(config_path=cfg, keep_local=3)
    assert all(name in sys.modules for name in TORCH_IMPORTS)
    assert pre.seconds >= 0 and pre.config.retention is not None
    # what Recovery's join sets once the rank is known (a spare's SLURM_PROCID is not it)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("SLURM_CKPT_CONFIG", str(tmp_path / "elsewhere.toml"))  # not read
    ckpt = pre.checkpointer("run", install_signals=False, job="77")
    try:
        assert (ckpt.rank, ckpt.world_size) == (1, 3)
        assert ckpt.config.source == str(cfg) and ckpt.policy.keep_local == 3
        assert str(ckpt.local.root) == str(tmp_path / "local")
    finally:
        ckpt.close()


def test_a_hot_spare_prepares_while_it_waits_before_it_has_a_rank(tmp_path: Path) -> None:
    """The spare says it is ready, then runs prepare() (no rank known yet); here the
    job ends without needing it, so it exits 0 having prepared and taken no rank."""
    rd = RecoveryDir(str(tmp_path / "recovery"), create=True)
    co = Coordinator(rd)
    co.launch({0: Member("127.0.0.1", 0)})
    calls: List[int] = []
    rec = Recovery(
        rd.path,
        environ={"SLURM_CKPT_TASK": "5", "SLURM_CKPT_SPARE": "1", "SLURM_CKPT_HOST": "127.0.0.1"},
        prepare=lambda: calls.append(len(rd.spares())) or "built",
    )

    co.end()
    with pytest.raises(SystemExit) as ended:
        rec.join()
    assert ended.value.code == 0
    assert calls == [1]  # once, after its ready file was written
    assert rec.prepared == "built" and rec.prepare_s >= 0 and rec.rank == -1
    assert [s.task for s in rd.spares()] == [5] and os.getpid() == rd.spares()[0].pid
