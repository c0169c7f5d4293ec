"""Restore: newest verified checkpoint on any tier, fallbacks, weights first, multi-rank."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import pytest

from slurm_ckpt.errors import VerifyError
from slurm_ckpt.job import Checkpointer
from slurm_ckpt.ledger import State
from slurm_ckpt.tiers.copy import copy_checkpoint

STEP_DIR = "step-{:010d}"


def state_for(step: int, rank: int = 0) -> Dict[str, Any]:
    return {
        "model": {"w": np.full(4096, rank * 1000 + step, dtype=np.float32)},
        "optimizer": {"m": np.arange(8192, dtype=np.float64) * step, "rank": rank, "step": step},
        "rng": bytes([step % 256]) * 7,
    }


def make(root: Path, local: Optional[Path] = None, **kw: Any) -> Checkpointer:
    local = local or root / "local"
    local.mkdir(parents=True, exist_ok=True)
    (root / "pfs").mkdir(parents=True, exist_ok=True)
    kw.setdefault("install_signals", False)
    kw.setdefault("end_time_fn", None)
    return Checkpointer(local=local, warm=root / "pfs", key=kw.pop("key", "run"), **kw)


def save_steps(root: Path, steps: List[int], **kw: Any) -> Checkpointer:
    ckpt = make(root, **kw)
    for s in steps:
        ckpt.save(state_for(s, ckpt.rank), step=s, tokens=100 * s)
        assert ckpt.wait()
    ckpt.close()
    return ckpt


def payload(root: Path, tier: str, step: int, key: str = "run", rank: int = 0) -> Path:
    user = os.listdir(root / tier)
    user = [u for u in user if not u.startswith(".")][0]
    return root / tier / user / key / STEP_DIR.format(step) / f"rank-{rank:05d}"


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x01
    path.write_bytes(bytes(data))


def assert_bad(ckpt: Checkpointer, step: int, *tiers: str) -> None:
    """The ledger marks the copies of ``step`` on ``tiers`` bad."""
    for tier in tiers:
        assert ckpt.ledger.get(ckpt.user, "run", step).state(tier) is State.BAD


def check(got: Any, step: int, tier: str, rank: int = 0) -> None:
    assert got is not None and (got.step, got.tier) == (step, tier)
    want = state_for(step, rank)
    assert np.array_equal(got.state["model"]["w"], want["model"]["w"])
    assert np.array_equal(got.state["optimizer"]["m"], want["optimizer"]["m"])
    assert got.state["rng"] == want["rng"] and got.tokens == 100 * step


def test_nothing_to_restore(tmp_path: Path) -> None:
    ckpt = make(tmp_path)
    assert ckpt.restore() is None
    ckpt.close()


def test_newest_from_local_first_then_pfs(tmp_path: Path) -> None:
    save_steps(tmp_path, [1, 2, 3])
    ckpt = make(tmp_path)
    check(ckpt.restore(), 3, "local")
    ckpt.close()
    ckpt.local.delete(ckpt.user, "run", 3)
    again = make(tmp_path)
    check(again.restore(), 3, "pfs")
    again.close()


def test_flipped_byte_on_local_restores_same_step_from_pfs(tmp_path: Path) -> None:
    save_steps(tmp_path, [1, 2, 3])
    flip(payload(tmp_path, "local", 3) / "data-0001.bin")
    ckpt = make(tmp_path)
    check(ckpt.restore(), 3, "pfs")
    rec = ckpt.ledger.get(ckpt.user, "run", 3)
    assert rec.state("local") is State.BAD and "hash mismatch" in rec.error
    assert rec.state("pfs") is State.VERIFIED
    assert ckpt.ledger.failures().get("verify_failed") == 1
    ckpt.close()


def test_both_copies_truncated_falls_back_to_previous_step(tmp_path: Path) -> None:
    save_steps(tmp_path, [1, 2, 3])
    for tier in ("local", "pfs"):
        blob = payload(tmp_path, tier, 3) / "data-0000.bin"
        os.truncate(blob, blob.stat().st_size // 2)
    ckpt = make(tmp_path)
    check(ckpt.restore(), 2, "local")  # keep_local=2: step 2 is still local
    assert_bad(ckpt, 3, "local", "pfs")
    ckpt.close()


def test_corrupt_index_or_manifest_is_skipped(tmp_path: Path) -> None:
    save_steps(tmp_path, [1, 2])
    flip(payload(tmp_path, "local", 2) / "index.json")
    man = payload(tmp_path, "pfs", 2).parent / "manifest.json"
    man.write_text(man.read_text().replace('"step": 2', '"step": 3'))
    ckpt = make(tmp_path)
    check(ckpt.restore(), 1, "local")
    ckpt.close()


def test_weights_first_then_the_rest(tmp_path: Path) -> None:
    save_steps(tmp_path, [1, 2])
    ckpt = make(tmp_path)
    w = ckpt.restore(weights_only=True)
    assert w.partial and list(w.state) == ["model"] and w.step == 2
    assert np.array_equal(w.state["model"]["w"], state_for(2)["model"]["w"])
    rest = ckpt.restore_rest()
    assert rest.step == 2 and set(rest.state) == {"optimizer", "rng"}
    assert rest.state["optimizer"]["step"] == 2
    with pytest.raises(Exception, match="restore_rest"):
        ckpt.restore_rest()
    ckpt.close()


def test_weights_first_rolls_back_when_the_rest_is_corrupt_everywhere(tmp_path: Path) -> None:
    save_steps(tmp_path, [1, 2])
    for tier in ("local", "pfs"):
        flip(payload(tmp_path, tier, 2) / "data-0001.bin")  # optimizer blob
    ckpt = make(tmp_path)
    w = ckpt.restore_weights()
    # the weights of step 2 verify and are handed out before the rest is read ...
    assert (w.step, w.partial) == (2, True) and w.state["model"]["w"][0] == 2
    rest = ckpt.restore_rest()
    # ... whose corruption then rolls the whole state back to step 1, weights included
    assert rest.rolled_back and not rest.partial and rest.step == 1
    assert rest.state["model"]["w"][0] == 1 and rest.state["optimizer"]["step"] == 1
    assert ckpt.restored.step == 1
    assert_bad(ckpt, 2, "local", "pfs")
    ckpt.close()


def test_weights_first_takes_the_rest_of_the_same_step_from_the_pfs(tmp_path: Path) -> None:
    save_steps(tmp_path, [1, 2])
    flip(payload(tmp_path, "local", 2) / "data-0001.bin")
    ckpt = make(tmp_path)
    w = ckpt.restore_weights()
    assert (w.step, w.tier) == (2, "local")
    rest = ckpt.restore_rest()
    assert (rest.step, rest.tier, rest.rolled_back) == (2, "pfs", False)
    assert rest.state["optimizer"]["step"] == 2
    assert_bad(ckpt, 2, "local")
    ckpt.close()


def test_weights_first_refuses_a_truncated_rest_before_the_weights(tmp_path: Path) -> None:
    save_steps(tmp_path, [1, 2])
    for tier in ("local", "pfs"):
        blob = payload(tmp_path, tier, 2) / "data-0001.bin"
        os.truncate(blob, blob.stat().st_size - 1)
    ckpt = make(tmp_path)
    assert ckpt.restore_weights().step == 1  # sizes are checked before anything is read
    assert ckpt.restore_rest().state["optimizer"]["step"] == 1
    ckpt.close()


def test_weights_first_with_nothing_to_roll_back_to_raises(tmp_path: Path) -> None:
    save_steps(tmp_path, [1])
    for tier in ("local", "pfs"):
        flip(payload(tmp_path, tier, 1) / "data-0001.bin")
    ckpt = make(tmp_path)
    assert ckpt.restore_weights().step == 1
    with pytest.raises(VerifyError, match="no older checkpoint verifies"):
        ckpt.restore_rest()
    ckpt.close()


def test_restores_leave_no_descriptor_open(tmp_path: Path) -> None:
    save_steps(tmp_path, [1, 2])
    flip(payload(tmp_path, "local", 2) / "data-0001.bin")
    before = sorted(os.listdir("/proc/self/fd"))
    ckpt = make(tmp_path)
    ckpt.close()
    baseline = sorted(os.listdir("/proc/self/fd"))  # a Checkpointer's own files closed
    for weights_only in (False, True):
        ckpt = make(tmp_path)
        got = ckpt.restore(weights_only=weights_only)
        if weights_only:
            ckpt.restore_rest()  # the local rest is corrupt: from the PFS
        assert got.step == 2
        ckpt.close()
        assert sorted(os.listdir("/proc/self/fd")) == baseline == before


def test_close_stops_the_background_read_of_an_unclaimed_rest(tmp_path: Path) -> None:
    save_steps(tmp_path, [1, 2])
    ckpt = make(tmp_path)
    assert ckpt.restore_weights().step == 2
    ckpt.close()
    assert not [t for t in threading.enumerate() if t.name == "ckpt-restore-rest"]


def test_training_back_over_an_abandoned_step_replaces_it(tmp_path: Path) -> None:
    save_steps(tmp_path, [1, 2])
    for tier in ("local", "pfs"):
        flip(payload(tmp_path, tier, 2) / "data-0000.bin")
    ckpt = make(tmp_path)
    assert ckpt.restore().step == 1
    new = state_for(2)
    new["optimizer"]["step"] = 222
    ckpt.save(new, step=2, tokens=200)
    stats = ckpt.close()
    assert stats.failures == 0 and stats.flush_failures == 0
    again = make(tmp_path)
    got = again.restore()
    assert (got.step, got.state["optimizer"]["step"]) == (2, 222)
    assert again.warm.verify(again.user, "run", 2).ok
    again.close()


# ------------------------------------------------------------------ multi-rank


def _rank_save(root: str, rank: int, world: int, steps: List[int], per_node: bool) -> None:
    local = Path(root) / (f"node{rank}" if per_node else "local")
    ckpt = make(Path(root), local=local, key="job", rank=rank, world_size=world)
    for s in steps:
        ckpt.save(state_for(s, rank), step=s, tokens=100 * s)
        ckpt.wait()
    ckpt.close()


def _rank_restore(
    root: str,
    rank: int,
    world: int,
    per_node: bool,
    out: Any,
    barrier: Any,
    shared: Any,
    weights_first: bool = False,
) -> None:
    agree = None
    if barrier is not None:

        def agree(value: int) -> int:
            shared[rank] = value
            barrier.wait()
            low = min(shared[:])
            barrier.wait()
            return low

    local = Path(root) / (f"node{rank}" if per_node else "local")
    ckpt = make(Path(root), local=local, key="job", rank=rank, world_size=world, agree=agree)
    got = ckpt.restore(weights_only=weights_first)
    if got is not None and weights_first:
        rest = ckpt.restore_rest()  # collective: a rank's corrupt rest rolls all back
        if rest.rolled_back:
            got = rest
    bad = []
    if ckpt.ledger is not None:
        bad = [
            (r.step, t)
            for r in ckpt.ledger.records(ckpt.user)
            for t, s in r.tiers.items()
            if s == State.BAD
        ]
    ckpt.close()
    if got is None:
        out.put((rank, None, None, None, bad))
    else:
        out.put((rank, got.step, got.tier, float(got.state["model"]["w"][0]), bad))


def _run(target: Any, argsets: List[tuple]) -> None:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=a) for a in argsets]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0, f"rank process failed with {p.exitcode}"


def _restore_all(
    root: Path, world: int, per_node: bool, agree: bool, weights_first: bool = False
) -> Dict[int, tuple]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    barrier = ctx.Barrier(world) if agree else None
    shared = ctx.Array("q", world) if agree else None
    _run(
        _rank_restore,
        [
            (str(root), r, world, per_node, out, barrier, shared, weights_first)
            for r in range(world)
        ],
    )
    results = [out.get(timeout=30) for _ in range(world)]
    return {r[0]: r[1:] for r in results}


def test_multi_rank_one_node_needs_every_shard(tmp_path: Path) -> None:
    world = 3
    _run(
        _rank_save,
        [(str(tmp_path), r, world, [1, 2] if r == 1 else [1, 2, 3], False) for r in range(world)],
    )
    # Each rank is its own series; files under rank-NNNNN/; meta names rank and world.
    ckpt = make(tmp_path, key="job", rank=2, world_size=world)
    assert ckpt.shard_key == "job.rank00002"
    m = ckpt.local.manifest(ckpt.user, "job.rank00002", 3)
    assert (m.meta["rank"], m.meta["world_size"]) == (2, 3)
    assert all(f.path.startswith("rank-00002/") for f in m.files)
    ckpt.close()
    got = _restore_all(tmp_path, world, per_node=False, agree=False)
    # Rank 1 never committed step 3: the newest complete step is 2, for every rank.
    for r in range(world):
        step, tier, w0, _ = got[r]
        assert (step, tier, w0) == (2, "local", r * 1000 + 2)


def test_multi_rank_per_node_local_tiers_agree_on_the_pfs(tmp_path: Path) -> None:
    world = 3
    _run(_rank_save, [(str(tmp_path), r, world, [1, 2, 3], True) for r in range(world)])
    # Rank 0's flush of step 3 never happened (node lost before the copy).
    ckpt = make(tmp_path, local=tmp_path / "node0", key="job", rank=0, world_size=world)
    ckpt.warm.delete(ckpt.user, "job.rank00000", 3)
    ckpt.close()
    got = _restore_all(tmp_path, world, per_node=True, agree=False)
    assert {r: got[r][0] for r in range(world)} == {0: 2, 1: 2, 2: 2}


def test_multi_rank_agreement_when_one_shard_is_corrupt(tmp_path: Path) -> None:
    world = 3
    _run(_rank_save, [(str(tmp_path), r, world, [1, 2, 3], True) for r in range(world)])
    user = [u for u in os.listdir(tmp_path / "pfs") if not u.startswith(".")][0]
    for tier in ("node1", "pfs"):
        blob = tmp_path / tier / user / "job.rank00001" / STEP_DIR.format(3) / "rank-00001"
        flip(blob / "data-0000.bin")
    got = _restore_all(tmp_path, world, per_node=True, agree=True)
    for r in range(world):
        step, tier, w0, bad = got[r]
        assert (step, tier, w0) == (2, "local", r * 1000 + 2)
    assert sorted(got[1][3]) == [(3, "local"), (3, "pfs")]
    assert got[0][3] == [] and got[2][3] == []


def test_multi_rank_weights_first_rolls_every_rank_back(tmp_path: Path) -> None:
    world = 3
    _run(_rank_save, [(str(tmp_path), r, world, [1, 2, 3], True) for r in range(world)])
    user = [u for u in os.listdir(tmp_path / "pfs") if not u.startswith(".")][0]
    for tier in ("node1", "pfs"):  # rank 1's optimizer blob of step 3, on both tiers
        blob = tmp_path / tier / user / "job.rank00001" / STEP_DIR.format(3) / "rank-00001"
        flip(blob / "data-0001.bin")
    got = _restore_all(tmp_path, world, per_node=True, agree=True, weights_first=True)
    for r in range(world):
        step, tier, w0, _ = got[r]
        assert (step, tier, w0) == (2, "local", r * 1000 + 2)
    assert sorted(got[1][3]) == [(3, "local"), (3, "pfs")]


def test_a_rotten_pfs_copy_is_uncommitted_so_a_good_local_copy_is_flushed_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Node A wrote steps 1-2 and flushed them; the PFS copy of 2 rots. Node B (empty
    local tier) restores: step 2 fails verification on the PFS, B falls back to step 1,
    and the rotten copy is no longer committed. So node A's good local copy of step 2 is
    owed to the PFS again (a re-flush copies it; had the rotten copy stayed committed, the
    identical manifest would make the flush copy nothing, and A's retention could drop
    the only good copy)."""
    save_steps(tmp_path, [1, 2], flush_every=1)
    flip(payload(tmp_path, "pfs", 2) / "data-0001.bin")
    b = make(tmp_path, local=tmp_path / "local-b")
    with caplog.at_level(logging.WARNING):
        check(b.restore(), 1, "pfs")
    b.close()
    # B holds no copy of its own: it must not claim that one is flushed again.
    said = [r.getMessage() for r in caplog.records if "uncommitted the corrupt" in r.getMessage()]
    assert len(said) == 1 and "this node holds no other copy of that step" in said[0], said
    assert [s.step for s in b.warm.steps(b.user, "run")] == [1]
    # Uncommitted, not deleted: every node holding step 2 can tell it was found damaged
    # (tests/test_warm_scrub.py runs the hooks of such a node).
    assert b.warm.uncommitted(b.user, "run", 2)
    a = make(tmp_path)
    res = copy_checkpoint(a.local, a.warm, a.user, "run", 2)
    assert not res.already_present and a.warm.verify(a.user, "run", 2).ok
    a.close()


def test_damage_on_both_tiers_never_claims_a_good_copy(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 2 rots on the local tier and on the PFS (issue 31: the restore said the step
    "is flushed again from a good copy" when none existed). The restore falls back to
    step 1, and its line about the uncommitted PFS copy says that this node's copy failed
    its check too: no promise of a re-flush from it."""
    save_steps(tmp_path, [1, 2], flush_every=1)
    for tier in ("local", "pfs"):
        flip(payload(tmp_path, tier, 2) / "data-0001.bin")
    ckpt = make(tmp_path)
    with caplog.at_level(logging.WARNING):
        check(ckpt.restore(), 1, "local")
    ckpt.close()
    said = [r.getMessage() for r in caplog.records if "uncommitted the corrupt" in r.getMessage()]
    assert len(said) == 1, said
    assert "local copy of that step failed verification too" in said[0], said
    assert "flushed again if it verifies" not in said[0], said
    assert_bad(ckpt, 2, "local")
