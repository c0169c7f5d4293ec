"""The partner transport against hostile users of the nodes (issue 28), in one process:
Checkpointers are "nodes" with local tiers of their own (tests/test_partner.py's setup),
the copies travel over real TCP on 127.0.0.1, the hostile side is a real process of
another user (``ckptuser1``) or a relaying proxy that records every byte.

What must hold:

1. a local user holding 64 connections to a rank's partner port, one byte every 8 s,
   does not stop a partner copy (unauthenticated connections wait in a small pool of
   their own with an overall deadline; the newest pushes out the oldest);
2. a rank's process dies, a local user binds its freed port and relays the handshake to
   another live rank of the job: that rank refuses (the hello names the rank it was
   meant for), the copy fails, nothing of it is committed there, nothing is readable;
3. a session recorded on the wire shows no plaintext of the payload (a marker in the
   tensors) nor of the manifest;
4. the gate drops a connection that dribbles its hello past the deadline;
5. a rendezvous directory squatted by another user turns partner copies off with an
   event, and ``status`` and ``doctor`` report it.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

import torch
from conftest import need_root
from test_partner import JOB, KEY, local_tier, rank_key, save_all, states

from slurm_ckpt import Checkpointer
from slurm_ckpt.core.config import Config
from slurm_ckpt.job.partner_gate import Gate
from slurm_ckpt.job.partner_net import Peer
from slurm_ckpt.job.partner_wire import MAGIC, Identity
from slurm_ckpt.ops.security_checks import check_security
from slurm_ckpt.ops.status import collect_status, no_slurm

MARKER = b"PARTNER-PLAINTEXT-MARKER-7f3a9c-"


def rank_node(tmp: Path, name: str, rank: int, world: int, **kw: Any) -> Checkpointer:
    """One rank of ``world`` on its own "node" (tests/test_partner.py's ``node``)."""
    for d in (tmp / name / "local", tmp / name / "ledger", tmp / "pfs"):
        d.mkdir(parents=True, exist_ok=True)
    os.chmod(tmp / name / "ledger", 0o700)
    return Checkpointer(
        local=tmp / name / "local",
        warm=tmp / "pfs",
        key=KEY,
        rank=rank,
        world_size=world,
        node=name,
        job=JOB,
        ledger_dir=tmp / name / "ledger",
        install_signals=False,
        end_time_fn=None,
        flush_every=100,
        keep_local=2,
        partner=True,
        keep_partner=2,
        partner_dir=tmp / "rendezvous",
        partner_host="127.0.0.1",
        **kw,
    )


def marked_state() -> Dict[str, Any]:
    """A state whose payload holds :data:`MARKER` many times over, in clear."""
    raw = bytearray(MARKER * 4096)
    return {"marker": torch.frombuffer(raw, dtype=torch.uint8).clone(), "step": 2}


def step_bytes(tmp: Path, name: str, key: str, step: int) -> bytes:
    """Every file of a committed step on a node's local tier, concatenated."""
    root = Path(local_tier(tmp, name).step_path("root", key, step))
    return b"".join(p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file())


class Relay:
    """A relaying proxy on ``127.0.0.1:port`` to ``127.0.0.1:target``, recording every
    byte of every connection both ways."""

    def __init__(self, port: int, target: int) -> None:
        self.target = target
        self.lsock = socket.socket()
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind(("127.0.0.1", port))
        self.lsock.listen(8)
        self.port = self.lsock.getsockname()[1]
        self.captured = bytearray()
        self.lock = threading.Lock()
        self.threads: List[threading.Thread] = []
        self.connections = 0
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()
        self.threads.append(t)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.lsock.accept()
            except OSError:
                return
            self.connections += 1
            server = socket.create_connection(("127.0.0.1", self.target), timeout=60)
            for a, b in ((client, server), (server, client)):
                t = threading.Thread(target=self._pump, args=(a, b), daemon=True)
                t.start()
                self.threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                with self.lock:
                    self.captured += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.lsock.close()


#: The hostile user's program: hold 64 connections to a partner port, one byte every
#: 8 s on each, until its stdin closes.
HOSTILE = r"""
import select, socket, sys, time
port = int(sys.argv[1])
socks = []
for _ in range(64):
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"S")
    socks.append(s)
print("ready", flush=True)
while True:
    r, _, _ = select.select([sys.stdin], [], [], 8.0)
    if r:
        break
    for s in socks:
        try:
            s.sendall(b"S")
        except OSError:
            pass
"""


def test_64_dribbling_connections_of_another_user_do_not_stop_a_copy(tmp_path: Path) -> None:
    need_root()
    a, b = rank_node(tmp_path, "na", 0, 2), rank_node(tmp_path, "nb", 1, 2)
    hostile = subprocess.Popen(
        [sys.executable, "-c", HOSTILE, str(b.partner.port)],  # type: ignore[union-attr]
        user="ckptuser1",
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        # All 64 are connected (in the listener's queue or accepted) before the copy's.
        assert hostile.stdout is not None and hostile.stdout.readline().strip() == "ready"
        save_all([a, b], 1, states(1)[0])
        sa = a.partner.stats  # type: ignore[union-attr]
        assert (sa.sent, sa.send_failures) == (1, 0), sa.last_error
        assert [i.step for i in local_tier(tmp_path, "nb").steps("root", rank_key(0))] == [1]
        assert b.partner.stats.refused >= 32  # type: ignore[union-attr]
    finally:
        assert hostile.stdin is not None
        hostile.stdin.close()
        hostile.wait(60)
        a.close()
        b.close()


def test_relay_through_a_dead_ranks_port_to_another_rank_is_refused(tmp_path: Path) -> None:
    """Ranks 0, 1, 2 on na, nb, nc (rank 0 copies to rank 1). Rank 1's process dies, its
    node stays up; a local user binds the freed port and relays to rank 2."""
    ranks = [rank_node(tmp_path, n, r, 3) for r, n in enumerate(("na", "nb", "nc"))]
    a, b, c = ranks
    relay = None
    try:
        save_all(ranks, 1, states(1)[0])
        assert a.partner.stats.partner == "rank 1 on nb"  # type: ignore[union-attr]
        port = b.partner.port  # type: ignore[union-attr]
        b.partner.close(0)  # type: ignore[union-attr]
        b._pipeline.finish(0)  # the process is gone: its listener with it
        relay = Relay(port, c.partner.port)  # type: ignore[union-attr]
        refused = c.partner.stats.refused  # type: ignore[union-attr]
        a.save(marked_state(), step=2)
        assert a.wait(flush=False) and a.partner.wait_idle(120)  # type: ignore[union-attr]
        sa = a.partner.stats  # type: ignore[union-attr]
        assert (sa.sent, sa.send_failures) == (1, 1)
        assert relay.connections == 1
        assert c.partner.stats.refused == refused + 1  # type: ignore[union-attr]
        assert [i.step for i in local_tier(tmp_path, "nc").steps("root", rank_key(0))] == []
        assert MARKER not in relay.captured
        assert MARKER in step_bytes(tmp_path, "na", rank_key(0), 2)  # the marker is real
    finally:
        if relay is not None:
            relay.close()
        a.close()
        c.close()


def test_a_recorded_session_shows_no_plaintext(tmp_path: Path) -> None:
    a, b = rank_node(tmp_path, "na", 0, 2), rank_node(tmp_path, "nb", 1, 2)
    relay = Relay(0, b.partner.port)  # type: ignore[union-attr]
    try:
        save_all([a, b], 1, states(1)[0])
        # rank 0's copies now pass the recorder on their way to rank 1 (as on a network)
        a.partner._partner = Peer(1, "nb", "127.0.0.1", relay.port)  # type: ignore[union-attr]
        a.save(marked_state(), step=2)
        assert a.wait(flush=False) and a.partner.wait_idle(120)  # type: ignore[union-attr]
        sa = a.partner.stats  # type: ignore[union-attr]
        assert (sa.sent, sa.send_failures) == (2, 0), sa.last_error
        copy = step_bytes(tmp_path, "nb", rank_key(0), 2)
        assert MARKER in copy  # it went through, marker and all
        with relay.lock:
            captured = bytes(relay.captured)
        assert len(captured) > len(MARKER) * 4096
        assert MARKER not in captured
        assert MARKER[:8] not in captured
        assert rank_key(0).encode() not in captured  # the manifest is sealed too
    finally:
        relay.close()
        a.close()
        b.close()


def test_gate_drops_a_hello_dribbled_past_the_deadline() -> None:
    """One byte every 50 ms: a hello (68 bytes at least) would take 3.4 s; the gate's
    deadline is 0.5 s from accept, however often bytes arrive."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(8)
    refused: List[str] = []
    stop = threading.Event()
    gate = Gate(
        lsock,
        Identity(b"s" * 32, 0, 2, "", "k"),
        lambda ch, r: False,
        refused.append,
        deadline_s=0.5,
    )
    t = threading.Thread(target=gate.run, args=(stop.is_set,), daemon=True)
    t.start()
    sent = 0
    try:
        with socket.create_connection(lsock.getsockname(), timeout=30) as s:
            for byte in MAGIC + bytes(60):
                try:
                    s.sendall(bytes([byte]))
                except OSError:
                    break  # hung up on
                sent += 1
                time.sleep(0.05)  # the dribble's pace (not a race: any pace past 0.5 s)
        assert sent < len(MAGIC) + 60
        assert refused and "no handshake within" in refused[0]
    finally:
        stop.set()
        t.join(10)
        lsock.close()


def test_squatted_rendezvous_is_refused_and_reported(tmp_path: Path) -> None:
    """``[partner] dir`` on a shared base (mode 1777, as the admin guide says): another
    user made ``<dir>/root`` first. The job's partner copies are off, with an event that
    says why; ``status`` and ``doctor`` report the squat."""
    need_root()
    base = tmp_path / "rendezvous"
    base.mkdir(mode=0o1777)
    os.chmod(base, 0o1777)
    squat = base / "root"
    squat.mkdir(mode=0o777)
    os.chmod(squat, 0o777)
    uid = pwd.getpwnam("ckptuser1").pw_uid
    os.chown(squat, uid, uid)
    events: List[Any] = []
    a = rank_node(tmp_path, "na", 0, 2, on_event=lambda n, i: events.append((n, i)))
    try:
        assert a.partner is None
        off = [i for n, i in events if n == "partner_off"]
        assert len(off) == 1 and off[0]["squatted"] is True
        assert "squatted" in off[0]["error"] and str(squat) in off[0]["error"]
        a.save(states(1)[0], step=1)  # training goes on
        assert a.wait(flush=False)
    finally:
        a.close()
    assert not list(squat.iterdir())  # nothing of root's went into it
    cfg = Config.from_dict(
        {
            "tiers": {
                "local": {"root": str(tmp_path / "na" / "local"), "min_free": 0},
                "pfs": {"kind": "posix", "root": str(tmp_path / "pfs")},
            },
            "ledger": {"dir": str(tmp_path / "na" / "ledger")},
            "partner": {"dir": str(base)},
        }
    )
    doc = collect_status(cfg, query=lambda: no_slurm("test")).to_json()
    assert {(s["path"], s["user"], s["owner_uid"]) for s in doc["squatted"]} == {
        (str(squat), "root", uid)
    }
    found = check_security(cfg, lambda *args: args)
    bad = [f for f in found if f[0] == "squatted" and f[1] == "error"]
    assert len(bad) == 1 and "partner copies are off" in bad[0][2]


def test_a_symlink_for_the_users_rendezvous_directory_is_never_followed(tmp_path: Path) -> None:
    """``<dir>/root`` is a symlink (to a directory its maker controls): refused, partner
    copies off with an event, nothing written where it points."""
    base = tmp_path / "rendezvous"
    base.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (base / "root").symlink_to(elsewhere)
    events: List[Any] = []
    a = rank_node(tmp_path, "na", 0, 2, on_event=lambda n, i: events.append((n, i)))
    try:
        assert a.partner is None
        assert [n for n, _i in events].count("partner_off") == 1
    finally:
        a.close()
    assert not list(elsewhere.iterdir())
