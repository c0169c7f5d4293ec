"""Ranged DCP loads (``dcp_reader(ranged=True)``), for real: gloo ranks as separate
processes, a tmpfs local tier, an ext4 loop-mounted PFS, and SeaweedFS as the object store.

A 2-rank save (row shards of four 4 MiB tensors and a value, 64 KiB hash chunks) is loaded
at 4 ranks from an empty local tier (another node), so every byte comes from the PFS or
the object store and each rank needs half of one part. What must hold:

* each rank reads at most 1.2x the bytes its plan needs (counted by the ChunkReader as
  they come from storage), and the load equals DCP's own ``FileSystemReader`` load of the
  same state bitwise;
* a byte flipped inside a range some rank needs fails the load with one line naming the
  part, the file and the range and saying to load again without ``ranged=True``;
* a byte flipped where no rank's plan reaches is never read: the load succeeds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest
from conftest import Mounts, need_root
from dcp_ranged_worker import full_tensor
from test_torch_distributed import free_port

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "dcp_ranged_worker.py"
TIMEOUT_S = 240
KEY = "rg"
USER = "root"
CHUNK = 64 * 2**10


def config(path: Path, local: Path, tiers: Dict[str, Any], ledger: Path) -> Path:
    """A config file: ``local`` (made here) and ``tiers``, with 64 KiB hash chunks."""
    local.mkdir(parents=True, exist_ok=True)
    shared: Dict[str, Any] = {}
    for name, t in tiers.items():
        if "root" in t:
            Path(t["root"]).mkdir(parents=True, exist_ok=True)
        shared[name] = {**t, "kind": "s3"} if "endpoint" in t else t
    if "object" in shared:
        shared["shared"] = list(tiers)
    cfg = {
        "tiers": {"local": {"root": str(local), "require_mount": False, "min_free": 0}, **shared},
        "ledger": {"dir": str(ledger)},
        "copy": {"chunk_size": "64KiB"},
    }
    path.write_text(json.dumps(cfg))
    return path


def launch(world: int, cfg: Path, fsdir: Path, *args: str) -> List[str]:
    """``world`` ranks of the worker, run to the end; the stdout of each."""
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(
            os.environ,
            RANK=str(r),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(r),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            GLOO_SOCKET_IFNAME="lo",
            PYTHONPATH=str(REPO),
        )
        cmd = [sys.executable, "-W", "ignore", str(WORKER), *args]
        cmd += ["--config", str(cfg), "--fsdir", str(fsdir), "--key", KEY]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    try:
        return [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def loaded(outs: List[str], tier: str) -> List[Tuple[int, int]]:
    """Every rank's (needed, read), after checking it loaded bitwise equal from ``tier``."""
    got = []
    for out in outs:
        m = re.search(r"^LOADED equal=(\d) needed=(\d+) read=(\d+) tiers=(\S+)$", out, re.M)
        assert m, out
        assert m.group(1) == "1", out
        assert {t.split(":")[1] for t in m.group(4).split(",")} == {tier}, out
        got.append((int(m.group(2)), int(m.group(3))))
    return got


def refused(outs: List[str], part: int) -> str:
    for out in outs:
        assert "LOADED" not in out, out
    lines = [ln for o in outs for ln in o.splitlines() if ln.startswith("LOADFAIL")]
    assert len(lines) == len(outs), "\n=====\n".join(outs)
    pat = (
        rf"dcp step 1: part {part}: .*rank-{part:05d}/dcp\.bin: content hash mismatch "
        r"\(bytes \d+-\d+\); a ranged load cannot fall back: load again without ranged=True"
    )
    hit = [ln for ln in lines if re.search(pat, ln)]
    assert hit, lines
    return hit[0]


def shard_at(data: bytes, name: str, part: int) -> int:
    """Where part ``part`` (of 2) holds its row shard of tensor ``name``."""
    rows = full_tensor(name).shape[0] // 2
    shard = full_tensor(name)[part * rows : (part + 1) * rows].contiguous()
    at = data.find(shard.numpy().tobytes()[:4096])
    assert at >= 0
    return at


def flip(path: Path, at: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0x01]))


def data_of(root: Path, part: int) -> Path:
    return (
        root
        / USER
        / f"{KEY}.dcp.rank{part:05d}"
        / "step-0000000001"
        / f"rank-{part:05d}"
        / "dcp.bin"
    )


def check_ratio(got: List[Tuple[int, int]]) -> None:
    print(f"ranged (needed, read) per rank: {got}")
    for needed, read in got:
        assert needed >= 4 * 2**20  # a quarter of each of the four 4 MiB tensors
        assert read <= 1.2 * needed, got
    # ranged for real: together the ranks read about the checkpoint once, not twice
    assert sum(r for _, r in got) <= 1.2 * sum(n for n, _ in got)


