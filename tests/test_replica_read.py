"""A restore read once per replica group (slurm_ckpt.job.replica_read): real processes,
real gloo over 127.0.0.1, real files (tests/replica_read_worker.py is one rank).

Data-parallel ranks each saved the very same state in their own series on the PFS. With
``replicas=`` each chunk is read by one rank and broadcast; the receivers verify it
against their own manifest. What must hold: the state is bitwise what was saved, the
group reads about one copy, and a sender that dies or lies mid-restore costs only time
(the chunks it owed are read by each rank from its own copy).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import numpy as np
import pytest

from slurm_ckpt.core.names import current_user
from slurm_ckpt.job.staging import write_direct
from slurm_ckpt.job.state import STATE_FORMAT, flatten, layout
from slurm_ckpt.tiers.posix import PosixTier

WORKER = str(Path(__file__).with_name("replica_read_worker.py"))
sys.path.insert(0, str(Path(__file__).parent))
from replica_read_worker import CHUNK, KEY, leaves  # noqa: E402

WORLD = 4
STEP = 7


def state() -> Dict[str, Any]:
    """The one state every data-parallel rank holds: ~5 MiB, about 20 hash chunks."""
    rng = np.random.default_rng(1234)
    return {
        "model": {"w": rng.standard_normal(2**19, dtype=np.float32), "b": np.arange(77.0)},
        "optimizer": {"m": rng.standard_normal(3 * 2**17), "v": rng.integers(0, 9, 1000)},
    }


def save_all(work: Path, world: int = WORLD) -> int:
    """Every rank's series on the PFS, the same bytes in each; returns the payload bytes
    of one copy (blobs and index)."""
    (work / "pfs").mkdir(exist_ok=True)
    tier = PosixTier("pfs", str(work / "pfs"), chunk_size=CHUNK, streams=2)
    total = 0
    for r in range(world):
        index, tensors = flatten(state())
        layout(index)
        meta = {"rank": r, "world_size": world, "state_format": STATE_FORMAT, "base_key": KEY}
        with tier.writer(current_user(), f"{KEY}.rank{r:05d}", STEP, tokens=1, meta=meta) as w:
            total = write_direct(w, f"rank-{r:05d}", index, tensors)
    return total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_group(work: Path, mode: str, world: int = WORLD) -> Dict[int, Dict[str, Any]]:
    """Start every rank, wait for all; the replies of those that lived, by rank."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    procs = []
    for r in range(world):
        err = (work / f"rank{r}.log").open("w")
        procs.append(
            subprocess.Popen(
                [sys.executable, WORKER, str(work), str(r), str(world), str(port), mode],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env,
            )
        )
    out: Dict[int, Dict[str, Any]] = {}
    for r, p in enumerate(procs):
        stdout, _ = p.communicate(timeout=240)
        for line in stdout.splitlines():
            if line.startswith("REPLY "):
                out[r] = json.loads(line[6:])
    return out


def expect_exact(doc: Dict[str, Any], want: Dict[str, str]) -> None:
    assert doc["step"] == STEP and doc["tier"] == "pfs"
    assert doc["leaves"] == want, "restored state differs from the saved one"


def log_of(work: Path, rank: int) -> str:
    return (work / f"rank{rank}.log").read_text()


@pytest.fixture
def saved(tmp_path: Path) -> tuple:
    total = save_all(tmp_path)
    want = leaves(state())
    assert len(set(want.values())) == len(want)  # the check can tell leaves apart
    return tmp_path, total, want


def test_group_reads_one_copy_and_every_rank_is_bitwise_exact(saved: tuple) -> None:
    work, total, want = saved
    got = run_group(work, "ok")
    assert sorted(got) == list(range(WORLD)), [log_of(work, r)[-2000:] for r in range(WORLD)]
    for r in range(WORLD):
        expect_exact(got[r], want)
        # each rank received the others' stripes, verified: it read about a quarter
        assert got[r]["peer_bytes"] > 0
        assert got[r]["read_bytes"] + got[r]["peer_bytes"] >= total - 4096
    read = sum(got[r]["read_bytes"] for r in range(WORLD))
    assert read <= 1.05 * total, f"the group read {read} bytes of a {total}-byte checkpoint"


