"""``ckpt-srun``'s flush after the step (:func:`slurm_ckpt.ops.flush_cmd.flush_series`) covers
the per-rank series of a multi-rank job (``<key>.rankNNNNN``), not just ``<key>``: before,
a data-parallel job's shards were left to the epilog alone."""

from __future__ import annotations

import getpass
from pathlib import Path

from slurm_ckpt.core.config import Config
from slurm_ckpt.ops.flush_cmd import flush_series
from slurm_ckpt.tiers.posix import PosixTier


def test_flush_series_flushes_the_key_and_its_rank_series_only(tmp_path: Path) -> None:
    local, pfs = tmp_path / "local", tmp_path / "pfs"
    local.mkdir()
    pfs.mkdir()
    user = getpass.getuser()
    lt = PosixTier("local", str(local))
    for key, step in [("run", 1), ("run.rank00000", 2), ("run.rank00001", 2), ("other", 3)]:
        w = lt.writer(user, key, step)
        w.write_buffers({"a.bin": key.encode() * 100})
        w.commit()
    lines = flush_series(Config.standalone(local, pfs), user, "run")
    pt = PosixTier("pfs", str(pfs))
    assert [s.step for s in pt.steps(user, "run")] == [1], lines
    for rank in ("run.rank00000", "run.rank00001"):
        assert [s.step for s in pt.steps(user, rank)] == [2], lines
        assert pt.verify(user, rank, 2).ok
    assert pt.steps(user, "other") == [], lines  # another series is not this job's
    assert len(lines) == 3 and any(ln.startswith("rank00001 step 2: flushed") for ln in lines)