class Saved:
    def __init__(self, base: Path, mounts: Mounts) -> None:
        self.base, self.mounts = base, mounts
        self.local = mounts.tmpfs("256m", "local")
        self.fsdir = base / "fs-reference"


@pytest.fixture(scope="module")
def pfs_saved() -> Iterator[Tuple[Saved, Path]]:
    need_root()
    base = Path(tempfile.mkdtemp(prefix="dcp-ranged-", dir="/var/tmp"))
    m = Mounts(base)
    try:
        s = Saved(base, m)
        pfs = m.loopfs(256, "ext4", "pfs")
        cfg = config(
            base / "save.json",
            s.local / "save",
            {"pfs": {"kind": "posix", "root": str(pfs / "main")}},
            base / "l1",
        )
        for out in launch(2, cfg, s.fsdir, "save"):
            assert "SAVED" in out, out
        yield s, pfs
    finally:
        m.close()
        shutil.rmtree(base, ignore_errors=True)


def _load_pfs(s: Saved, pfs_root: Path, name: str, *args: str) -> List[str]:
    """A 4-rank ranged load on another node (an empty local tier) from ``pfs_root``."""
    cfg = config(
        s.base / f"{name}.json",
        s.local / name,
        {"pfs": {"kind": "posix", "root": str(pfs_root)}},
        s.base / f"ledger-{name}",
    )
    return launch(4, cfg, s.fsdir, "load", *args)


def _copy(pfs: Path, name: str) -> Path:
    dst = pfs / name
    shutil.copytree(pfs / "main", dst, symlinks=True)
    return dst


def test_ranged_load_from_pfs_reads_what_the_plan_needs(pfs_saved: Tuple[Saved, Path]) -> None:
    s, pfs = pfs_saved
    check_ratio(loaded(_load_pfs(s, pfs / "main", "plain"), "pfs"))


def test_ranged_flip_inside_a_needed_range_fails_with_one_line(
    pfs_saved: Tuple[Saved, Path],
) -> None:
    s, pfs = pfs_saved
    root = _copy(pfs, "inside")
    path = data_of(root, 1)
    at = shard_at(path.read_bytes(), "w1", 1) + 512 * 2**10  # needed by load rank 2
    flip(path, at)
    line = refused(_load_pfs(s, root, "inside"), 1)
    lo, hi = map(int, re.search(r"\(bytes (\d+)-(\d+)\)", line).groups())
    assert lo <= at < hi and hi - lo <= CHUNK
    # the default load (whole parts, verified before the ranks agree) finds the damage
    # on every tier and falls back: no older step here, so nothing loads, never bad bytes
    outs = _load_pfs(s, root, "inside-whole", "--whole")
    assert not any("LOADED equal=1" in o for o in outs), outs


def test_ranged_flip_outside_every_needed_range_is_never_read(
    pfs_saved: Tuple[Saved, Path],
) -> None:
    s, pfs = pfs_saved
    root = _copy(pfs, "outside")
    path = data_of(root, 1)
    flip(path, shard_at(path.read_bytes(), "w3", 1) + 2**20)  # w3: not in this load's state
    got = loaded(_load_pfs(s, root, "outside", "--only", "w0,w1,w2"), "pfs")
    for needed, read in got:
        assert read <= 1.2 * needed, got


def test_ranged_load_from_object_store(s3_server: Any, tmp_path: Path, mounts: Mounts) -> None:
    need_root()
    local = mounts.tmpfs("256m", "local")
    obj = s3_server.object_config(
        s3_server.bucket("ranged"), s3_server.fresh_prefix(), part_size="5MiB", concurrency=4
    )
    fsdir = tmp_path / "fs-reference"
    save = config(tmp_path / "save.json", local / "save", {"object": obj}, tmp_path / "l1")
    for out in launch(2, save, fsdir, "save"):
        assert "SAVED" in out, out
    load = config(tmp_path / "load.json", local / "load", {"object": obj}, tmp_path / "l2")
    check_ratio(loaded(launch(4, load, fsdir, "load"), "object"))

    from slurm_ckpt.core.config import Config
    from slurm_ckpt.tiers.registry import tiers_from_config

    tier = tiers_from_config(Config.from_dict(json.loads(load.read_text())))["object"]
    data = data_of(local / "save", 1).read_bytes()
    at = shard_at(data, "w1", 1) + 512 * 2**10
    tier.corrupt_for_tests(USER, f"{KEY}.dcp.rank00001", 1, "rank-00001/dcp.bin", at)
    line = refused(launch(4, load, fsdir, "load"), 1)
    lo, hi = map(int, re.search(r"\(bytes (\d+)-(\d+)\)", line).groups())
    assert lo <= at < hi
