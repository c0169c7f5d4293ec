"""The flush engine (node/flush_engine.py) under admission control: processes standing for nodes
flush through ``Flusher(slots=SlotGate)`` against one POSIX slot store on a real ext4
"PFS"; the cap holds, a flusher never waits past its budget (it hands off instead), and a
holder's lease is kept alive by its renewer while it copies."""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from slurm_ckpt.admission.decisions import Admission
from slurm_ckpt.admission.gate import SlotGate
from slurm_ckpt.admission.policy import AdmissionPolicy, Priority
from slurm_ckpt.admission.store import PosixSlotStore
from slurm_ckpt.node import flush_engine
from slurm_ckpt.node.flush_engine import Flusher, FlushStatus
from slurm_ckpt.tiers.copy import CopyResult


def _gate(
    store_dir: str, node: str, events: List[Tuple[str, Dict[str, Any]]], **policy: Any
) -> SlotGate:
    pol = AdmissionPolicy(**{"lease": 5.0, "poll": 0.02, **policy})
    adm = Admission(pol, PosixSlotStore(store_dir), node)
    return SlotGate(adm, priority=Priority.ROUTINE, emit=lambda t, **f: events.append((t, f)))


def _node(
    store_dir: str, node: str, out: str, copy_s: float, in_flight: Any, two_seen: Any
) -> None:
    events: List[Tuple[str, Dict[str, Any]]] = []
    gate = _gate(store_dir, node, events, max_nodes=2, jitter=0.05)

    def copy(ident: Any, left: Optional[float]) -> CopyResult:
        start = time.time()
        # The first copies wait (bounded) until a second one is in flight, so the cap is
        # provably reached whatever the machine's load staggers: no timing luck.
        with in_flight.get_lock():
            in_flight.value += 1
            if in_flight.value >= 2:
                two_seen.set()
        two_seen.wait(60)
        time.sleep(copy_s)
        with in_flight.get_lock():
            in_flight.value -= 1
        with open(out, "a") as fh:
            fh.write(json.dumps([node, start, time.time()]) + "\n")
        return CopyResult(ident[2], nbytes=1, copied_bytes=1, seconds=copy_s)

    flusher = Flusher(copy, None, slots=gate)
    for step in range(3):
        res = flusher.flush_one(("u", "k", step), deadline=time.monotonic() + 120)
        assert res.status is FlushStatus.FLUSHED and res.seconds == copy_s, res
    assert [t for t, _ in events] == ["admission"] * 3, events


def _max_overlap(intervals: List[Tuple[float, float]]) -> int:
    points = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    cur = best = 0
    for _, d in points:
        cur += d
        best = max(best, cur)
    return best


def test_flushers_of_several_nodes_keep_to_the_cap(pfs: Path, tmp_path: Path) -> None:
    store_dir = str(pfs / ".slurm_ckpt" / "slots")
    out = tmp_path / "copies.jsonl"
    ctx = mp.get_context("fork")
    in_flight, two_seen = ctx.Value("i", 0), ctx.Event()
    procs = [
        ctx.Process(target=_node, args=(store_dir, f"n{i}", str(out), 0.1, in_flight, two_seen))
        for i in range(5)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 15
    assert _max_overlap([(s, e) for _, s, e in rows]) == 2
    st = PosixSlotStore(store_dir).peek()
    assert not st.holders and not st.waiters


def test_a_flusher_never_waits_past_its_budget_it_hands_off(pfs: Path) -> None:
    store_dir = str(pfs / ".slurm_ckpt" / "slots")
    hog = Admission(AdmissionPolicy(max_nodes=1, lease=60), PosixSlotStore(store_dir), "hog")
    held = hog.request(budget=60)
    assert hog.poll(held).admitted
    events: List[Tuple[str, Dict[str, Any]]] = []
    gate = _gate(store_dir, "n1", events, max_nodes=1)
    copied: List[Any] = []
    assert isinstance(gate, flush_engine.SlotGate)  # the engine's protocol

    def copy_now(ident: Any, left: Optional[float]) -> CopyResult:
        copied.append(ident)
        return CopyResult(ident[2], nbytes=1, copied_bytes=1, seconds=0.0)

    flusher = Flusher(copy_now, None, slots=gate)
    res = flusher.flush_one(("u", "k", 1), deadline=time.monotonic() + 2.0, min_s=0.5)
    assert res.status == "handed" and res.error == "no PFS slot in time"  # str-valued
    assert f"{res.status}" == str(res.status) == "handed" and json.dumps(res.status) == '"handed"'
    assert copied == []
    ((etype, fields),) = events
    assert etype == "admission_refused" and fields["holders"] == 1
    assert fields["wait_s"] <= 1.5 + 0.1  # the budget: the deadline less the copy's need
    hog.release(held)
    # With the slot free the same flush goes through (a later, longer budget: the stager).
    res = flusher.flush_one(("u", "k", 1), deadline=time.monotonic() + 30)
    assert res.status == "flushed" and copied == [("u", "k", 1)]


def test_the_renewer_keeps_a_long_copy_holding_its_slot(pfs: Path) -> None:
    store_dir = str(pfs / ".slurm_ckpt" / "slots")
    events: List[Tuple[str, Dict[str, Any]]] = []
    gate = _gate(store_dir, "n1", events, max_nodes=1, lease=0.6)
    seen: List[bool] = []

    def copy(ident: Any, left: Optional[float]) -> CopyResult:
        time.sleep(2.0)  # > 3 leases: without renewals the slot would have lapsed
        st = PosixSlotStore(store_dir).peek()
        seen.append(any(h.until > time.time() for h in st.holders.values()))
        return CopyResult(ident[2], nbytes=0, copied_bytes=0, seconds=2.0)

    assert Flusher(copy, None, slots=gate).flush_one(("u", "k", 1)).status == "flushed"
    assert seen == [True]
    assert not PosixSlotStore(store_dir).peek().holders  # given back at the end
