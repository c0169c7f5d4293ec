"""``ckpt-slurm adopt DIR --key K``: a sealed directory becomes a step of a series, cloned
(reflink) where the filesystem can, then flushed, aged (gc) and restored like our own
checkpoints (issue 34, item 2). Real XFS (reflinks) on a loop device, stock DCP output,
the real ``flush``, ``gc`` and ``Checkpointer.restore_path``.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

from helpers.cli import ckpt_slurm
from test_seal import CHUNK, flip, one_error, worker

from slurm_ckpt import Checkpointer


def site(tmp_path: Path, local: Path) -> Path:
    (tmp_path / "pfs").mkdir()
    local.mkdir(exist_ok=True)
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[tiers.local]\nroot = "{local}"\nrequire_mount = false\nmin_free = 0\n'
        f'[tiers.pfs]\nkind = "posix"\nroot = "{tmp_path / "pfs"}"\n'
    )
    return cfg


def shared_extents_only(path: Path) -> bool:
    """Whether every extent of ``path`` is shared (a reflink clone, no bytes of its own),
    as the filesystem reports it (``filefrag -v``: FIEMAP's extent flags)."""
    out = subprocess.run(
        ["filefrag", "-v", str(path)], capture_output=True, text=True, check=True
    ).stdout
    extents = [ln for ln in out.splitlines() if re.match(r"\s*\d+:\s+\d+\.\.", ln)]
    return bool(extents) and all("shared" in ln.split()[-1] for ln in extents)


def test_sealed_dcp_is_cloned_into_a_series_flushed_and_restored(
    tmp_path: Path, mounts: Any
) -> None:
    mnt = mounts.loopfs(300, "xfs", "seal-xfs")
    src = mnt / "dcp" / "step-3"
    worker("dcp", str(src))
    assert ckpt_slurm("seal", str(src)).returncode == 0
    cfg = site(tmp_path, mnt / "local")
    names = sorted(p.name for p in src.iterdir() if p.name != "manifest.json")

    r = ckpt_slurm("adopt", str(src), "--key", "my-run", config=cfg)
    assert r.returncode == 0, r.stderr
    assert f"as root/my-run step 3 on local ({len(names)} files," in r.stdout, r.stdout
    assert f": {len(names)} cloned, 0 copied)" in r.stdout, r.stdout
    step_dir = mnt / "local" / "root" / "my-run" / "step-0000000003"
    for n in names:
        mine, theirs = (step_dir / "rank-00000" / n).stat(), (src / n).stat()
        assert mine.st_ino != theirs.st_ino and (mine.st_nlink, theirs.st_nlink) == (1, 1)
        # no data copied: the filesystem itself says every extent is shared with the source
        assert mine.st_size == 0 or shared_extents_only(step_dir / "rank-00000" / n), n
    assert ckpt_slurm("verify", str(src)).returncode == 0  # the sealed directory is intact
    assert ckpt_slurm("verify", "my-run", config=cfg).returncode == 0

    empty = tmp_path / "bin"
    empty.mkdir()
    fl = ckpt_slurm("flush", "--node", "n1", config=cfg, env={"PATH": str(empty)})
    assert fl.returncode == 0 and "flushed 1 checkpoint" in fl.stdout, fl.stdout + fl.stderr
    assert (tmp_path / "pfs" / "root" / "my-run" / "step-0000000003" / "manifest.json").is_file()

    # A new node: nothing local; restore_path fetches the step from the PFS (verified),
    # and DCP's own reader loads it from there.
    ckpt = Checkpointer(
        local=tmp_path / "node2", warm=tmp_path / "pfs", key="my-run", end_time_fn=None
    )
    try:
        got = ckpt.restore_path()
        assert got is not None and ckpt.restored is not None
        assert (ckpt.restored.step, ckpt.restored.tier) == (3, "pfs")
    finally:
        ckpt.close()
    assert sorted(os.listdir(got)) == names
    worker("dcp-load", str(got))


def test_adopt_reads_back_against_the_seal(tmp_path: Path) -> None:
    """A sealed directory damaged since its seal is not adopted (file and byte range
    named, nothing committed); without reflinks the files are copied; an unsealed
    directory and a step already taken are refused."""
    src = tmp_path / "checkpoint-9"
    src.mkdir()
    (src / "model.bin").write_bytes(os.urandom(3 * CHUNK))
    (src / "trainer_state.json").write_text("{}")
    local, warm = tmp_path / "local", tmp_path / "warm"
    local.mkdir()
    warm.mkdir()
    tiers = ["--local", str(local), "--warm", str(warm)]
    assert ckpt_slurm("seal", str(src), "--chunk-size", "64KiB").returncode == 0

    ok = ckpt_slurm("adopt", str(src), "-k", "run", "--step", "1", *tiers)
    assert ok.returncode == 0 and ": 0 cloned, 2 copied)" in ok.stdout, ok.stdout + ok.stderr
    one_error(
        ckpt_slurm("adopt", str(src), "-k", "run", "--step", "1", *tiers),
        "step 1 is already committed",
    )

    flip(src / "model.bin", CHUNK + 5)
    one_error(
        ckpt_slurm("adopt", str(src), "-k", "run", *tiers),
        f"{src}/model.bin: does not match its seal (bytes {CHUNK}-{2 * CHUNK}): nothing adopted",
    )
    assert not (local / "root" / "run" / "step-0000000009").exists()
    assert [p.name for p in (local / "root" / "run").iterdir()] == ["step-0000000001"]

    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "x.bin").write_bytes(b"x")
    one_error(ckpt_slurm("adopt", str(plain), "-k", "run", *tiers), "not sealed")


def test_adopted_steps_are_aged_by_gc_like_any_other(tmp_path: Path) -> None:
    """Three sealed HF checkpoints adopted on the warm tier; gc's retention (keep 2 there)
    removes the oldest and keeps the two newest, which still verify."""
    from slurm_ckpt.core.config import Config
    from slurm_ckpt.ops.gc import run_gc

    local, warm = tmp_path / "local", tmp_path / "warm"
    local.mkdir()
    warm.mkdir()
    tiers = ["--local", str(local), "--warm", str(warm)]
    for n in (1, 2, 3):
        src = tmp_path / "out" / f"checkpoint-{n}"
        src.mkdir(parents=True)
        (src / "model.bin").write_bytes(os.urandom(CHUNK + n))
        (src / "trainer_state.json").write_text("{}")
        assert ckpt_slurm("seal", str(src)).returncode == 0
        r = ckpt_slurm("adopt", str(src), "-k", "aged", "--tier", "warm", *tiers)
        assert r.returncode == 0, r.stdout + r.stderr
    cfg = Config.standalone(local, warm, retention={"keep_warm": 2, "keep_warm_every": "0"})
    series = warm / "root" / "aged"
    assert sorted(p.name for p in series.glob("step-*")) == [f"step-{n:010d}" for n in (1, 2, 3)]
    run_gc(cfg)
    assert sorted(p.name for p in series.glob("step-*")) == [f"step-{n:010d}" for n in (2, 3)]
    assert ckpt_slurm("verify", "aged", *tiers).returncode == 0
