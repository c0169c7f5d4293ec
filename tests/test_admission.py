"""Admission control: the decision code on a simulated clock, and the same code against
the real POSIX store with several processes standing for nodes (real ext4 "PFS").

No test asserts a wall-clock speed: lease recovery is checked against the store's own
lease times (an injected clock steps across the dead holder's lease), and the cap is
checked on the intervals the processes record while they hold their slots.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import signal
import stat
import time
from pathlib import Path
from typing import Any, List, Tuple

import pytest
from conftest import in_child_as

from slurm_ckpt.admission.decisions import Admission
from slurm_ckpt.admission.gate import renewer
from slurm_ckpt.admission.policy import AdmissionError, AdmissionPolicy, Priority
from slurm_ckpt.admission.state import MemoryStore, SimClock
from slurm_ckpt.admission.store import PosixSlotStore, slots_dir
from slurm_ckpt.core.config import Config
from slurm_ckpt.errors import ConfigError


def _sim(policy: AdmissionPolicy, node: str = "n1", store: MemoryStore = None, clock=None):
    clock = clock or SimClock(1000.0)
    store = store or MemoryStore()
    adm = Admission(
        policy, store, node, clock=clock.now, sleep=clock.sleep, rng=random.Random(node)
    )
    return adm, store, clock


# --------------------------------------------------------------------------- decisions


def test_cap_admits_at_most_max_nodes_and_the_next_on_release() -> None:
    policy = AdmissionPolicy(max_nodes=2, lease=30, poll=1)
    store, clock = MemoryStore(), SimClock(0.0)
    nodes = [_sim(policy, f"n{i}", store, clock)[0] for i in range(5)]
    tickets = []
    for a in nodes:
        tickets.append(a.request(budget=100))
        clock.sleep(0.1)
    states = [a.poll(t).state for a, t in zip(nodes, tickets)]
    assert states == ["admitted", "admitted", "waiting", "waiting", "waiting"]
    assert len(store.state.holders) == 2 and store.state.queue_depth() == 3
    nodes[0].release(tickets[0])
    states = [a.poll(t).state for a, t in zip(nodes[2:], tickets[2:])]
    assert states == ["admitted", "waiting", "waiting"]  # first come, first served
    assert len(store.state.holders) == 2


def test_maintenance_flush_jumps_the_queue() -> None:
    policy = AdmissionPolicy(max_nodes=1, lease=30, poll=1)
    store, clock = MemoryStore(), SimClock(0.0)
    a = [_sim(policy, f"n{i}", store, clock)[0] for i in range(4)]
    holder = a[0].request(budget=100)
    assert a[0].poll(holder).admitted
    r1 = a[1].request(Priority.ROUTINE, budget=100)
    clock.sleep(1)
    pre = a[2].request(Priority.PREEMPTED, budget=100)
    clock.sleep(1)
    maint = a[3].request(Priority.MAINTENANCE, budget=100)
    assert [a[i].poll(t).position for i, t in ((1, r1), (2, pre), (3, maint))] == [2, 1, 0]
    a[0].release(holder)
    assert not a[1].poll(r1).admitted and not a[2].poll(pre).admitted
    assert a[3].poll(maint).admitted  # last to come, first to go
    a[3].release(maint)
    assert not a[1].poll(r1).admitted
    assert a[2].poll(pre).admitted  # then the preempted job, then routine


def test_budget_expiry_returns_not_admitted_and_leaves_the_queue() -> None:
    policy = AdmissionPolicy(max_nodes=1, lease=60, poll=1)
    adm, store, clock = _sim(policy)
    other = _sim(policy, "n2", store, clock)[0]
    held = other.request(budget=1000)
    assert other.poll(held).admitted
    d = adm.acquire(budget=5.0)  # the blocking form, on the simulated clock
    assert d.expired and not d.admitted and d.state == "not_admitted"
    assert 5.0 <= d.waited_s <= 5.0 + policy.poll * 1.5
    assert store.state.queue_depth() == 0  # it left the queue


def test_a_dead_holders_slot_comes_back_after_its_lease() -> None:
    policy = AdmissionPolicy(max_nodes=1, lease=10, poll=1)
    adm, store, clock = _sim(policy)
    dead = _sim(policy, "n2", store, clock)[0]
    t = dead.request(budget=100)
    assert dead.poll(t).admitted
    clock.sleep(5)
    assert dead.renew(t)  # renewed at 5: lapses at 15
    mine = adm.request(budget=100)
    clock.advance_to(1000 + 14.9)
    assert not adm.poll(mine).admitted
    clock.advance_to(1000 + 15.0)
    assert adm.poll(mine).admitted
    assert not dead.renew(t)  # the late renewal is refused: it no longer holds a slot


def test_bandwidth_cap_counts_rates_and_nobody_overtakes_the_head() -> None:
    policy = AdmissionPolicy(max_bandwidth=10e9, lease=30, poll=1)
    store, clock = MemoryStore(), SimClock(0.0)
    a = [_sim(policy, f"n{i}", store, clock)[0] for i in range(4)]
    t0 = a[0].request(rate=6e9, budget=100)
    clock.sleep(0.1)
    t1 = a[1].request(rate=6e9, budget=100)
    clock.sleep(0.1)
    t2 = a[2].request(rate=1e9, budget=100)
    assert a[0].poll(t0).admitted
    assert not a[1].poll(t1).admitted  # 12 GB/s would pass the cap
    assert not a[2].poll(t2).admitted  # would fit, but it does not overtake t1
    a[0].release(t0)
    assert a[1].poll(t1).admitted and a[2].poll(t2).admitted  # 7 GB/s
    t3 = a[3].request(rate=None, budget=100)  # unknown rate: the whole cap (no node cap)
    assert t3.rate == 10e9 and not a[3].poll(t3).admitted


def test_jitter_spreads_starts_over_the_window() -> None:
    policy = AdmissionPolicy(max_nodes=1000, jitter=60.0)
    adm, _, _ = _sim(policy)
    delays = [adm.start_delay() for _ in range(5000)]
    assert min(delays) >= 0.0 and max(delays) < 60.0
    bins = [0] * 10
    for d in delays:
        bins[int(d // 6.0)] += 1
    assert all(400 <= b <= 600 for b in bins), bins  # each tenth of the window: ~500
    # And the blocking form really waits it out before asking.
    store, clock = MemoryStore(), SimClock(0.0)
    starts = []
    for i in range(200):
        a = Admission(
            policy, store, f"n{i}", clock=clock.now, sleep=clock.sleep, rng=random.Random(i)
        )
        t_before = clock.now()
        d = a.acquire(budget=1000)
        starts.append(d.ticket.granted_at - t_before)
        a.release(d.ticket)
    assert max(starts) > 50 and min(starts) < 10 and len({round(s) for s in starts}) > 40


def test_work_per_decision_does_not_grow_with_the_queue() -> None:
    """A waiter deep in a long queue costs a read, not a walk of the queue."""
    for n in (100, 10_000):
        policy = AdmissionPolicy(max_nodes=10, lease=30, poll=1)
        store, clock = MemoryStore(), SimClock(0.0)
        a = Admission(policy, store, "n1", clock=clock.now, sleep=clock.sleep)
        tickets = []
        for _ in range(n):
            tickets.append(a.request(budget=1e6))
            clock.sleep(0.001)
        for t in tickets[:10]:
            assert a.poll(t).admitted
        before = store.state.examined
        for t in tickets[-50:]:
            assert not a.poll(t).admitted
        assert store.state.examined - before == 0  # answered from the peek, no transaction


def test_policy_and_config_validation(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        AdmissionPolicy(max_nodes=0)
    with pytest.raises(ValueError):
        AdmissionPolicy(jitter=-1)
    cfg = Config.standalone(
        tmp_path / "l",
        tmp_path / "p",
        admission={"max_nodes": 8, "max_bandwidth": "700GB/s", "jitter": "30s", "lease": "2min"},
    )
    p = AdmissionPolicy.from_config(cfg)
    assert (p.max_nodes, p.max_bandwidth, p.jitter, p.lease) == (8, 700e9, 30.0, 120.0)
    assert (
        cfg.admission.enabled
        and not Config.standalone(tmp_path / "l", tmp_path / "p").admission.enabled
    )
    assert slots_dir(cfg) == tmp_path / "p" / ".slurm_ckpt" / "slots"
    with pytest.raises(ConfigError, match="admission.max_nodes: must be at least 1"):
        Config.standalone(tmp_path / "l", tmp_path / "p", admission={"max_nodes": 0})
    with pytest.raises(ConfigError, match="admission.lease: must be longer than admission.poll"):
        Config.standalone(tmp_path / "l", tmp_path / "p", admission={"lease": 1, "poll": 2})
    with pytest.raises(ConfigError, match="did you mean 'admission.max_nodes'"):
        Config.standalone(tmp_path / "l", tmp_path / "p", admission={"max_node": 2})


# --------------------------------------------------------------------------- POSIX store


def _node_proc(store_dir: str, node: str, cap: int, rounds: int, out: str, hold: float) -> None:
    policy = AdmissionPolicy(max_nodes=cap, jitter=0.05, lease=5.0, poll=0.02)
    adm = Admission(policy, PosixSlotStore(store_dir), node, rng=random.Random(node))
    for _ in range(rounds):
        d = adm.acquire(budget=120)
        assert d.admitted, d
        start = time.time()
        with renewer(adm, d.ticket):  # the product's renewer, a forked child
            time.sleep(hold)  # the "flush"
        end = time.time()
        adm.release(d.ticket)
        with open(out, "a") as fh:
            fh.write(json.dumps([node, start, end, d.waited_s]) + "\n")


def _max_overlap(intervals: List[Tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    cur = best = 0
    for _, delta in events:
        cur += delta
        best = max(best, cur)
    return best


def test_several_processes_flush_at_once_and_the_cap_holds(pfs: Path, tmp_path: Path) -> None:
    store_dir = pfs / ".slurm_ckpt" / "slots"
    out = tmp_path / "holds.jsonl"
    ctx = mp.get_context("fork")
    procs = [
        ctx.Process(target=_node_proc, args=(str(store_dir), f"n{i}", 2, 3, str(out), 0.05))
        for i in range(6)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 18
    assert _max_overlap([(s, e) for _, s, e, _ in rows]) == 2  # the cap, and it was reached
    st = PosixSlotStore(store_dir).peek()
    assert not st.holders and not st.waiters  # everyone gave back and left
    d = os.stat(store_dir)
    assert d.st_uid == 0 and stat.S_IMODE(d.st_mode) == 0o755
    for name in ("lock", "state.json"):
        s = os.stat(store_dir / name)
        assert stat.S_IMODE(s.st_mode) == 0o600 and s.st_uid == 0


def _hold_forever(store_dir: str, ready: Any, inside_lock: bool) -> None:
    policy = AdmissionPolicy(max_nodes=1, lease=2.0, poll=0.05)
    store = PosixSlotStore(store_dir)
    adm = Admission(policy, store, "dead")
    if inside_lock:
        # Die in the middle of a transaction, holding the store's lock.
        store.transact(lambda st: (ready.set(), time.sleep(3600)))
    d = adm.acquire(budget=30, jitter=False)
    assert d.admitted
    ready.set()  # it holds the slot; whatever it last wrote is what the lease runs from
    time.sleep(3600)


def test_a_sigkilled_holders_slot_is_recovered_within_its_lease(pfs: Path) -> None:
    store_dir = str(pfs / ".slurm_ckpt" / "slots")
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    holder = ctx.Process(target=_hold_forever, args=(store_dir, ready, False))
    holder.start()
    assert ready.wait(60)
    os.kill(holder.pid, signal.SIGKILL)
    holder.join()
    store = PosixSlotStore(store_dir)
    (dead,) = store.peek().holders.values()
    assert dead.node == "dead"
    lease_end = dead.until
    # Step a clock across the lease: not a moment before it, at once after it.
    now = [lease_end - 0.05]
    policy = AdmissionPolicy(max_nodes=1, lease=2.0, poll=0.05)
    adm = Admission(
        policy, PosixSlotStore(store_dir, clock=lambda: now[0]), "n1", clock=lambda: now[0]
    )
    t = adm.request(budget=60)
    assert not adm.poll(t).admitted
    now[0] = lease_end + 0.001
    assert adm.poll(t).admitted
    adm.release(t)
    # And on the real clock, a dead process inside a transaction does not keep the lock.
    ready2 = ctx.Event()
    locker = ctx.Process(target=_hold_forever, args=(store_dir, ready2, True))
    locker.start()
    assert ready2.wait(60)
    os.kill(locker.pid, signal.SIGKILL)
    locker.join()
    real = Admission(policy, PosixSlotStore(store_dir), "n1")
    d = real.acquire(budget=30, jitter=False)
    assert d.admitted
    real.release(d.ticket)


def test_maintenance_jumps_the_queue_in_the_posix_store(pfs: Path) -> None:
    store_dir = pfs / "slots-prio"
    os.mkdir(store_dir, 0o755)
    policy = AdmissionPolicy(max_nodes=1, lease=30, poll=0.05)
    a = [Admission(policy, PosixSlotStore(store_dir), f"n{i}") for i in range(3)]
    held = a[0].request(budget=60)
    assert a[0].poll(held).admitted
    routine = a[1].request(Priority.ROUTINE, budget=60)
    maint = a[2].request(Priority.MAINTENANCE, budget=60)
    a[0].release(held)
    assert not a[1].poll(routine).admitted
    assert a[2].poll(maint).admitted


# --------------------------------------------------------------------------- attacks


def test_users_cannot_lock_or_write_roots_slot_files(pfs: Path) -> None:
    store_dir = pfs / ".slurm_ckpt" / "slots"
    adm = Admission(AdmissionPolicy(max_nodes=1), PosixSlotStore(store_dir), "n1")
    adm.release(adm.request(budget=1))  # creates lock and state.json
    os.chmod(pfs, 0o1777)

    def attack() -> List[str]:
        import fcntl

        out = []
        for name in ("lock", "state.json"):
            try:
                fd = os.open(store_dir / name, os.O_RDONLY)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                out.append(f"locked {name}")
            except PermissionError:
                out.append(f"refused {name}")
        try:
            (store_dir / "evil").write_text("x")
            out.append("planted")
        except PermissionError:
            out.append("no plant")
        return out

    assert in_child_as(65534, 65534, attack) == ["refused lock", "refused state.json", "no plant"]


@pytest.mark.parametrize("plant", ["symlink", "user_owned", "world_writable", "fifo_state"])
def test_a_planted_or_unsafe_store_is_refused_without_hanging(pfs: Path, plant: str) -> None:
    meta = pfs / ".slurm_ckpt"
    if plant == "symlink":
        elsewhere = pfs / "elsewhere"
        elsewhere.mkdir()
        os.symlink(elsewhere, meta)
        match = "symbolic link"
    elif plant == "user_owned":
        meta.mkdir()
        os.chown(meta, 65534, 65534)
        match = "owned by uid 65534"
    elif plant == "world_writable":
        (meta / "slots").mkdir(parents=True)
        os.chmod(meta / "slots", 0o777)
        match = "writable by group or others"
    else:
        (meta / "slots").mkdir(parents=True)
        os.mkfifo(meta / "slots" / "state.json", 0o600)
        match = "not a regular file"
    with pytest.raises(AdmissionError, match=match):
        store = PosixSlotStore(meta / "slots")
        store.transact(lambda st: None, deadline=time.time() + 5)
    if plant == "symlink":
        assert os.listdir(pfs / "elsewhere") == []  # nothing created through the link


# --------------------------------------------------------------------------- metrics


def test_queue_depth_and_wait_are_prometheus_metrics(tmp_path: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from slurm_ckpt.admission.decisions import decision_event
    from slurm_ckpt.ledger import Ledger
    from slurm_ckpt.ledger.events import EventLog
    from slurm_ckpt.ledger.metrics import refresh_textfile

    (tmp_path / "l").mkdir()
    (tmp_path / "p").mkdir()
    cfg = Config.standalone(
        tmp_path / "l", tmp_path / "p", metrics={"textfile_dir": str(tmp_path / "prom")}
    )
    policy = AdmissionPolicy(max_nodes=1, lease=30, poll=1)
    adm, store, clock = _sim(policy)
    other = _sim(policy, "n2", store, clock)[0]
    held = other.request(budget=100)
    other.poll(held)
    for i in range(3):
        _sim(policy, f"w{i}", store, clock)[0].request(budget=100)
    ts = [100.0]
    log = EventLog(tmp_path / "l" / ".slurm_ckpt" / "events.jsonl", "n1", clock=lambda: ts[0])
    refused = adm.acquire(budget=4.0)
    etype, fields = decision_event(refused, Priority.ROUTINE)
    assert etype == "admission_refused" and fields["queue_depth"] == 3
    log.emit(etype, **fields)
    other.release(held)
    ts[0] = 200.0
    for waiter in list(store.state.waiters):  # the three earlier waiters give up
        store.state.leave(waiter)
    granted = adm.acquire(budget=10.0)
    assert granted.admitted
    etype, fields = decision_event(granted, Priority.MAINTENANCE)
    log.emit(etype, **fields)
    led = Ledger(cfg.ledger.dir, "n1")
    text = refresh_textfile(led, cfg).read_text()  # type: ignore[union-attr]
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    n = (("node", "n1"),)
    assert got[("slurm_ckpt_admission_queue_depth", n)] == 0  # as seen at the newest decision
    assert got[("slurm_ckpt_admission_slots_in_use", n)] == 1
    assert got[("slurm_ckpt_admission_wait_seconds", n)] == pytest.approx(granted.waited_s)
    assert got[("slurm_ckpt_admission_wait_seconds_sum_total", n)] == pytest.approx(
        refused.waited_s + granted.waited_s
    )
    assert (
        got[("slurm_ckpt_admission_requests_total", (("node", "n1"), ("outcome", "admitted")))] == 1
    )
    assert (
        got[("slurm_ckpt_admission_requests_total", (("node", "n1"), ("outcome", "not_admitted")))]
        == 1
    )
