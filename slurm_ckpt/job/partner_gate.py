"""The partner server's front door: accept connections and run their handshakes in a
pool that strangers cannot exhaust.

Anyone on the network (any user of a node) can connect to a rank's partner port. Before
a peer has proved the job's secret it holds no thread and no session slot: all
unauthenticated connections live in one small **pending pool** served by the accepting
thread itself (:class:`Gate`, one ``selectors`` loop), each with an **overall deadline**
counted from ``accept`` (:data:`HANDSHAKE_DEADLINE_S`; a peer sending one byte at a time
gains nothing), and at most :data:`HELLO_MAX` bytes buffered for it.

When the pool is full, a new connection takes the place of the **oldest pending
connection of the source holding the most pending ones**: a stranger opening many
connections pushes out its own, the newest connection (a partner's, whose hello arrives
with its first packet) is the last to go, and a source with fewer connections (another
node's rank) is never pushed out by a busier one. Only a peer that finished the
handshake (it knows the secret) reaches the session slots of the link
(``partner.MAX_CONNECTIONS``), so strangers never starve authenticated sessions.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

from slurm_ckpt.job.partner_wire import Channel, Identity, ServerHandshake, WireError

log = logging.getLogger(__name__)

__all__ = ["HANDSHAKE_DEADLINE_S", "PENDING_MAX", "Gate"]

#: A connecting peer must have finished the handshake this long after ``accept``.
HANDSHAKE_DEADLINE_S = 10.0
#: Unauthenticated connections held at once (each: a socket and at most HELLO_MAX bytes).
PENDING_MAX = 32
#: Connections accepted per turn of the loop (the handshakes already open go first).
_ACCEPTS_PER_TURN = 8


@dataclass
class _Pending:
    sock: socket.socket
    source: str
    deadline: float
    hs: ServerHandshake
    seq: int = field(default=0)


class Gate:
    """Accept loop of one partner server (see the module docstring).

    ``on_session(channel, peer_rank)`` gets every finished handshake's channel and
    returns whether it took it (False: the session slots are full; the gate hangs up).
    ``on_refused(reason)`` hears of every connection dropped before it finished."""

    def __init__(
        self,
        lsock: socket.socket,
        ident: Identity,
        on_session: Callable[[Channel, int], bool],
        on_refused: Callable[[str], None],
        *,
        pending_max: int = PENDING_MAX,
        deadline_s: float = HANDSHAKE_DEADLINE_S,
        io_timeout: float = 60.0,
    ) -> None:
        self.lsock, self.ident = lsock, ident
        self.on_session, self.on_refused = on_session, on_refused
        self.pending_max, self.deadline_s, self.io_timeout = pending_max, deadline_s, io_timeout
        self.pending: Dict[int, _Pending] = {}
        self._seq = 0
        self._sel = selectors.DefaultSelector()

    # -- the loop ------------------------------------------------------------------------
    def run(self, stop: Callable[[], bool]) -> None:
        """Serve until ``stop()`` (looked at twice a second) or the listener closes."""
        try:
            self.lsock.setblocking(False)
            self._sel.register(self.lsock, selectors.EVENT_READ, None)
        except (OSError, ValueError):
            self._sel.close()
            return  # closed before the loop began (a link closed at once)
        try:
            while not stop():
                now = time.monotonic()
                wait = 0.5
                if self.pending:
                    wait = max(0.0, min(wait, min(p.deadline for p in self.pending.values()) - now))
                try:
                    events = self._sel.select(wait)
                except (OSError, ValueError):
                    return  # the listener was closed under us (close())
                accept = False
                for key, _mask in events:
                    if key.data is None:
                        accept = True
                    else:
                        self._step(key.data)
                if accept and not self._accept():
                    return
                self._expire()
        finally:
            for p in list(self.pending.values()):
                self._drop(p, None)
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._sel.unregister(self.lsock)
            self._sel.close()

    def _accept(self) -> bool:
        for _ in range(_ACCEPTS_PER_TURN):
            try:
                conn, addr = self.lsock.accept()
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                return self.lsock.fileno() >= 0  # a closed listener ends the loop
            conn.setblocking(False)
            # Small frames at once: an answer is a status record then a frame, and Nagle
            # would hold the frame for the peer's delayed ACK (40 ms on Linux).
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if len(self.pending) >= self.pending_max:
                self._evict()
            self._seq += 1
            p = _Pending(
                conn,
                str(addr[0]),
                time.monotonic() + self.deadline_s,
                ServerHandshake(self.ident),
                self._seq,
            )
            self.pending[conn.fileno()] = p
            self._sel.register(conn, selectors.EVENT_READ, p)
        return True

    def _evict(self) -> None:
        """Make room: the oldest pending connection of the busiest source goes."""
        counts = Counter(p.source for p in self.pending.values())
        most = max(counts.values())
        victim = min(
            (p for p in self.pending.values() if counts[p.source] == most), key=lambda p: p.seq
        )
        self._drop(victim, "pending connections full: oldest of the busiest source dropped")

    def _expire(self) -> None:
        now = time.monotonic()
        for p in [p for p in self.pending.values() if p.deadline <= now]:
            self._drop(p, f"no handshake within {self.deadline_s:.0f}s of connecting")

    def _step(self, p: _Pending) -> None:
        if self.pending.get(p.sock.fileno()) is not p:
            return  # dropped earlier in this turn
        try:
            data = p.sock.recv(p.hs.need())
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._drop(p, f"handshake: {exc}")
            return
        if not data:
            self._drop(p, "closed during the handshake")
            return
        try:
            reply = p.hs.feed(data)
            if reply is not None and p.sock.send(reply) != len(reply):
                raise WireError("server hello not sent at once")
        except (WireError, OSError) as exc:
            self._drop(p, str(exc))
            return
        if not p.hs.done:
            return
        self._forget(p)
        peer_rank = p.hs.peer_rank if p.hs.peer_rank is not None else -1
        try:
            p.sock.settimeout(self.io_timeout)
            ch = p.hs.channel(p.sock)
            taken = self.on_session(ch, peer_rank)
        except Exception:  # noqa: BLE001 - the loop never dies of one peer
            log.exception("[ckpt] partner session not started")
            taken = False
        if not taken:
            p.sock.close()

    def _forget(self, p: _Pending) -> None:
        self.pending.pop(p.sock.fileno(), None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(p.sock)

    def _drop(self, p: _Pending, reason: Optional[str]) -> None:
        self._forget(p)
        if reason is not None:  # counted before the peer sees the hang-up
            with contextlib.suppress(Exception):
                self.on_refused(reason)
        p.sock.close()
