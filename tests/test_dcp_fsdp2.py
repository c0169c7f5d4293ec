"""FSDP2 (CPU, gloo) through torch.distributed.checkpoint and our DCP backend, for real.

Several ranks on this machine (started as torchrun would: RANK, WORLD_SIZE, MASTER_*),
each running tests/dcp_worker.py, on a tmpfs local tier and a loop-mounted ext4 "PFS".
What must hold:

* a 2-rank save (``dcp.async_save``, process mode, DCP's own stager) and a 4-rank save
  (thread mode) load at 1, 3 and 2 ranks with every parameter, optimizer state, scheduler
  value and RNG tensor ``torch.equal`` to what was saved (DCP's planner reshards; at
  another node - an empty local tier - every part comes from the PFS);
* a run stopped by SIGTERM (preemption save) or killed by SIGKILL mid-save resumes at
  the same world size and ends bitwise equal to an uninterrupted run;
* a flipped byte or a truncated part on one rank's local copy is caught and that part
  is read from the PFS; a part damaged on every tier makes all ranks fall back one step;
* a SIGTERM that kills DCP's process-mode children leaves nothing committed.

Launches are shared where possible (each costs seconds of imports and gloo setup on this
machine): one module-level pair of training runs (keys ``two`` and ``four``) feeds every
load check, one load launch checks several keys, and independent runs go concurrently.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest
import torch
from conftest import Mounts, need_root
from test_torch_distributed import free_port

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "dcp_worker.py"
#: No launch may outlive this (a hang is a failure, never a stuck suite).
TIMEOUT_S = 240


class Site:
    """A local tier (tmpfs) and a PFS (ext4 on a loop device), plus a dump directory."""

    def __init__(self, local: Path, pfs: Path, dump: Path) -> None:
        self.local, self.pfs, self.dump = local, pfs, dump
        for d in (local, pfs, dump):
            d.mkdir(parents=True, exist_ok=True)

    def copy(self, name: str) -> Site:
        """The same checkpoints in fresh directories on the same filesystems."""
        site = Site(
            self.local.parent / f"{self.local.name}-{name}",
            self.pfs.parent / f"{self.pfs.name}-{name}",
            self.dump,
        )
        for src, dst in ((self.local, site.local), (self.pfs, site.pfs)):
            shutil.rmtree(dst)
            shutil.copytree(src, dst, symlinks=True)
        return site

    def part(self, tier: str, key: str, rank: int, step: int) -> Path:
        root = self.local if tier == "local" else self.pfs
        return root / "root" / f"{key}.dcp.rank{rank:05d}" / f"step-{step:010d}"

    def data(self, tier: str, key: str, rank: int, step: int) -> Path:
        return self.part(tier, key, rank, step) / f"rank-{rank:05d}" / "dcp.bin"


Job = Tuple[int, Site, Tuple[str, ...], Path | None]


def launch_many(*jobs: Job) -> List[List[str]]:
    """Start every job (``world`` ranks each) at once and run them all to the end; per
    job, the stdout of each rank."""
    started = []
    for world, site, args, local in jobs:
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
            cmd += ["--local", str(local or site.local), "--pfs", str(site.pfs)]
            cmd += ["--dump", str(site.dump)]
            procs.append(
                subprocess.Popen(
                    cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
                )
            )
        started.append(procs)
    outs: List[List[str]] = []
    try:
        for procs in started:
            outs.append([p.communicate(timeout=TIMEOUT_S)[0] for p in procs])
    finally:
        for procs in started:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    return outs


def launch(world: int, site: Site, *args: str, local: Path | None = None) -> List[str]:
    return launch_many((world, site, args, local))[0]


def line(out: str, pattern: str) -> re.Match:
    m = re.search(pattern, out, re.M)
    assert m is not None, f"no line {pattern!r} in:\n{out[-3000:]}"
    return m


def equal(a: Any, b: Any, path: str = "") -> int:
    """``a`` and ``b`` alike down to every tensor (``torch.equal``, same dtype); the
    number of leaves compared."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, path
        assert torch.equal(a, b), f"{path} differs"
        return 1
    if isinstance(a, dict):
        assert set(a) == set(b), f"{path}: keys {set(a) ^ set(b)}"
        return sum(equal(a[k], b[k], f"{path}.{k}") for k in a)
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        return sum(equal(x, y, f"{path}[{i}]") for i, (x, y) in enumerate(zip(a, b)))
    assert a == b, f"{path}: {a!r} != {b!r}"
    return 1


