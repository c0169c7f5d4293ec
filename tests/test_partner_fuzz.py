"""The partner transport's parsers against a hostile peer, with hypothesis (issue 28).

A peer sends arbitrary bytes (or well-formed messages with arbitrary fields) and hangs
up. Whatever it sends, the server side of the handshake and ``recv_frame`` must:

* end with :class:`WireError` (or, for an authenticated peer, hand back frames no
  larger than ``MAX_FRAME``) - never another exception;
* end within the handshake deadline (plus a margin for a loaded machine): no hang,
  also when the peer sends part of a hello (or all of it) and then goes silent without
  hanging up;
* allocate at most :data:`MEMORY_BOUND` bytes at their peak (``tracemalloc``), however
  large a length the peer claims.

By default each property runs :data:`EXAMPLES` cases; ``SLURM_CKPT_FUZZ_EXAMPLES=10000``
runs that many (docs/security.md reports such a run).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time
import tracemalloc
from typing import Callable, List, Optional, Tuple

import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings

from slurm_ckpt.job.partner_wire import (
    MAGIC,
    MAX_FRAME,
    Channel,
    Identity,
    WireError,
    server_handshake,
)

EXAMPLES = int(os.environ.get("SLURM_CKPT_FUZZ_EXAMPLES", "300"))
#: Peak bytes one case may allocate: a hello (under 1 KiB), one record buffer and its
#: plaintext (256 KiB + 16 each), the frame read so far; far below what a claimed
#: length (up to 4 GiB) would take if it were believed.
MEMORY_BOUND = 2 * 2**20
#: The handshake deadline given to the server side in these cases.
DEADLINE_S = 2.0
#: Margin over the deadline before a case counts as a hang (a loaded CI machine).
HANG_S = 20.0

FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,  # wall time is checked below, against the protocol's own bound
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)
SECRET = b"\x5a" * 32
SERVER = Identity(SECRET, 1, 4, "7/0", "run")


def _fed(data: bytes) -> Tuple[socket.socket, socket.socket]:
    """The peer's end (kept open: the server may answer) and the receiving end of a
    connection on which the peer sent ``data`` and hung up its sending half."""
    a, b = socket.socketpair()
    b.settimeout(HANG_S)
    a.sendall(data)
    a.shutdown(socket.SHUT_WR)
    return a, b


def _bounded(fn: Callable[[], object]) -> Tuple[Optional[BaseException], object]:
    """Run ``fn``; its exception (or None) and result; assert the time and memory bounds."""
    tracemalloc.start()
    t0 = time.monotonic()
    exc: Optional[BaseException] = None
    out: object = None
    try:
        out = fn()
    except BaseException as e:  # noqa: BLE001 - judged by the caller
        exc = e
    elapsed = time.monotonic() - t0
    _cur, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert elapsed < DEADLINE_S + HANG_S, f"hung for {elapsed:.1f}s"
    assert peak < MEMORY_BOUND, f"peak {peak} bytes"
    return exc, out


def _handshake(data: bytes) -> None:
    peer, sock = _fed(data)
    try:
        exc, _out = _bounded(lambda: server_handshake(sock, SERVER, time.monotonic() + DEADLINE_S))
        assert isinstance(exc, WireError), repr(exc)
    finally:
        peer.close()
        sock.close()


@FUZZ
@given(st.binary(max_size=2048))
def test_server_handshake_survives_any_bytes(data: bytes) -> None:
    _handshake(data)


@st.composite
def hellos(draw: st.DrawFn) -> bytes:
    """Client hellos with every field drawn: magic, ranks, lengths that may lie, launch
    and series, a MAC that is random or right (with this secret or another), a tail."""
    magic = draw(st.sampled_from([MAGIC, b"SCKPTNR1", draw(st.binary(min_size=8, max_size=8))]))
    nc = draw(st.binary(min_size=16, max_size=16))
    cr = draw(st.one_of(st.integers(0, 5), st.integers(0, 2**32 - 1)))
    sr = draw(st.one_of(st.just(1), st.integers(0, 2**32 - 1)))
    launch = draw(st.one_of(st.just(b"7/0"), st.binary(max_size=200)))
    series = draw(st.one_of(st.just(b"run"), st.binary(max_size=600)))
    nl = draw(st.one_of(st.just(len(launch)), st.integers(0, 2**16 - 1)))
    ns = draw(st.one_of(st.just(len(series)), st.integers(0, 2**16 - 1)))
    body = struct.pack("!8s16sIIHH", magic, nc, cr, sr, nl, ns) + launch + series
    key = draw(st.sampled_from([SECRET, b"\x00" * 32]))
    good = hmac.new(key, b"partner client hello" + body, hashlib.sha256).digest()
    mac = draw(st.one_of(st.just(good), st.binary(min_size=32, max_size=32)))
    tail = draw(st.binary(max_size=64))
    return body + mac + tail


@FUZZ
@given(hellos())
def test_server_handshake_survives_hostile_hellos(data: bytes) -> None:
    _handshake(data)


#: The deadline of the silent-peer cases (short: each case waits it out), and the socket
#: timeout behind it: a case that ends only by the socket's timeout ignored the deadline.
SILENT_DEADLINE_S = 0.05
SILENT_SOCKET_S = 10.0


@FUZZ
@given(st.one_of(st.binary(max_size=2048), hellos()))
def test_server_handshake_of_a_peer_that_goes_silent_ends_at_the_deadline(data: bytes) -> None:
    """The peer sends ``data`` (anything, or a hello with any fields) and then neither
    sends nor hangs up: the handshake ends with WireError at its own deadline, long
    before the socket's timeout, however much of a hello arrived."""
    a, b = socket.socketpair()
    try:
        b.settimeout(SILENT_SOCKET_S)
        a.sendall(data)  # and nothing more, the connection left open
        t0 = time.monotonic()
        exc, _ = _bounded(lambda: server_handshake(b, SERVER, time.monotonic() + SILENT_DEADLINE_S))
        took = time.monotonic() - t0
        assert isinstance(exc, WireError), repr(exc)
        assert took < SILENT_SOCKET_S / 2, f"ended after {took:.1f}s, not at its deadline"
    finally:
        a.close()
        b.close()