def test_checkpointer_restore_with_replicas_shares_the_read(saved: tuple) -> None:
    work, total, want = saved
    got = run_group(work, "ckpt")  # agreement over the process group, then the shared read
    assert sorted(got) == list(range(WORLD)), [log_of(work, r)[-2000:] for r in range(WORLD)]
    for r in range(WORLD):
        expect_exact(got[r], want)
        assert got[r]["peer_bytes"] > 0
    assert sum(got[r]["read_bytes"] for r in range(WORLD)) <= 1.05 * total


def test_a_step_on_each_rank_s_own_node_is_read_there_not_shared(saved: tuple) -> None:
    work, _total, want = saved
    user = current_user()
    for r in range(WORLD):  # every rank's node holds its copy on the local tier too
        key = f"{KEY}.rank{r:05d}"
        shutil.copytree(work / "pfs" / user / key, work / f"node{r}" / user / key)
    got = run_group(work, "ckpt-all")
    assert sorted(got) == list(range(WORLD)), [log_of(work, r)[-2000:] for r in range(WORLD)]
    for r in range(WORLD):
        assert got[r]["tier"] == "local" and got[r]["peer_bytes"] == 0
        assert got[r]["leaves"] == want


def test_a_sender_killed_mid_restore_leaves_the_others_bitwise_exact(saved: tuple) -> None:
    work, _total, want = saved
    got = run_group(work, "kill:1:2")  # rank 1 dies before sending its 2nd chunk
    assert 1 not in got  # it really died mid-restore
    assert sorted(got) == [0, 2, 3], [log_of(work, r)[-2000:] for r in range(WORLD)]
    for r in (0, 2, 3):
        expect_exact(got[r], want)
        assert "shared read stopped" in log_of(work, r)  # the fallback did the rest
        assert got[r]["peer_bytes"] > 0  # and the chunks before the death were shared


def test_a_corrupt_chunk_from_a_peer_is_refused_and_read_from_the_own_copy(
    saved: tuple,
) -> None:
    work, total, want = saved
    got = run_group(work, "corrupt:2")
    assert sorted(got) == list(range(WORLD)), [log_of(work, r)[-2000:] for r in range(WORLD)]
    for r in range(WORLD):
        expect_exact(got[r], want)
    for r in (0, 1, 3):
        refusals = log_of(work, r).count("from rank 2 fails verification: refused")
        assert refusals >= 4, log_of(work, r)[-2000:]
        # what rank 2 owed was read here: more than its own stripe
        assert got[r]["read_bytes"] > 1.2 * total / WORLD
    assert "refused" not in log_of(work, 2)


def test_ranks_holding_different_bytes_each_read_their_own(tmp_path: Path) -> None:
    save_all(tmp_path)
    # rank 3's copy differs (another state saved under the same step): no sharing
    tier = PosixTier("pfs", str(tmp_path / "pfs"), chunk_size=CHUNK, streams=2)
    tier.delete(current_user(), f"{KEY}.rank00003", STEP)
    other = state()
    other["model"]["w"] = other["model"]["w"] + 1
    index, tensors = flatten(other)
    layout(index)
    meta = {"rank": 3, "world_size": WORLD, "state_format": STATE_FORMAT, "base_key": KEY}
    with tier.writer(current_user(), f"{KEY}.rank00003", STEP, tokens=1, meta=meta) as w:
        write_direct(w, "rank-00003", index, tensors)
    got = run_group(tmp_path, "ok")
    assert sorted(got) == list(range(WORLD))
    for r in range(3):
        expect_exact(got[r], leaves(state()))
    assert got[3]["leaves"] == leaves(other)
    assert all(got[r]["peer_bytes"] == 0 for r in range(WORLD))