def resumed(out: str, key: str) -> Tuple[int, Dict[int, str]]:
    """The step a rank loaded for ``key`` and the tier of each part it read."""
    m = line(out, rf"^RESUMED key={key} step=(\d+) tiers=(\S*)$")
    return int(m.group(1)), {int(r): t for r, t in (p.split(":") for p in m.group(2).split(","))}


def check_load(site: Site, outs: List[str], key: str, step: int) -> List[Dict[int, str]]:
    """Every rank loaded ``step`` of ``key``, and what it loaded equals what was saved,
    tensor for tensor; the tiers each rank read from."""
    got = [resumed(o, key) for o in outs]
    assert {s for s, _ in got} == {step}
    saved = torch.load(site.dump / f"saved-{key}-{step}.pt", weights_only=True)
    loaded = torch.load(site.dump / f"loaded-{key}-{len(outs)}.pt", weights_only=True)
    assert {"model", "optim", "sched", "rng"} <= set(saved)
    assert saved["optim"]["state"], "the optimizer state was saved (Adam moments)"
    assert equal(saved, loaded) > 30
    return [t for _, t in got]


@pytest.fixture(scope="module")
def fs() -> Iterator[Tuple[Path, Path]]:
    """One tmpfs (local tier) and one ext4 loop mount (PFS) for the module."""
    need_root()
    base = Path(tempfile.mkdtemp(prefix="dcp-", dir="/var/tmp"))
    m = Mounts(base)
    try:
        yield m.tmpfs("512m", "local"), m.loopfs(256, "ext4", "pfs")
    finally:
        m.close()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def saved(fs: Tuple[Path, Path]) -> Tuple[Site, str]:
    """Key ``two``: 2 ranks, async_save in process mode (DCP's DefaultStager, shared
    memory) at steps 2, 4, 6; key ``four``: 4 ranks, async_save in thread mode at step 2.
    The site, and the final digest of the uninterrupted 2-rank run."""
    local, pfs = fs
    site = Site(local / "main", pfs / "main", pfs.parent / "dump")
    two, four = launch_many(
        (2, site, ("train", "--key", "two", "--steps", "6", "--mode", "process"), None),
        (4, site, ("train", "--key", "four", "--steps", "2", "--mode", "thread"), None),
    )
    digests = {line(o, r"^DONE digest=(\w+)$").group(1) for o in two}
    assert len(digests) == 1
    for o in four:
        line(o, r"^DONE digest=")
    return site, digests.pop()


def test_async_saves_load_at_1_3_2_ranks_bit_exact(saved: Tuple[Site, str]) -> None:
    site, _ = saved
    for key, world, steps in (("two", 2, (2, 4, 6)), ("four", 4, (2,))):
        for r in range(world):  # every part on both tiers: the one flush engine took them
            for step in steps:
                assert (site.part("pfs", key, r, step) / "manifest.json").is_file()
    # 3 ranks "on other nodes" (an empty local tier): every part comes from the PFS
    elsewhere = site.local.parent / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    args = ("load", "--key", "two,four")
    one, three = launch_many((1, site, args, None), (3, site, args, elsewhere))
    assert check_load(site, one, "two", 6) == [{0: "local", 1: "local"}]
    check_load(site, one, "four", 2)
    for key, step in (("two", 6), ("four", 2)):
        tiers = check_load(site, three, key, step)
        assert set().union(*(t.values() for t in tiers)) == {"pfs"}
    outs = launch(2, site, *args)
    tiers = check_load(site, outs, "two", 6)
    assert [t[r] for r, t in enumerate(tiers)] == ["local", "local"]  # its own part, locally
    check_load(site, outs, "four", 2)


