"""One user's owed checkpoints cost another's a bounded share of a hook's budget
(issue 28): the flushes take turns by owner, one batch each per round, and while others
wait one copy gets at most its share of the time left (never less than its allowance)."""

from __future__ import annotations

from typing import List, Optional, Tuple

from slurm_ckpt.ledger import Record
from slurm_ckpt.node.asuser import AsUserTimeout
from slurm_ckpt.node.flush_engine import Flusher, FlushStatus
from slurm_ckpt.node.work import BATCH_MAX, fair_order
from slurm_ckpt.tiers.copy import CopyResult


def test_owners_take_turns_one_batch_each() -> None:
    many = [Record("mallory", "ghosts", s, nbytes=64) for s in range(3 * BATCH_MAX)]
    victim = [Record("alice", "run", 1, nbytes=64), Record("alice", "run", 2, nbytes=64)]
    order = fair_order(many + victim)
    assert sorted(r.ident for r in order) == sorted(r.ident for r in many + victim)
    # Mallory's first batch (the ending job's owner goes first), then all of Alice's.
    assert [r.user for r in order[: BATCH_MAX + 2]] == ["mallory"] * BATCH_MAX + ["alice"] * 2
    # Each owner's own order is kept.
    assert [r.step for r in order if r.user == "mallory"] == list(range(3 * BATCH_MAX))


def test_big_checkpoints_make_smaller_batches() -> None:
    big = [Record("mallory", "big", s, nbytes=40 * 2**20) for s in range(3)]
    order = fair_order(big + [Record("alice", "run", 1, nbytes=1)])
    assert [r.user for r in order] == ["mallory", "alice", "mallory", "mallory"]


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_copy_gets_its_share_while_others_wait() -> None:
    clock = _Clock()
    given: List[Tuple[Tuple[str, str, int], Optional[float]]] = []

    def copy(ident: Tuple[str, str, int], left: Optional[float]) -> CopyResult:
        given.append((ident, left))
        if ident[0] == "mallory":
            clock.now += left or 0.0  # a copy that takes all the time it is given
            raise _timed_out()
        clock.now += 0.1
        return CopyResult(ident[2], 64, 64, 0.1)

    fl = Flusher(copy, None, clock=clock, allowance=lambda n: 2.0)
    items = [(("mallory", "slow", 1), 64), (("alice", "run", 1), 64)]
    out = fl.flush_all(items, deadline=clock.now + 100.0)
    assert given[0][1] == 50.0  # half of what was left: one other owner waits
    statuses = {r.ident[0]: r.status for r in out.results}
    # Alice is flushed; Mallory's copy, cut at its share, is handed off, not a failure.
    assert statuses == {"mallory": FlushStatus.HANDED, "alice": FlushStatus.FLUSHED}
    assert not [r for r in out.results if r.stuck]


def test_alone_a_copy_gets_all_the_time_left() -> None:
    clock = _Clock()
    given: List[Optional[float]] = []

    def copy(ident: Tuple[str, str, int], left: Optional[float]) -> CopyResult:
        given.append(left)
        return CopyResult(ident[2], 64, 64, 0.0)

    Flusher(copy, None, clock=clock, allowance=lambda n: 2.0).flush_all(
        [(("alice", "run", 1), 64)], deadline=clock.now + 100.0
    )
    assert given == [100.0]


def _timed_out() -> Exception:
    return AsUserTimeout("flush as mallory: timed out")