def _receive_all(sock: socket.socket, keys: Tuple[bytes, bytes]) -> List[bytes]:
    ch = Channel(sock, keys[0], keys[1])
    frames = []
    while True:  # until the peer's bytes run out (WireError) or lie
        frames.append(ch.recv_frame())
        assert len(frames[-1]) <= MAX_FRAME


@FUZZ
@given(st.binary(max_size=4096))
def test_recv_frame_of_a_stranger_survives_any_bytes(data: bytes) -> None:
    peer, sock = _fed(data)
    try:
        exc, _ = _bounded(lambda: _receive_all(sock, (b"k" * 32, b"j" * 32)))
        assert isinstance(exc, WireError), repr(exc)
    finally:
        peer.close()
        sock.close()


@FUZZ
@given(
    st.lists(
        st.one_of(
            st.binary(max_size=512),  # any plaintext: frame lengths that lie, cut frames
            st.integers(0, 2**32 - 1).map(lambda n: struct.pack("!I", n)),
        ),
        max_size=8,
    ),
    st.binary(max_size=64),
)
def test_recv_frame_of_an_authenticated_peer_survives_any_plaintext(
    records: List[bytes], tail: bytes
) -> None:
    """A peer that holds the session key (it knows the secret) and seals whatever it
    likes: frames are returned only whole and within MAX_FRAME, then WireError."""
    keys = (b"k" * 32, b"j" * 32)
    a, b = socket.socketpair()
    try:
        peer = Channel(a, keys[1], keys[0])
        for r in records:
            if r:
                peer.sendall(r)
        a.sendall(tail)
        a.shutdown(socket.SHUT_WR)
        b.settimeout(HANG_S)
        exc, _ = _bounded(lambda: _receive_all(b, keys))
        assert isinstance(exc, WireError), repr(exc)
    finally:
        a.close()
        b.close()