def test_load_alone_no_dist_and_in_a_subgroup(saved: Tuple[Site, str]) -> None:
    """DCP's own ways to load besides the whole group: rank 0 alone with ``no_dist=True``
    (it returns with no collective while the other ranks wait elsewhere - before, the
    reader's agreement waited for every rank until the group timed out) and ranks 0, 1
    as a subgroup with ``process_group=`` while rank 2 takes no part. Both get the
    weights of the newest step, whole, equal to what was saved."""
    site, _ = saved
    outs = launch(3, site, "alone", "--key", "two")
    m = line(outs[0], r"^ALONE step=(\d+) parts=\[(.*)\]$")
    assert m.group(1) == "6" and m.group(2) == "0, 1"  # one process read both parts
    for o in outs[:2]:
        line(o, r"^SUBGROUP step=6$")
    assert "SUBGROUP" not in outs[2] and "ALONE" not in outs[1] + outs[2]
    want = torch.load(site.dump / "saved-two-6.pt", weights_only=True)["model"]
    for name in ("alone-two.pt", "sub-two-0.pt", "sub-two-1.pt"):
        got = torch.load(site.dump / name, weights_only=True)
        assert equal(want, got) == 4, name


def _flip(path: Path, at: int = 100) -> None:
    with open(path, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0x01]))


def test_damage_caught_read_from_pfs_or_all_fall_back(saved: Tuple[Site, str]) -> None:
    site = saved[0].copy("damage")
    # four: one flipped byte in part 1, part 0 truncated, on the local tier only
    _flip(site.data("local", "four", 1, 2))
    data0 = site.data("local", "four", 0, 2)
    os.truncate(data0, data0.stat().st_size // 2)
    # two: step 6's part 1 rotten on every tier (and its metadata only on the local tier)
    for tier in ("local", "pfs"):
        _flip(site.data(tier, "two", 1, 6), 50)
    shutil.rmtree(site.part("pfs", "two", 0, 6))
    outs = launch(2, site, "load", "--key", "four,two")
    read = check_load(site, outs, "four", 2)
    assert {0, 1} <= set().union(*read)  # the damaged parts were read by someone ...
    for tiers in read:  # ... and from the PFS by whoever read them (parts 2, 3: local)
        assert tiers.get(0, "pfs") == tiers.get(1, "pfs") == "pfs"
        assert tiers.get(2, "local") == tiers.get(3, "local") == "local"
    check_load(site, outs, "two", 4)  # every rank fell back one step
    # a part missing on every tier makes the step just as incomplete: 4 -> 2
    for tier in ("local", "pfs"):
        shutil.rmtree(site.part(tier, "two", 1, 4))
    check_load(site, launch(2, site, "load", "--key", "two"), "two", 2)


def test_sigterm_and_sigkill_resume_bitwise_equal(saved: Tuple[Site, str]) -> None:
    site, reference = saved
    six = ("--steps", "6", "--mode", "thread")
    # SIGTERM at step 3 (every rank, as SLURM sends it) -> the preemption save; SIGKILL
    # of every rank right after async_save(step 4) returned, the save still in flight
    term, kill = launch_many(
        (2, site, ("train", "--key", "term", *six, "--term-at", "3"), None),
        (2, site, ("train", "--key", "kill", *six, "--kill-at", "4"), None),
    )
    for o in term:
        line(o, r"^PREEMPTED step=3$")
    assert all("DONE" not in o for o in kill)
    term, kill = launch_many(
        (2, site, ("train", "--key", "term", *six), None),
        (2, site, ("train", "--key", "kill", *six), None),
    )
    assert {resumed(o, "term")[0] for o in term} == {3}
    # step 4 only if its save finished before the kill, else step 2: the same on all ranks
    steps = {resumed(o, "kill")[0] for o in kill}
    assert len(steps) == 1 and steps <= {2, 4}
    for o in term + kill:
        assert line(o, r"^DONE digest=(\w+)$").group(1) == reference


def test_sigterm_killing_process_mode_children_commits_nothing(saved: Tuple[Site, str]) -> None:
    site = saved[0]
    args = ("train", "--key", "child", "--steps", "1", "--every", "1", "--mode", "process")
    for o in launch(2, site, *args, "--child-term-at", "1"):
        line(o, r"^CHILD_DIED .*dead")
        line(o, r"^NOTHING key=child$")
    for root in (site.local, site.pfs):
        for r in (0, 1):
            series = root / "root" / f"child.dcp.rank{r:05d}"
            assert not list(series.glob("step-*/manifest.json"))
