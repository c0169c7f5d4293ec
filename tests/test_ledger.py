"""The per-node flush ledger: transactions, concurrency, crashes, corruption, node status."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import random
import signal
import stat
import threading
import time
from pathlib import Path

import pytest

from slurm_ckpt.core import fsio
from slurm_ckpt.core.names import validate_node as validate_node_name
from slurm_ckpt.core.retention import RetentionPolicy, plan_local_deletions
from slurm_ckpt.errors import CkptError, InvalidName, NotFound, TierError
from slurm_ckpt.ledger import (
    LEDGER_NAME,
    LOCK_NAME,
    Ledger,
    LedgerError,
    Record,
    State,
    codec,
    node_status,
    publish_status,
    read_node_statuses,
    status_path,
)
from slurm_ckpt.ledger.lockfile import LockFile

FORK = mp.get_context("fork")


class Clock:
    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def tick(self, dt: float = 1.0) -> float:
        self.t += dt
        return self.t


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def led(tmp_path, clock):
    return Ledger(tmp_path / "ledger", "node-01", clock=clock)


def commit(
    led,
    step,
    *,
    user="alice",
    key="run1",
    nbytes=1000,
    seq=None,
    job="123",
    sel=True,
    forced=False,
    durations=None,
):
    return led.record_local_commit(
        user,
        key,
        step,
        nbytes=nbytes,
        seq=step if seq is None else seq,
        job=job,
        selected_for_flush=sel,
        forced=forced,
        durations=durations,
    )


# -- basics -------------------------------------------------------------------------------


def test_creates_directory_and_files(tmp_path):
    d = tmp_path / "a" / "b"
    led = Ledger(d, "n1")
    assert d.is_dir()
    assert stat.S_IMODE(d.stat().st_mode) & 0o700 == 0o700
    assert not (d / LEDGER_NAME).exists()  # nothing written yet
    assert led.records() == []
    commit(led, 1)
    assert (d / LEDGER_NAME).is_file()
    assert (d / LOCK_NAME).exists()
    assert stat.S_IMODE((d / LEDGER_NAME).stat().st_mode) == 0o644


def test_record_local_commit_fields(led, clock):
    rec = commit(
        led, 100, nbytes=5 << 30, seq=3, job=4242, durations={"snapshot_s": 1.5, "local_s": 3}
    )
    assert rec.ident == ("alice", "run1", 100)
    got = led.get("alice", "run1", 100)
    assert got == rec
    assert got.tiers == {"local": State.COMMITTED, "pfs": State.FLUSH_PENDING}
    assert got.state("local") is State.COMMITTED
    assert got.nbytes == 5 << 30 and got.seq == 3 and got.job == "4242"
    assert got.selected_for_flush and not got.forced and not got.pinned
    assert got.committed_at == {"local": clock.t}
    assert got.created_at == clock.t == got.updated_at
    assert got.durations == {"snapshot_s": 1.5, "local_s": 3.0}
    assert got.pending_flush and got.needs_flush


def test_not_selected_has_no_pfs_state(led):
    rec = commit(led, 1, sel=False)
    assert "pfs" not in rec.tiers
    assert not rec.pending_flush
    assert led.pending_flush() == []


def test_forced_is_pending_even_if_not_selected(led):
    rec = commit(led, 1, sel=False, forced=True)
    assert rec.tiers["pfs"] == State.FLUSH_PENDING
    assert [r.step for r in led.pending_flush()] == [1]


def test_get_missing_returns_none(led):
    assert led.get("alice", "run1", 1) is None
    commit(led, 1)
    assert led.get("alice", "run1", 2) is None
    assert led.get("bob", "run1", 1) is None


def test_mark_flush_lifecycle(led, clock):
    commit(led, 10)
    t0 = clock.tick()
    rec = led.mark("alice", "run1", 10, "pfs", State.FLUSHING)
    assert rec.tiers["pfs"] == State.FLUSHING
    assert rec.flush_started_at == {"pfs": t0}
    assert rec.attempts == 1
    clock.tick()
    rec = led.mark(
        "alice", "run1", 10, "pfs", "FAILED", reason="copy failed:\n  EIO on ost7", code="pfs_io"
    )
    assert rec.state("pfs") is State.FAILED
    assert rec.error == "copy failed: EIO on ost7"
    assert led.failures() == {"pfs_io": 1}
    assert led.pending_flush()[0].step == 10  # FAILED is retried
    clock.tick()
    led.mark("alice", "run1", 10, "pfs", State.FLUSHING)
    t1 = clock.tick()
    rec = led.mark("alice", "run1", 10, "pfs", State.VERIFIED, durations={"flush_s": 12.5})
    assert rec.attempts == 2
    assert rec.verified_at == {"pfs": t1}
    assert rec.committed_at["pfs"] == t1
    assert rec.durations["flush_s"] == 12.5
    assert rec.error == "copy failed: EIO on ost7"  # last error kept as history
    assert led.pending_flush() == []
    assert led.get("alice", "run1", 10) == rec


def test_mark_bad_records_reason_and_stays_pending(led):
    commit(led, 1)
    rec = led.mark("alice", "run1", 1, "pfs", State.BAD)
    assert rec.error == "BAD"
    assert [r.step for r in led.pending_flush()] == [1]
    rec = led.mark("alice", "run1", 1, "local", State.BAD, reason="xxh3 mismatch")
    assert led.pending_flush() == []  # the local copy itself is bad


def test_mark_extra_fields_and_errors(led):
    commit(led, 1)
    rec = led.mark(
        "alice",
        "run1",
        1,
        "local",
        State.VERIFIED,
        pinned=True,
        forced=True,
        job=77,
        durations={"verify_s": 2},
    )
    assert rec.pinned and rec.forced and rec.job == "77"
    assert rec.durations["verify_s"] == 2.0
    with pytest.raises(TypeError):
        led.mark("alice", "run1", 1, "local", State.VERIFIED, bogus=1)
    with pytest.raises(TypeError):
        led.mark("alice", "run1", 1, "local", State.VERIFIED, step=3)
    with pytest.raises(NotFound):
        led.mark("alice", "run1", 2, "local", State.VERIFIED)
    with pytest.raises(InvalidName):
        led.mark("alice", "run1", 1, "../pfs", State.VERIFIED)
    with pytest.raises(ValueError):
        led.mark("alice", "run1", 1, "pfs", "SORT_OF_DONE")
    with pytest.raises(InvalidName):
        led.mark("alice", "run1", -1, "pfs", State.VERIFIED)
    with pytest.raises(InvalidName):
        commit(led, 1, user="")


def test_state_names():
    assert {s.value for s in State} >= {
        "WRITING",
        "COMMITTED",
        "VERIFIED",
        "FLUSH_PENDING",
        "FLUSHING",
        "FAILED",
        "BAD",
        "DELETED",
    }


def test_records_filters_and_order(led):
    for step in (10, 2, 1):
        commit(led, step, job="j1")
    commit(led, 5, key="run2", job="j2")
    commit(led, 7, user="bob", key="run1", job="j3")
    assert [r.ident for r in led.records()] == [
        ("alice", "run1", 1),
        ("alice", "run1", 2),
        ("alice", "run1", 10),
        ("alice", "run2", 5),
        ("bob", "run1", 7),
    ]
    assert [r.step for r in led.records(user="alice", key="run1")] == [1, 2, 10]
    assert [r.step for r in led.records(key="run1")] == [1, 2, 10, 7]
    assert [r.step for r in led.records(user="bob")] == [7]
    assert [r.step for r in led.records(job="j2")] == [5]
    assert led.records(user="carol") == []
    # A user that is a prefix of another is not mixed up with it.
    commit(led, 1, user="al")
    assert [r.user for r in led.records(user="al")] == ["al"]


def test_pending_flush_and_bytes(led, clock):
    commit(led, 1, nbytes=100)
    clock.tick()
    commit(led, 2, nbytes=200, sel=False)
    clock.tick()
    commit(led, 3, nbytes=300)
    clock.tick()
    commit(led, 4, nbytes=400, sel=False, forced=True)
    clock.tick()
    commit(led, 5, nbytes=500, key="other", job="999")
    led.mark("alice", "run1", 3, "pfs", State.FLUSHING)
    # Forced first, then oldest commit first; FLUSHING is still pending.
    assert [r.step for r in led.pending_flush()] == [4, 1, 3, 5]
    assert led.pending_bytes() == 100 + 300 + 400 + 500
    assert led.pending_bytes(key="other") == 500
    assert led.pending_bytes(job="999") == 500
    assert [r.step for r in led.pending_flush(user="alice", key="run1")] == [4, 1, 3]
    led.mark("alice", "run1", 1, "pfs", State.VERIFIED)
    led.mark("alice", "run1", 3, "local", State.DELETED)
    led.mark("alice", "other", 5, "pfs", State.DELETED)
    assert [r.step for r in led.pending_flush()] == [4]
    assert led.pending_bytes() == 400


def test_recommit_keeps_pinned_and_verified_pfs(led):
    commit(led, 1)
    led.mark("alice", "run1", 1, "pfs", State.VERIFIED, pinned=True)
    rec = commit(led, 1, nbytes=9)
    assert rec.pinned and rec.tiers["pfs"] == State.VERIFIED and rec.nbytes == 9
    led.mark("alice", "run1", 1, "pfs", State.FAILED, reason="x")
    rec = commit(led, 1)
    assert rec.tiers["pfs"] == State.FLUSH_PENDING and rec.error is None and rec.attempts == 0


def test_update_generic_transaction(led):
    def create(rec):
        assert rec is None
        r = Record("alice", "run1", 7, nbytes=1)
        r.tiers["local"] = State.WRITING
        return r

    rec = led.update("alice", "run1", 7, create)
    assert rec.tiers == {"local": State.WRITING} and rec.created_at > 0

    def bump(rec):
        rec.nbytes += 1
        return rec

    for _ in range(3):
        led.update("alice", "run1", 7, bump)
    assert led.get("alice", "run1", 7).nbytes == 4
    before = led.path.stat().st_mtime_ns, led.path.read_bytes()
    assert led.update("alice", "run1", 7, lambda r: None).nbytes == 4
    assert led.update("alice", "run1", 8, lambda r: None) is None
    assert (led.path.stat().st_mtime_ns, led.path.read_bytes()) == before

    with pytest.raises(ValueError):
        led.update("alice", "run1", 7, lambda r: Record("alice", "run1", 8))
    with pytest.raises(ZeroDivisionError):
        led.update("alice", "run1", 7, lambda r: 1 / 0)
    assert led.path.read_bytes() == before[1]  # failed transactions change nothing


def test_nested_call_is_refused(led):
    commit(led, 1)

    def nested(rec):
        led.mark("alice", "run1", 1, "pfs", State.VERIFIED)
        return rec

    with pytest.raises(RuntimeError):
        led.update("alice", "run1", 1, nested)
    # The ledger still works (lock released, flag cleared).
    led.mark("alice", "run1", 1, "pfs", State.VERIFIED)


def test_returned_records_are_copies(led):
    commit(led, 1)
    rec = led.get("alice", "run1", 1)
    rec.tiers["pfs"] = State.VERIFIED
    rec.durations["x"] = 1.0
    assert led.get("alice", "run1", 1).tiers["pfs"] == State.FLUSH_PENDING
    assert "x" not in led.get("alice", "run1", 1).durations


def test_forget_and_failures(led):
    commit(led, 1)
    assert led.forget("alice", "run1", 1)
    assert not led.forget("alice", "run1", 1)
    assert led.get("alice", "run1", 1) is None
    assert led.count_failure("pfs_enospc") == 1
    assert led.count_failure("pfs_enospc", 2) == 3
    assert led.count_failure("verify\nmismatch") == 1
    assert led.failures() == {"pfs_enospc": 3, "verify mismatch": 1}


def test_persists_across_instances(tmp_path):
    a = Ledger(tmp_path, "n1")
    commit(a, 1)
    a.mark("alice", "run1", 1, "pfs", State.FLUSHING)
    a.count_failure("x")
    b = Ledger(tmp_path, "n1")
    assert b.get("alice", "run1", 1).tiers["pfs"] == State.FLUSHING
    assert b.failures() == {"x": 1}


def test_file_is_json_lines_with_checksum(led):
    commit(led, 1)
    commit(led, 2, user='we"ird\\user\t\n', key="ключ/🙂")
    lines = led.path.read_bytes().split(b"\n")
    assert lines[-1] == b""
    docs = [json.loads(line) for line in lines[:-1]]
    assert docs[0]["format"] == "slurm_ckpt.ledger" and docs[0]["records"] == 2
    assert docs[0]["node"] == "node-01"
    assert docs[-1]["end"] == 2 and len(docs[-1]["xxh3_64"]) == 16
    assert sorted(d[2] for d in docs[1:-1]) == [1, 2]


def test_odd_names_round_trip(tmp_path):
    led = Ledger(tmp_path, "n1")
    user, key = 'we"ird\\user\t\n', "ключ/🙂,{"
    commit(led, 3, user=user, key=key)
    commit(led, 4, user=user, key="plain")
    fresh = Ledger(tmp_path, "n1")
    assert fresh.get(user, key, 3).ident == (user, key, 3)
    assert [r.step for r in fresh.records(user=user)] == [4, 3]  # "plain" < "ключ..."
    assert [r.step for r in fresh.records(user=user, key=key)] == [3]
    fresh.mark(user, key, 3, "pfs", State.VERIFIED)
    assert Ledger(tmp_path, "n1").get(user, key, 3).state("pfs") is State.VERIFIED


def test_unknown_fields_and_states_survive_a_rewrite(led):
    commit(led, 1)

    def future(rec):
        rec.extra["future_field"] = {"a": [1, 2]}
        rec.tiers["object"] = "TELEPORTED"
        return rec

    led.update("alice", "run1", 1, future)
    led.mark("alice", "run1", 1, "pfs", State.VERIFIED)
    rec = Ledger(led.directory, "node-01").get("alice", "run1", 1)
    assert rec.extra == {"future_field": {"a": [1, 2]}}
    assert rec.tiers["object"] == "TELEPORTED"
    assert rec.state("object") is None


def test_non_finite_durations_are_dropped(led):
    rec = commit(led, 1, durations={"a": float("nan"), "b": float("inf"), "c": 1})
    assert rec.durations == {"c": 1.0}


def test_lock_timeout_is_a_one_line_error(tmp_path):
    led = Ledger(tmp_path, "n1", lock_timeout=0.2)
    other = LockFile(tmp_path, LOCK_NAME, 1.0)  # another writer of this node, holding it
    other.acquire()
    with pytest.raises(LedgerError) as exc:
        commit(led, 1)
    other.release()
    assert isinstance(exc.value, CkptError)
    assert "\n" not in str(exc.value) and "busy" in str(exc.value)
    commit(led, 1)  # works once the lock is free


def test_unwritable_directory_raises_ledger_error(tmp_path, monkeypatch):
    led = Ledger(tmp_path, "n1")

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fsio, "write_all", boom)
    with pytest.raises(LedgerError, match="No space left"):
        commit(led, 1)
    monkeypatch.undo()
    assert not led.path.exists()
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []
    commit(led, 1)
    assert led.get("alice", "run1", 1) is not None


@pytest.mark.parametrize(
    "node", ["", ".", "..", ".hidden", "a/b", "../x", "x y", "n\n", "n1\x00", "nöde", "a" * 201, 5]
)
def test_bad_node_names(tmp_path, node):
    with pytest.raises(InvalidName):
        Ledger(tmp_path, node)  # type: ignore[arg-type]


def test_good_node_names():
    for node in ("n1", "gpu-a100-017", "c1.cluster.example.org", "NODE_7", "0"):
        assert validate_node_name(node) == node


# -- retention integration ----------------------------------------------------------------


def test_to_local_info_feeds_the_planner(led):
    for step in range(1, 6):
        commit(led, step)
    for step in (1, 2, 3):
        led.mark("alice", "run1", step, "pfs", State.VERIFIED)
    infos = [r.to_local_info() for r in led.records(user="alice", key="run1")]
    assert [i.warm_verified for i in infos] == [True, True, True, False, False]
    assert plan_local_deletions(infos, RetentionPolicy(keep_local=0)) == [1, 2, 3]


# -- reconcile / expire -------------------------------------------------------------------


def test_reconcile_rebuilds_an_empty_ledger(led):
    counts = led.reconcile(
        local_steps=[("alice", "run1", 10, 111), ("alice", "run1", 20, 222)],
        warm_verified_steps=[("alice", "run1", 10, 111), ("carol", "x", 5, 1)],
    )
    assert counts == {"added": 2, "fixed": 0, "pruned": 0}
    r10, r20 = led.records()
    assert r10.tiers == {"local": State.COMMITTED, "pfs": State.VERIFIED}
    assert r20.tiers == {"local": State.COMMITTED, "pfs": State.FLUSH_PENDING}
    assert r20.selected_for_flush and r20.seq == -1 and r20.nbytes == 222
    assert r20.extra.get("reconciled") is True
    # PFS entries never create records: the PFS is shared by all nodes.
    assert led.get("carol", "x", 5) is None
    assert [r.step for r in led.pending_flush()] == [20]
    # Running it again changes nothing.
    before = led.path.read_bytes()
    assert led.reconcile(
        [("alice", "run1", 10, 111), ("alice", "run1", 20, 222)], [("alice", "run1", 10, 111)]
    ) == {"added": 0, "fixed": 0, "pruned": 0}
    assert led.path.read_bytes() == before


def test_reconcile_fixes_and_prunes(led):
    commit(led, 1)  # local live, missing from scan -> DELETED
    commit(led, 2)  # marked DELETED, found on disk -> COMMITTED
    led.mark("alice", "run1", 2, "local", State.DELETED)
    commit(led, 3)  # FLUSHING, PFS has it verified -> VERIFIED
    led.mark("alice", "run1", 3, "pfs", State.FLUSHING)
    commit(led, 4)  # pfs VERIFIED but gone, local live -> pfs cleared (flush again)
    led.mark("alice", "run1", 4, "pfs", State.VERIFIED)
    commit(led, 5)  # pfs VERIFIED but gone, local gone too -> pfs DELETED
    led.mark("alice", "run1", 5, "pfs", State.VERIFIED)
    led.mark("alice", "run1", 5, "local", State.DELETED)
    led.update(
        "alice", "run1", 6, lambda r: Record("alice", "run1", 6, tiers={"local": State.WRITING})
    )
    counts = led.reconcile(
        local_steps=[("alice", "run1", s, 1000) for s in (2, 3, 4)],
        warm_verified_steps=[("alice", "run1", 3, 1000)],
    )
    assert counts == {"added": 0, "fixed": 2, "pruned": 3}
    by = {r.step: r for r in led.records()}
    assert by[1].tiers["local"] == State.DELETED
    assert by[2].tiers["local"] == State.COMMITTED
    assert by[3].tiers["pfs"] == State.VERIFIED
    assert "pfs" not in by[4].tiers and "pfs" not in by[4].verified_at
    assert by[4].pending_flush
    assert by[5].tiers == {"local": State.DELETED, "pfs": State.DELETED}
    assert by[6].tiers == {"local": State.WRITING}  # in progress: left alone


def _two_hooks_race(led, clock, since):
    """Two epilogs on one node at once, as in the landing CI's load test: hook B takes its
    view (the local scan and the ledger's verified steps) first; hook A then flushes steps
    119 and 120 and retention deletes step 118's local copy; then B reconciles with its
    view."""
    for step in (118, 119, 120):
        commit(led, step)
    clock.tick()
    b_since = clock()  # B starts: its scan sees 118-120, the ledger says none is verified
    b_local = [("alice", "run1", s, 1000) for s in (118, 119, 120)]
    b_verified: list = []
    clock.tick()
    led.mark_many([("alice", "run1", 119), ("alice", "run1", 120)], "pfs", State.VERIFIED)
    led.mark("alice", "run1", 118, "pfs", State.VERIFIED)
    led.mark("alice", "run1", 118, "local", State.DELETED)
    clock.tick()
    return led.reconcile(b_local, b_verified, since=b_since if since else None)


def test_a_reconcile_leaves_what_changed_after_its_scan_began(led, clock):
    counts = _two_hooks_race(led, clock, since=True)
    assert counts == {"added": 0, "fixed": 0, "pruned": 0}
    assert led.pending_flush() == []  # A's flushes stand: nothing is owed again
    by = {r.step: r for r in led.records()}
    assert by[118].tiers == {"local": State.DELETED, "pfs": State.VERIFIED}  # A's retention
    assert by[119].tiers["pfs"] == State.VERIFIED and by[120].tiers["pfs"] == State.VERIFIED


def test_without_since_a_stale_reconcile_undoes_another_hooks_flush(led, clock):
    """Why ``since`` exists: the old behaviour, kept for callers whose scans are the truth
    (no other writer), owes the flushed steps again and revives the deleted copy."""
    _two_hooks_race(led, clock, since=False)
    # 118 too: its deleted local copy comes back and its verified warm copy is forgotten.
    assert sorted(r.step for r in led.pending_flush()) == [118, 119, 120]
    assert led.get("alice", "run1", 118).tiers["local"] == State.COMMITTED


def test_reconcile_without_prune_only_adds(led):
    commit(led, 1)
    counts = led.reconcile([("alice", "run1", 2, 5)], [], prune=False)
    assert counts == {"added": 1, "fixed": 0, "pruned": 0}
    assert led.get("alice", "run1", 1).tiers["local"] == State.COMMITTED


def test_expire_forgets_finished_records(led, clock):
    commit(led, 1)
    led.mark("alice", "run1", 1, "pfs", State.VERIFIED)
    led.mark("alice", "run1", 1, "local", State.DELETED)
    commit(led, 2)  # live locally
    commit(led, 3, sel=False)
    led.mark("alice", "run1", 3, "local", State.DELETED, pinned=True)
    clock.tick(100)
    assert led.expire(1000) == 0
    clock.tick(2000)
    assert led.expire(1000) == 1
    assert [r.step for r in led.records()] == [2, 3]


# -- corruption ---------------------------------------------------------------------------


def _aside(led):
    return sorted(p.name for p in led.directory.iterdir() if ".corrupt-" in p.name)


@pytest.mark.parametrize(
    "damage",
    ["garbage", "empty", "truncate", "flip", "json_doc", "drop_line", "no_trailer"],
)
def test_corrupt_file_is_moved_aside(led, caplog, damage):
    for step in range(5):
        commit(led, step)
    blob = led.path.read_bytes()
    if damage == "garbage":
        bad = b"\x00\xff not a ledger at all"
    elif damage == "empty":
        bad = b""
    elif damage == "truncate":
        bad = blob[: len(blob) // 2]
    elif damage == "flip":
        i = blob.index(b'"nbytes":1000') + 10
        bad = blob[:i] + b"9" + blob[i + 1 :]
    elif damage == "json_doc":
        bad = json.dumps({"format": "slurm_ckpt.ledger", "records": []}).encode()
    elif damage == "drop_line":
        lines = blob.split(b"\n")
        bad = b"\n".join(lines[:2] + lines[3:])
    else:
        bad = b"\n".join(blob.split(b"\n")[:-2]) + b"\n"
    led.path.write_bytes(bad)
    with caplog.at_level(logging.WARNING, logger="slurm_ckpt.ledger.ledger"):
        assert led.records() == []  # a lock-free reader recovers too
    assert any("corrupt" in r.getMessage() for r in caplog.records)
    aside = _aside(led)
    assert len(aside) == 1 and aside[0].startswith("ledger.json.corrupt-")
    assert (led.directory / aside[0]).read_bytes() == bad
    assert led.failures() == {"ledger_corrupt": 1}
    commit(led, 9)
    assert [r.step for r in led.records()] == [9]


def test_corrupt_file_found_by_a_writer(led, caplog):
    commit(led, 1)
    led.path.write_bytes(b"{oops")
    with caplog.at_level(logging.WARNING):
        commit(led, 2)
    assert [r.step for r in led.records()] == [2]
    assert len(_aside(led)) == 1
    # A second corruption in the same second gets its own name.
    led.path.write_bytes(b"{oops again")
    commit(led, 3)
    assert len(_aside(led)) == 2


def test_malformed_record_with_valid_checksum_is_dropped(led, caplog):
    commit(led, 1)
    commit(led, 2)
    blob = led.path.read_bytes()
    lines = blob.split(b"\n")[:-2]  # header + records
    lines.insert(2, b'["alice","run1",-5,{"tiers":[]}]')
    lines.insert(2, b'["alice"  ,  "run1",  7,{"tiers":{"local":"COMMITTED"}}]')
    header = json.loads(lines[0])
    header["records"] = len(lines) - 1
    lines[0] = json.dumps(header).encode()
    body = b"\n".join(lines) + b"\n"
    import xxhash

    trailer = {"end": len(lines) - 1, "xxh3_64": xxhash.xxh3_64_hexdigest(body)}
    led.path.write_bytes(body + json.dumps(trailer).encode() + b"\n")
    with caplog.at_level(logging.WARNING):
        assert [r.step for r in led.records()] == [1, 2, 7]
    assert any("malformed" in r.getMessage() for r in caplog.records)
    assert _aside(led) == []
    # The next write stores the canonical form.
    led.mark("alice", "run1", 7, "pfs", State.VERIFIED)
    assert b'["alice","run1",7,\t{' in led.path.read_bytes()
    assert [r.step for r in Ledger(led.directory, "node-01").records()] == [1, 2, 7]


def test_stale_temp_files_are_removed(led):
    commit(led, 1)
    stale = led.directory / f".{LEDGER_NAME}.tmp-99999-deadbeef"
    stale.write_bytes(b"half a ledg")
    commit(led, 2)
    assert not stale.exists()
    assert [r.step for r in led.records()] == [1, 2]


# -- performance --------------------------------------------------------------------------


def test_ten_thousand_records_load_and_save_fast(tmp_path):
    led = Ledger(tmp_path, "n1")
    with led._transaction() as data:
        for i in range(10_000):
            rec = Record(
                f"user{i % 50:02d}",
                f"run{i % 7}",
                i,
                nbytes=10**10,
                seq=i,
                selected_for_flush=True,
                job="1234567",
                created_at=1.7e9,
                updated_at=1.7e9,
                tiers={"local": State.COMMITTED, "pfs": State.VERIFIED},
                committed_at={"local": 1.7e9 + i, "pfs": 1.7e9 + i},
                flush_started_at={"pfs": 1.7e9 + i},
                verified_at={"pfs": 1.7e9 + i},
                durations={"snapshot_s": 1.5, "local_s": 3.2, "flush_s": 40.1},
            )
            data.put(codec.to_raw(rec))
    assert len(led.path.read_bytes()) > 1_000_000
    best_cycle = best_mark = float("inf")
    for _ in range(5):
        fresh = Ledger(tmp_path, "n1")  # cold cache
        t0 = time.perf_counter()
        data = fresh._load(recover=False)
        fresh._save(data)
        best_cycle = min(best_cycle, time.perf_counter() - t0)
        t0 = time.perf_counter()
        fresh.mark("user03", "run3", 3, "local", State.VERIFIED)
        best_mark = min(best_mark, time.perf_counter() - t0)
    assert best_cycle < 0.1, f"load+save of 10k records took {best_cycle * 1000:.0f} ms"
    assert best_mark < 0.1, f"one mark() on 10k records took {best_mark * 1000:.0f} ms"
    fresh = Ledger(tmp_path, "n1")
    assert len(fresh.records()) == 10_000
    assert fresh.get("user03", "run3", 3).state("local") is State.VERIFIED
    assert fresh.pending_flush() == []


# -- concurrency --------------------------------------------------------------------------


def _hammer(directory: str, worker: int, n: int, barrier) -> None:
    led = Ledger(Path(directory), "n1")
    barrier.wait()

    def bump(rec):
        rec.nbytes += 1
        rec.extra.setdefault("by", {})
        rec.extra["by"][str(worker)] = rec.extra["by"].get(str(worker), 0) + 1
        return rec

    for i in range(n):
        led.update("shared", "counter", 0, bump)
        if i % 10 == 0:
            led.record_local_commit(
                f"w{worker}", "run", i, nbytes=i, seq=i, job=worker, selected_for_flush=True
            )
            led.count_failure(f"w{worker}")
    os._exit(0)


def test_concurrent_processes_lose_no_update(tmp_path):
    led = Ledger(tmp_path, "n1")
    led.update("shared", "counter", 0, lambda r: Record("shared", "counter", 0))
    workers, n = 4, 150
    barrier = FORK.Barrier(workers)
    procs = [
        FORK.Process(target=_hammer, args=(str(tmp_path), w, n, barrier)) for w in range(workers)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    rec = led.get("shared", "counter", 0)
    assert rec.nbytes == workers * n
    assert rec.extra["by"] == {str(w): n for w in range(workers)}
    for w in range(workers):
        assert [r.step for r in led.records(user=f"w{w}")] == list(range(0, n, 10))
    assert led.failures() == {f"w{w}": n // 10 for w in range(workers)}
    assert _aside(led) == []


def test_concurrent_threads_lose_no_update(tmp_path):
    led = Ledger(tmp_path, "n1")
    led.update("shared", "counter", 0, lambda r: Record("shared", "counter", 0))
    errors = []

    def work():
        try:
            for _ in range(40):
                led.update(
                    "shared",
                    "counter",
                    0,
                    lambda r: Record(r.user, r.key, r.step, nbytes=r.nbytes + 1),
                )
                led.get("shared", "counter", 0)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert led.get("shared", "counter", 0).nbytes == 160


# -- crashes ------------------------------------------------------------------------------


def _writer_forever(directory: str, start: int, fd: int) -> None:
    led = Ledger(Path(directory), "n1")
    step = start
    while True:
        led.record_local_commit(
            "alice", "run", step, nbytes=step, seq=step, job="1", selected_for_flush=True
        )
        os.write(fd, b"%d\n" % step)  # only after the commit returned
        step += 1


def _read_acks(fd: int) -> list:
    chunks = []
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    return [int(x) for x in b"".join(chunks).split(b"\n") if x]


def test_sigkill_at_random_moments_never_tears_the_ledger(tmp_path):
    led = Ledger(tmp_path, "n1")
    # Some bulk so that each rewrite takes a while and kills land mid-write.
    with led._transaction() as data:
        for i in range(3000):
            data.put(
                codec.to_raw(Record("bulk", "b", i, nbytes=i, tiers={"local": State.COMMITTED}))
            )
    rng = random.Random(1234)
    committed: list = []
    next_step = 0
    # Kills that landed between creating the temp file and the rename (typically several
    # of the 30; timing-dependent, so only counted, not asserted).
    tmp_left = 0
    for _ in range(30):
        r, w = os.pipe()
        p = FORK.Process(target=_writer_forever, args=(str(tmp_path), next_step, w))
        p.start()
        os.close(w)
        time.sleep(rng.uniform(0.0, 0.25))
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        acked = _read_acks(r)
        os.close(r)
        committed.extend(acked)
        tmp_left += sum(1 for x in tmp_path.iterdir() if ".tmp-" in x.name)
        # The file always parses (no recovery needed) and holds every acknowledged commit.
        data = Ledger(tmp_path, "n1")._load(recover=False)
        steps = {raw["step"] for raw in data.decode_all() if raw["user"] == "alice"}
        assert set(committed) <= steps
        assert len([raw for raw in data.decode_all() if raw["user"] == "bulk"]) == 3000
        # The writer may have committed one more step than it acknowledged.
        next_step = max(steps | {-1}) + 1
    assert len(committed) > 0
    assert _aside(led) == []
    # Leftover temp files (kills mid-write) are cleaned by the next writer.
    commit(led, 0, user="carol")
    assert [x.name for x in tmp_path.iterdir() if ".tmp-" in x.name] == []


def _crash_at(directory: str, point: str) -> None:
    led = Ledger(Path(directory), "n1")
    real_fsync, real_rename, real_write_all = os.fsync, os.rename, fsio.write_all

    def die(*a, **k):
        os._exit(17)

    if point == "mid_write":

        def half(fd, blob):
            real_write_all(fd, blob[: len(blob) // 2])
            os._exit(17)

        fsio.write_all = half
    elif point == "before_fsync":
        fsio.os.fsync = die
    elif point == "before_rename":
        fsio.os.rename = die
    elif point == "after_rename":

        def rename_then_die(src, dst, *a, **k):
            real_rename(src, dst, *a, **k)
            os._exit(17)

        fsio.os.rename = rename_then_die
    del real_fsync
    led.record_local_commit("alice", "run", 2, nbytes=2, seq=2, job="1", selected_for_flush=True)
    os._exit(0)


@pytest.mark.parametrize("point", ["mid_write", "before_fsync", "before_rename", "after_rename"])
def test_crash_at_each_step_leaves_old_or_new(tmp_path, point):
    led = Ledger(tmp_path, "n1")
    commit(led, 1, key="run")
    p = FORK.Process(target=_crash_at, args=(str(tmp_path), point))
    p.start()
    p.join(30)
    assert p.exitcode == 17
    data = Ledger(tmp_path, "n1")._load(recover=False)  # parses: no torn file
    steps = sorted(raw["step"] for raw in data.decode_all())
    assert steps == ([1, 2] if point == "after_rename" else [1])
    commit(led, 3, key="run")
    assert [r.step for r in led.records()] == sorted(set(steps) | {3})
    assert [x.name for x in tmp_path.iterdir() if ".tmp-" in x.name] == []


# -- node status --------------------------------------------------------------------------


def _busy_ledger(led, clock):
    commit(led, 1, nbytes=100, job="11")
    commit(led, 2, nbytes=200, job="11")
    led.mark("alice", "run1", 2, "pfs", State.FLUSHING)
    commit(led, 3, nbytes=300, job="11")
    led.mark("alice", "run1", 3, "pfs", State.FAILED, reason="EIO", code="pfs_io")
    commit(led, 4, nbytes=400, job="22", key="run2")
    led.mark("alice", "run2", 4, "pfs", State.VERIFIED)


def test_status_summary(led, clock):
    _busy_ledger(led, clock)
    st = node_status(led, {"stager": "up"})
    assert st["node"] == "node-01" and st["time"] == clock.t
    assert st["pending"] == {"count": 3, "bytes": 600}
    assert [(f["step"], f["tier"]) for f in st["in_flight"]] == [(2, "pfs")]
    assert st["in_flight"][0]["since"] == clock.t
    assert [(f["step"], f["state"], f["reason"]) for f in st["failed"]] == [(3, "FAILED", "EIO")]
    assert st["failures"] == {"pfs_io": 1}
    assert st["jobs"]["11"]["pending"] == 3 and st["jobs"]["11"]["pending_bytes"] == 600
    assert st["jobs"]["11"]["in_flight"] == 1 and st["jobs"]["11"]["failed"] == 1
    assert st["jobs"]["22"]["latest_warm_verified_step"] == 4
    assert st["jobs"]["22"]["latest_pfs_verified_step"] == 4  # the old name, one release
    assert st["jobs"]["22"]["keys"] == ["alice/run2"]
    assert st["extra"] == {"stager": "up"}


def test_publish_and_read_node_statuses(tmp_path, clock, caplog):
    pfs = tmp_path / "pfs"
    pfs.mkdir()
    a = Ledger(tmp_path / "a", "node-b", clock=clock)
    b = Ledger(tmp_path / "b", "node-a", clock=clock)
    _busy_ledger(a, clock)
    path = publish_status(a, pfs, extra={"version": "0.1"})
    assert path == status_path(pfs, "node-b") == pfs / ".slurm_ckpt" / "nodes" / "node-b.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o755
    doc = json.loads(path.read_text())
    assert doc["node"] == "node-b" and doc["pending"]["count"] == 3
    assert doc["extra"] == {"version": "0.1"}
    publish_status(b, pfs)
    publish_status(a, pfs)  # replaces atomically, no temp files left
    assert sorted(os.listdir(path.parent)) == ["node-a.json", "node-b.json"]
    # Junk the readers must survive.
    nodes = path.parent
    (nodes / "broken.json").write_text("{not json")
    (nodes / "list.json").write_text("[1, 2]")
    (nodes / "notes.txt").write_text("hi")
    (nodes / "dir.json").mkdir()
    (tmp_path / "elsewhere.json").write_text(json.dumps({"node": "evil"}))
    (nodes / "link.json").symlink_to(tmp_path / "elsewhere.json")
    with caplog.at_level(logging.WARNING):
        docs = read_node_statuses(pfs)
    assert [d["node"] for d in docs] == ["node-a", "node-b"]
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "broken.json" in text and "list.json" in text and "link.json" in text
    assert read_node_statuses(tmp_path / "nowhere") == []


def test_publish_does_not_follow_a_planted_symlink(tmp_path, led):
    pfs = tmp_path / "pfs"
    nodes = pfs / ".slurm_ckpt" / "nodes"
    nodes.mkdir(parents=True)
    target = tmp_path / "victim.txt"
    target.write_text("precious")
    final = nodes / "node-01.json"
    final.symlink_to(target)
    commit(led, 1)
    assert publish_status(led, pfs) == final
    assert target.read_text() == "precious"
    assert not final.is_symlink() and final.is_file()
    assert json.loads(final.read_text())["node"] == "node-01"


def test_publish_refuses_symlinked_directories(tmp_path, led):
    pfs = tmp_path / "pfs"
    pfs.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (pfs / ".slurm_ckpt").symlink_to(elsewhere)
    commit(led, 1)
    final = publish_status(led, pfs)  # the symlink is moved aside, never followed
    assert list(elsewhere.iterdir()) == []
    st = os.lstat(pfs / ".slurm_ckpt")
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
    assert any(n.startswith(".slurm_ckpt.untrusted-") for n in os.listdir(pfs))
    assert [d["node"] for d in read_node_statuses(pfs)] == [final.stem]


def test_publish_needs_an_existing_pfs_root(tmp_path, led):
    with pytest.raises(TierError):
        publish_status(led, tmp_path / "not-mounted")
    assert not (tmp_path / "not-mounted").exists()


def test_publish_removes_only_old_temp_files(tmp_path, led, clock):
    pfs = tmp_path / "pfs"
    pfs.mkdir()
    publish_status(led, pfs)
    nodes = pfs / ".slurm_ckpt" / "nodes"
    old = nodes / ".node-01.json.tmp-1-aaaa"
    new = nodes / ".node-01.json.tmp-2-bbbb"
    other = nodes / ".node-02.json.tmp-3-cccc"
    for p in (old, new, other):
        p.write_text("x")
    os.utime(old, (clock.t - 7200, clock.t - 7200))
    os.utime(new, (clock.t - 10, clock.t - 10))
    os.utime(other, (clock.t - 7200, clock.t - 7200))
    publish_status(led, pfs)
    assert not old.exists() and new.exists() and other.exists()


def test_reconcile_keeps_the_job_from_the_manifest(led):
    led.reconcile([("u", "k", 1, 10), ("u", "k", 2, 10)], [], jobs={("u", "k", 1): "191"})
    assert led.get("u", "k", 1).job == "191"
    assert led.get("u", "k", 2).job is None
    led.reconcile([("u", "k", 2, 10)], [], jobs={("u", "k", 2): "192"}, prune=False)
    assert led.get("u", "k", 2).job == "192"
    assert led.get("u", "k", 1).job == "191"
