"""The RAM tier (issue 30, first block): snapshots in host memory, hashed like any
checkpoint, replicated into the partner's memory over the authenticated partner link.

Real processes (tests/ram_worker.py: one rank each, its own "node" directory, gloo over
127.0.0.1, the RAM copies over real TCP), driven step by step from here:

1. each rank RAM-replicates to the other every step; rank 1 is SIGKILLed after step 5
   (its copy acknowledged by the holder); a fresh process on a spare node takes its
   place, the survivor re-forms the gloo group with it, and both restore step 5 -
   nothing but the step in flight lost - the survivor from its own memory (``ram``),
   the newcomer from the survivor's RAM copy of it (``partner-ram``), bitwise;
2. a RAM copy damaged in the holder's memory is refused by verification, and the
   newcomer falls back to the NVMe partner copy (``partner``, step 3), the survivor
   agreeing on step 3 from its local tier;
3. a partner that stops answering (SIGSTOP) makes replication report that it cannot
   keep up (counter, event, log line) instead of skipping silently; it catches up once
   the partner runs again;

and in one process: the memory bound (``keep`` listed, ``keep + 1`` buffer sets, reused),
the interval chosen from the budget, bad options.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from ram_worker import make_state
from test_partner import node as partner_node
from test_partner_wire import MARKER, Relay, marked_state

from slurm_ckpt.core.hashing import chunk_digest
from slurm_ckpt.errors import CkptError
from slurm_ckpt.job.options import RamOptions
from slurm_ckpt.job.partner import MAX_CONNECTIONS
from slurm_ckpt.job.partner_net import Peer
from slurm_ckpt.job.partner_tier import PartnerTier
from slurm_ckpt.job.partner_wire import Channel, Identity, WireError, client_handshake
from slurm_ckpt.job.ram_interval import Interval
from slurm_ckpt.job.ram_replica import RAMPUT
from slurm_ckpt.job.ram_tier import manifest_of

WORKER = str(Path(__file__).with_name("ram_worker.py"))
#: Bound on one answer of a worker (a hang fails the test instead of blocking it).
ANSWER_S = 240.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Rank:
    """One worker process (see tests/ram_worker.py)."""

    def __init__(self, work: Path, rank: int, node: str, every: int = 1, keep: int = 1):
        self.log = work / f"{node}.rank{rank}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
        self.p = subprocess.Popen(
            [sys.executable, WORKER, str(work), str(rank), node, str(every), str(keep)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log.open("w"),
            text=True,
            env=env,
        )
        self.read()

    def send(self, line: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def read(self) -> Dict[str, Any]:
        assert self.p.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.p.stdout, selectors.EVENT_READ)
        try:
            while True:
                if not sel.select(ANSWER_S):
                    raise AssertionError(f"no answer: {self.log.read_text()[-3000:]}")
                line = self.p.stdout.readline()
                if not line:
                    raise AssertionError(f"worker died: {self.log.read_text()[-3000:]}")
                if line.startswith("REPLY "):
                    return dict(json.loads(line[6:]))
        finally:
            sel.close()

    def ask(self, line: str) -> Dict[str, Any]:
        self.send(line)
        return self.read()

    def kill(self) -> None:
        self.p.send_signal(signal.SIGKILL)
        self.p.wait()

    def end(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


def stopped(pid: int) -> None:
    """Until the kernel says ``pid`` is stopped (state T): the test knows the holder can
    answer nothing from here on."""
    for _ in range(100_000):
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        os.sched_yield()
    raise AssertionError(f"process {pid} did not stop")


def together(ranks: List[Rank], line: str) -> List[Dict[str, Any]]:
    """The same command to every rank at once (collectives inside), every answer."""
    for r in ranks:
        r.send(line)
    return [r.read() for r in ranks]


@pytest.fixture
def procs(tmp_path: Path) -> Any:
    made: List[Rank] = []

    def start(rank: int, node: str, **kw: Any) -> Rank:
        made.append(Rank(tmp_path, rank, node, **kw))
        return made[-1]

    yield tmp_path, start
    for r in made:
        r.end()


def assert_restored(work: Path, rank: int, step: int) -> None:
    got = torch.load(work / f"restored.rank{rank}.pt", weights_only=False)
    want = make_state(rank, step)
    assert got["step"] == want["step"] and got["optimizer"]["count"] == step
    for group in ("model", "optimizer"):
        for name, t in want[group].items():
            if isinstance(t, torch.Tensor):
                a = got[group][name]
                assert a.dtype == t.dtype and a.shape == t.shape
                assert bytes(a.numpy().tobytes()) == bytes(t.numpy().tobytes()), name


def lose_rank_1(work: Path, start: Any, saves: str = "") -> List[Rank]:
    """Ranks 0 (na) and 1 (nb) train steps 1-5 replicating every step (NVMe saves at
    ``saves``); rank 1 is SIGKILLed after step 5, whose copy the holder acknowledged."""
    a, b = start(0, "na"), start(1, "nb")
    together([a, b], f"init {free_port()}")
    got = together([a, b], f"train 1 5 {saves}".strip())
    for g in got:
        s = g["stats"]
        assert (g["step"], s["last_replicated_step"], s["replica_failures"]) == (5, 5, 0)
        assert (s["snapshots"], s["replicated"], s["behind"], s["not_taken"]) == (5, 5, 0, 0)
    b.kill()
    return [a, b]


def test_fresh_process_restores_from_the_survivors_ram_copy(procs: Any) -> None:
    work, start = procs
    a, _b = lose_rank_1(work, start)
    held = a.ask("stats")
    assert held["held"]["run.rank00001"]["listed"] == [5]
    c = start(1, "nc")  # a spare: nothing of rank 1 on its disk
    port = free_port()
    got = together([a, c], f"recover {port}")
    assert [(g["step"], g["tier"]) for g in got] == [(5, "ram"), (5, "partner-ram")]
    assert_restored(work, 0, 5)
    assert_restored(work, 1, 5)
    assert not any((work / "nc" / "local").rglob("manifest.json"))  # read from memory


def test_damaged_ram_copy_is_refused_and_the_nvme_partner_copy_restored(procs: Any) -> None:
    work, start = procs
    a, _b = lose_rank_1(work, start, saves="3")
    assert a.ask("damage run.rank00001 5") == {"ok": True}
    c = start(1, "nc")
    got = together([a, c], f"recover {free_port()}")
    assert [(g["step"], g["tier"]) for g in got] == [(3, "local"), (3, "partner")]
    assert_restored(work, 0, 3)
    assert_restored(work, 1, 3)
    log = c.log.read_text()
    assert "RAM copy on na:run.rank00001/step-5" in log and "hash mismatch" in log


def test_a_slow_partner_is_reported_never_skipped_silently(procs: Any) -> None:
    work, start = procs
    a, b = start(0, "na"), start(1, "nb")
    together([a, b], f"init {free_port()}")
    together([a, b], "train 1 1")
    b.p.send_signal(signal.SIGSTOP)  # the holder stops answering: no copy is acknowledged
    stopped(b.p.pid)
    try:
        got = a.ask("solo 2 7")
    finally:
        b.p.send_signal(signal.SIGCONT)
    s = got["stats"]
    # Six snapshots (steps 2-7): at most one on the wire, unanswered, and one waiting;
    # every other one was superseded, and counted.
    assert s["behind"] >= 4 and s["not_taken"] == 0 and s["replica_failures"] == 0
    assert a.ask("idle")["idle"]
    after = a.ask("stats")
    assert "ram_behind" in after["events"]
    assert after["stats"]["last_replicated_step"] == 7  # caught up with the newest
    assert after["stats"]["behind"] == s["behind"]
    assert "RAM tier cannot keep up" in a.log.read_text()
    assert b.ask("stats")["held"]["run.rank00000"]["listed"] == [7]


def test_memory_is_bounded_and_reused(tmp_path: Path) -> None:
    """``keep`` snapshots listed per series, for itself and for the partner it holds
    for; ``keep + 1`` buffer sets each, allocated once and reused."""
    a = partner_node(tmp_path, "na", 0, ram=RamOptions(every=1, keep=2))
    b = partner_node(tmp_path, "nb", 1, ram=RamOptions(every=1, keep=2))
    try:
        allocations = []
        for step in range(1, 8):
            for c in (a, b):
                assert c.ram_save(make_state(c.rank, step), step=step)
            for c in (a, b):
                assert c.ram is not None and c.ram.wait_idle(60)
            allocations.append(a.ram.stats.allocations)  # type: ignore[union-attr]
        for c, other in ((a, "run.rank00001"), (b, "run.rank00000")):
            ram = c.ram
            assert ram is not None
            assert [s.step for s in ram.own.listed(c.shard_key)] == [6, 7]
            assert [s.step for s in ram.held.listed(other)] == [6, 7]
            assert ram.own.slots(c.shard_key) == ram.held.slots(other) == 3
            st = ram.stats
            assert (st.held_own, st.held_partner, st.behind, st.replicated) == (2, 2, 0, 7)
            assert c.stats.ram_snapshots == 7 and c.stats.ram_replicated == 7
        # 3 own + 3 held buffer sets, then only reuse
        assert allocations[2:] == [6] * 5
    finally:
        a.close()
        b.close()


def test_interval_follows_the_budget() -> None:
    """every="auto": the smallest N whose cost stays within the budget of N steps and
    whose copy ends before the next is due; a fixed N stays N."""
    iv = Interval("auto", 0.02)
    now = 0.0
    assert iv.tick(now)  # the first call measures
    iv.taken()
    for _ in range(10):
        now += 0.1
        iv.tick(now)
    assert iv.measured(cost_s=0.01, copy_s=0.05) == 5  # 10 ms / (2 % of 100 ms)
    assert iv.measured(cost_s=0.01, copy_s=2.0) >= 6  # a slow copy: wait for it
    fixed = Interval(3, 0.02)
    fixed.tick(0.0)
    fixed.taken()
    assert [fixed.tick(t) for t in (1.0, 2.0, 3.0)] == [False, False, True]
    assert fixed.measured(cost_s=10.0, copy_s=10.0) == 3


@pytest.mark.parametrize(
    "kw",
    [{"every": 0}, {"every": "often"}, {"budget": 0}, {"budget": 2}, {"keep": 0}, {"keep": 1.5}],
)
def test_bad_ram_options_are_one_line_errors(tmp_path: Path, kw: Dict[str, Any]) -> None:
    with pytest.raises(CkptError, match="^ram: "):
        partner_node(tmp_path, "na", 0, ram=RamOptions(**kw))


def test_ram_save_needs_the_ram_tier(tmp_path: Path) -> None:
    c = partner_node(tmp_path, "na", 0, partner=False)
    try:
        with pytest.raises(CkptError, match="RAM tier is off"):
            c.ram_save({"x": torch.zeros(3)}, step=1)
    finally:
        c.close()


def put_session(holder: Any, ident: Identity) -> Channel:
    """An authenticated replication session with ``holder`` (as the peer rank of
    ``ident`` opens it); every byte after the handshake goes sealed into records."""
    assert holder.partner is not None
    s = socket.create_connection(("127.0.0.1", holder.partner.port), timeout=30)
    try:
        ch = client_handshake(s, ident, holder.partner.rank)
        ch.send_frame(RAMPUT + b'{"key": "run.rank00000"}')
    except BaseException:
        s.close()
        raise
    return ch


def snapshot_of(step: int, payload: bytes) -> Any:
    files = {"rank-00000/index.json": memoryview(b"{}"), "rank-00000/data-0000.bin": payload}
    meta = {"rank": 0, "world_size": 2, "base_key": "run", "state_format": "slurm_ckpt.state/1"}
    return manifest_of(
        {k: memoryview(v) for k, v in files.items()},
        user="root",
        key="run.rank00000",
        step=step,
        tokens=None,
        job=None,
        node="na",
        meta=meta,
        chunk_size=2**16,
    )


def test_the_holder_verifies_every_chunk_on_arrival(tmp_path: Path) -> None:
    """A copy whose bytes do not match its manifest is never listed on the holder (the
    session ends with a failure); a sound one is; a stranger is refused at the
    handshake; a series that is no rank of this job is refused."""
    a = partner_node(tmp_path, "na", 0, ram=RamOptions(every=1))
    b = partner_node(tmp_path, "nb", 1, ram=RamOptions(every=1))
    try:
        assert a.partner is not None and b.ram is not None
        payload = bytes(range(256)) * 1024  # 4 chunks of 64 KiB
        m = snapshot_of(7, payload)
        bad = bytearray(payload)
        bad[3 * 2**16 + 5] ^= 1  # in the last chunk
        with put_session(b, a.partner.ident) as s:
            s.send_frame(m.to_bytes())
            assert s.recv_exact(1) == b"G"
            s.sendall(bytes(bad))  # files in manifest order: data-0000.bin sorts first
            assert s.recv_exact(1) == b"F"
            assert b"do not match the manifest" in s.recv_frame()
        assert b.ram.held.listed("run.rank00000") == []
        assert b.ram.stats.receive_failures == 1
        with put_session(b, a.partner.ident) as s:
            s.send_frame(m.to_bytes())
            assert s.recv_exact(1) == b"G"
            for e in m.files:
                s.sendall(b"{}" if e.path.endswith("index.json") else payload)
            assert s.recv_exact(1) == b"K"
            other = dataclasses.replace(m, key="other.rank00000").to_bytes()
            s.send_frame(other)
            assert s.recv_exact(1) == b"N"
            assert b"not a rank series" in s.recv_frame()
        assert [x.step for x in b.ram.held.listed("run.rank00000")] == [7]
        stranger = dataclasses.replace(a.partner.ident, secret=b"x" * 32)
        with pytest.raises(WireError):
            put_session(b, stranger)
    finally:
        a.close()
        b.close()


def test_a_recorded_ram_copy_shows_no_plaintext(tmp_path: Path) -> None:
    """The RAM copies, and the restore's ranged reads of them (``src: ram``), travel in
    the partner transport's sealed records like the disk copies: a relay recording every
    byte between the ranks sees neither the payload's marker nor the manifest's series
    key, while the holder keeps the copy, marker and all (verified chunk by chunk on
    arrival), and the owner reads it back bitwise."""
    a = partner_node(tmp_path, "na", 0, ram=RamOptions(every=1))
    b = partner_node(tmp_path, "nb", 1, ram=RamOptions(every=1))
    assert a.partner is not None and b.partner is not None
    relay = Relay(0, b.partner.port)
    try:
        # rank 0's RAM copies now pass the recorder on their way to rank 1
        a.partner._partner = Peer(1, "nb", "127.0.0.1", relay.port)
        assert a.ram_save(marked_state(), step=2)
        assert a.ram is not None and b.ram is not None and a.ram.wait_idle(120)
        sa = a.ram.stats
        assert (sa.replicated, sa.replica_failures) == (1, 0), sa.last_error
        assert relay.connections == 1
        [held] = b.ram.held.listed("run.rank00000")
        assert held.step == 2
        payload = b"".join(bytes(v) for v in held.files.values())
        assert MARKER in payload  # it went through, marker and all
        # and back: rank 0 reads its RAM copy from rank 1 as the restore does (tier
        # partner-ram, ranged reads), through the recorder too
        via_relay = {0: Peer(0, "na", "127.0.0.1", a.partner.port), 1: a.partner._partner}
        a.partner.rdv.peers = lambda *_a, **_k: via_relay  # type: ignore[method-assign]
        tier = PartnerTier(a.partner, ram=True)
        assert [i.step for i in tier.steps("root", "run.rank00000")] == [2]
        with tier.reader("root", "run.rank00000", 2) as r:
            for e in r.manifest.files:
                buf = bytearray(e.size)
                src = r.open(e.path)
                try:
                    assert src.readinto(memoryview(buf), 0) == e.size
                finally:
                    src.close()
                assert bytes(buf) == bytes(held.files[e.path])
        assert relay.connections >= 3  # the copy, the listing, a ranged read
        with relay.lock:
            captured = bytes(relay.captured)
        assert len(captured) > len(MARKER) * 4096
        assert MARKER not in captured
        assert MARKER[:8] not in captured
        assert b"run.rank00000" not in captured  # the manifest is sealed too
    finally:
        relay.close()
        a.close()
        b.close()


#: A sound copy's payload in the hostile sessions below (2 chunks of 64 KiB).
SOUND = bytes(range(256)) * 512


@st.composite
def hostile_ram_session(draw: st.DrawFn) -> List[Any]:
    """What an authenticated peer (a rank of the job: it has the secret) might send
    after ``RAMPUT``: frames of junk, or manifests (checksums right) as sent or with a
    field made hostile (sizes, chunk size and digests, paths, duplicate paths, step,
    series), each followed by some payload bytes (none, too few, right, or of the right
    length but other bytes), then a hang-up."""
    out: List[Any] = []
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):
            out.append(("frame", draw(st.binary(max_size=256))))
            continue
        m = snapshot_of(draw(st.integers(0, 2**62)), SOUND)
        files = list(m.files)
        i = draw(st.integers(0, len(files) - 1))
        what = draw(st.sampled_from(["none", "size", "chunks", "path", "dup", "chunk_size", "key"]))
        if what == "size":
            size = draw(st.one_of(st.integers(-(2**63), 2**20), st.integers(2**40, 2**63)))
            files[i] = dataclasses.replace(files[i], size=size)
        elif what == "chunks":
            files[i] = dataclasses.replace(files[i], chunks=draw(st.lists(st.text(max_size=40))))
        elif what == "path":
            files[i] = dataclasses.replace(files[i], path=draw(st.text(max_size=40)))
        elif what == "dup":
            files.append(dataclasses.replace(files[i], size=draw(st.integers(0, 2**18))))
        elif what == "chunk_size":
            m = dataclasses.replace(m, chunk_size=draw(st.integers(-(2**31), 2**31)))
        elif what == "key":
            m = dataclasses.replace(m, key=draw(st.sampled_from(["run.rank00001", "x", ""])))
        out.append(("frame", dataclasses.replace(m, files=files).to_bytes()))
        wrong = SOUND[::-1] + b"{}"  # the right length, other bytes
        out.append(("raw", draw(st.sampled_from([b"", SOUND[:4096], SOUND + b"{}", wrong]))))
    return out


def test_hostile_ram_sessions_never_break_the_holder(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever an authenticated peer sends in a RAM copy session, the holder ends that
    session (a refusal, a failure, or a copy verified chunk by chunk), lists nothing it
    did not verify, keeps its memory bounds, and takes the next sound copy."""
    a = partner_node(tmp_path, "na", 0, ram=RamOptions(every=1))
    b = partner_node(tmp_path, "nb", 1, ram=RamOptions(every=1))
    assert a.partner is not None and b.partner is not None and b.ram is not None
    ram = b.ram

    def held_sound() -> None:
        """Every copy listed on the holder matches its manifest, within the bounds."""
        series = ram.held.keys()
        for key in series:
            for slot in ram.held.listed(key):
                m = slot.manifest
                assert m is not None and key == m.key == "run.rank00000"
                for e in m.files:
                    view = slot.files[e.path]
                    assert len(view) == e.size
                    for ci, digest in enumerate(e.chunks):
                        part = view[ci * m.chunk_size : (ci + 1) * m.chunk_size]
                        assert chunk_digest(part) == digest
            assert ram.held.slots(key) <= 2  # keep + 1
        assert len(series) <= 4

    @settings(max_examples=100, deadline=None, database=None)
    @given(hostile_ram_session())
    def case(session: List[Any]) -> None:
        # (the holder may hang up first)
        with contextlib.suppress(WireError, OSError), put_session(b, a.partner.ident) as s:  # type: ignore[union-attr]
            for kind, data in session:
                if kind == "frame":
                    s.send_frame(data)
                elif data:
                    s.sendall(data)
            # hang up only once the holder has read it all (its answers read to its end:
            # a close with unread answers would reset the connection, dropping the rest)
            s.sock.shutdown(socket.SHUT_WR)
            while s.sock.recv(65536):
                pass
        # the session's end is awaited: its slot is free for the next one
        wait_for(lambda: b.partner._conns._value == MAX_CONNECTIONS)  # type: ignore[union-attr]
        held_sound()

    try:
        case()
        assert "unexpected error" not in caplog.text
        assert "partner copy (step None) not received" not in caplog.text  # ended as RAM
        m = snapshot_of(99, SOUND)
        with put_session(b, a.partner.ident) as s:
            s.send_frame(m.to_bytes())
            assert s.recv_exact(1) == b"G"
            for e in m.files:
                s.sendall(b"{}" if e.path.endswith("index.json") else SOUND)
            assert s.recv_exact(1) == b"K"
        assert 99 in [x.step for x in ram.held.listed("run.rank00000")]
        held_sound()
    finally:
        a.close()
        b.close()


def wait_for(done: Any, limit: float = 60.0) -> None:
    """Until ``done()`` (a thread of this process reaching a known point), at most
    ``limit`` seconds (then the test fails)."""
    until = time.monotonic() + limit
    while not done():
        assert time.monotonic() < until, "the holder did not end the session"
        time.sleep(0.01)
