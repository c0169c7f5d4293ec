"""The catalog walk behind ``ckpt-slurm status`` walks in threads only when it waits.

Threads overlap the metadata round trips of a parallel filesystem; on a tree whose
system calls never block they only contend for the GIL and cost CPU time. The walk
probes its first users in one thread and decides from the probe's voluntary context
switches. These tests run the real walk on a real directory tree both ways (same heads)
and check that the signal it decides on does count a real blocking wait.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from slurm_ckpt.ops import catalog
from slurm_ckpt.ops.catalog import PROBE_USERS, scan_catalog, threads_pay
from slurm_ckpt.tiers.posix import PosixTier

USERS = PROBE_USERS + 5


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """More users than the probe walks, two series each, three steps per series."""
    root = tmp_path_factory.mktemp("pfs")
    tier = PosixTier("pfs", str(root))
    for u in range(USERS):
        for k in ("a", "b.rank00001"):
            for step in (1, 2, 3):
                with tier.writer(f"user{u:02d}", k, step, job=str(u), node="n1") as w:
                    w.write_buffers({"model.bin": bytes([u, step]) * 64})
                    w.commit()
    return root


def test_threads_pay_only_when_the_probe_blocked() -> None:
    assert not threads_pay(0, PROBE_USERS)  # a cached local tree: nothing blocks
    assert not threads_pay(PROBE_USERS - 1, PROBE_USERS)
    assert threads_pay(PROBE_USERS, PROBE_USERS)  # a round trip per user at least
    assert not threads_pay(5, 0)


@pytest.mark.parametrize("threads", [False, True])
def test_walk_in_threads_or_not_finds_the_same_heads(
    tree: Path, threads: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    decided = []

    def decide(blocked: int, users: int) -> bool:
        decided.append(users)
        return threads

    one = scan_catalog(str(tree), workers=1)  # never asks: one thread throughout
    monkeypatch.setattr(catalog, "threads_pay", decide)
    started = threading.active_count()
    seen = []
    real = catalog._scan_user

    def spy(*args: object, **kw: object) -> object:
        seen.append(threading.get_ident())
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(catalog, "_scan_user", spy)
    got = scan_catalog(str(tree), workers=4)
    assert decided == [PROBE_USERS]
    assert got == one
    assert len(got) == USERS * 2
    assert {h.checkpoints for h in got.values()} == {3}
    assert {h.step for h in got.values()} == {3}
    # The probe ran here; the rest in other threads exactly when threads were chosen.
    here = threading.get_ident()
    assert seen[:PROBE_USERS] == [here] * PROBE_USERS
    assert any(t != here for t in seen[PROBE_USERS:]) is threads
    assert threading.active_count() == started  # the pool is gone


def test_the_probe_signal_counts_a_blocking_wait() -> None:
    """A system call that blocks (here a sleep, which always does) is a voluntary context
    switch of this thread; the walk relies on the kernel counting those."""
    if not hasattr(__import__("resource"), "RUSAGE_THREAD"):
        pytest.skip("no per-thread rusage on this platform: the walk stays in one thread")
    before = catalog._thread_waits()
    time.sleep(0.01)
    assert catalog._thread_waits() - before >= 1
    # Busy work that never blocks is not counted as waiting (preemption is counted
    # apart), so a loaded machine does not look like a slow filesystem.
    before = catalog._thread_waits()
    end = time.thread_time() + 0.02
    while time.thread_time() < end:
        pass
    assert catalog._thread_waits() - before <= 1
