"""The partner transport's bytes on the wire: the handshake and the encrypted channel.

Everything a partner copy, fetch or ranged read sends after the handshake travels in
**records** sealed with AES-256-GCM (``cryptography``'s AEAD) under a key of that session
and direction, with a counter nonce: a peer without the job's secret can neither read a
byte of a checkpoint nor change, drop, replay or reorder one unnoticed. The format is
written down for users and admins in docs/partner.md ("Wire format").

The handshake (three messages, the client speaks first):

* **client hello**: ``MAGIC``, a fresh client nonce, the client's rank, the rank it means
  to reach, the launch tag and the job's series, and an HMAC-SHA256 of all of it under
  the job's secret: its proof comes with its first message, so the server learns within
  one message whether the peer knows the secret;
* **server hello**: a fresh server nonce and an HMAC over the whole client hello and that
  nonce: the server proves the secret too, *for the rank the client meant*. A server
  that is not that rank (a stranger who bound a dead rank's port and relays the hello to
  another live rank of the job) is refused by that live rank: the hello names another
  rank, and no one without the secret can change it;
* **client finished**: an HMAC under the new session's key, so a replayed client hello
  (recorded by such a relay) never yields a session.

The server side is a state machine (:class:`ServerHandshake`) so that a listener can run
many handshakes from one thread with an overall deadline per connection
(:mod:`.partner_gate`); :func:`server_handshake` runs one with a blocking socket.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
import time
from dataclasses import dataclass
from typing import Optional, Tuple, Union

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from slurm_ckpt.errors import CkptError

__all__ = [
    "HELLO_MAX",
    "MAGIC",
    "MAX_FRAME",
    "RECORD_MAX",
    "Channel",
    "Identity",
    "ServerHandshake",
    "WireError",
    "client_handshake",
    "raw_recv_exact",
    "server_handshake",
]

#: First bytes of a client hello; the last character is the protocol's version.
MAGIC = b"SCKPTNR2"
NONCE = 16
MAC = 32
TAG = 16
#: Longest launch tag and series name a hello may carry (bytes, UTF-8).
LAUNCH_MAX = 128
SERIES_MAX = 512
_FIXED = struct.Struct("!8s16sIIHH")
#: The largest client hello (a connecting stranger makes the server buffer no more).
HELLO_MAX = _FIXED.size + LAUNCH_MAX + SERIES_MAX + MAC
_SERVER_HELLO = NONCE + MAC
_FINISHED = MAC
#: Largest plaintext of one record: the background copy's piece (256 KiB), so one copy
#: piece is one record; a larger piece (a restore's fetch) goes as several.
RECORD_MAX = 256 * 2**10
_HEADER = struct.Struct("!I")
#: Largest control frame (a manifest of many files fits; an authenticated peer cannot
#: make the receiver hold more, and a frame's memory grows only as its records arrive).
MAX_FRAME = 64 * 2**20

#: ``encrypt_into``/``decrypt_into`` (cryptography 45 and later): records sealed and
#: opened in place.
_INTO = hasattr(AESGCM, "decrypt_into")

_CLIENT, _SERVER, _SESSION = b"partner client hello", b"partner server hello", b"partner key"


class WireError(CkptError):
    """The peer spoke the protocol wrongly, failed authentication or went away."""


@dataclass(frozen=True)
class Identity:
    """What binds a session: the job's secret, this rank, the ranks' count, the launch
    (:func:`~slurm_ckpt.job.partner_net.launch_tag`) and the job's series (base key)."""

    secret: bytes
    rank: int
    world_size: int
    launch: str
    series: str


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _keys(secret: bytes, hello: bytes, ns: bytes) -> Tuple[bytes, bytes, bytes]:
    """Client-to-server key, server-to-client key, finished key of one session."""
    prk = _mac(secret, _SESSION, hello, ns)
    return _mac(prk, b"c2s"), _mac(prk, b"s2c"), _mac(prk, b"finished")


def _text(value: str, limit: int, what: str) -> bytes:
    data = value.encode()
    if len(data) > limit:
        raise WireError(f"{what} longer than {limit} bytes")
    return data


def raw_recv_exact(sock: socket.socket, n: int, deadline: Optional[float] = None) -> bytes:
    """``n`` bytes from ``sock``; with ``deadline`` (monotonic), all of them by then
    (a peer sending one byte at a time does not get a fresh timeout per byte)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WireError("handshake deadline passed")
            sock.settimeout(left)
        try:
            k = sock.recv_into(view[got:], n - got)
        except socket.timeout:
            raise WireError("peer too slow") from None
        if k == 0:
            raise WireError("connection closed by the peer")
        got += k
    return bytes(buf)


# ------------------------------------------------------------------------ the channel


class Channel:
    """An authenticated, encrypted session over ``sock`` (a byte stream cut in records).

    ``sendall``/``recv_exact``/``recv_into`` behave like a socket's; each ``sendall`` is
    one record per :data:`RECORD_MAX` bytes. Control frames are length-prefixed byte
    strings inside the stream (:meth:`send_frame`, :meth:`recv_frame`)."""

    def __init__(self, sock: socket.socket, send_key: bytes, recv_key: bytes) -> None:
        self.sock = sock
        self._tx, self._rx = AESGCM(send_key), AESGCM(recv_key)
        self._txn = self._rxn = 0
        self._plain = memoryview(b"")
        self._ct = bytearray(RECORD_MAX + TAG)
        #: One record's header and ciphertext, sealed in place (no copy per record).
        self._out = bytearray(_HEADER.size + RECORD_MAX + TAG) if _INTO else None
        self._pt: Optional[bytearray] = None

    # -- socket-like ---------------------------------------------------------------------
    def settimeout(self, t: Optional[float]) -> None:
        self.sock.settimeout(t)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- records -------------------------------------------------------------------------
    def _nonce(self, send: bool) -> bytes:
        if send:
            n, self._txn = self._txn, self._txn + 1
        else:
            n, self._rxn = self._rxn, self._rxn + 1
        return n.to_bytes(12, "big")

    def sendall(self, data: Union[bytes, bytearray, memoryview]) -> None:
        view = memoryview(data).cast("B")
        for off in range(0, len(view), RECORD_MAX):
            piece = view[off : off + RECORD_MAX]
            header = _HEADER.pack(len(piece) + TAG)
            if self._out is None:
                self.sock.sendall(header + self._tx.encrypt(self._nonce(True), piece, header))
                continue
            end = _HEADER.size + len(piece) + TAG
            out = memoryview(self._out)
            out[: _HEADER.size] = header
            self._tx.encrypt_into(self._nonce(True), piece, header, out[_HEADER.size : end])
            self.sock.sendall(out[:end])

    def _record(self) -> Tuple[bytes, memoryview]:
        """The next record's header and ciphertext (in :attr:`_ct`), not yet opened."""
        header = raw_recv_exact(self.sock, _HEADER.size)
        (n,) = _HEADER.unpack(header)
        if n <= TAG or n > RECORD_MAX + TAG:
            raise WireError(f"record of {n} bytes refused")
        view = memoryview(self._ct)[:n]
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:], n - got)
            if k == 0:
                raise WireError("connection closed by the peer")
            got += k
        return header, view

    def _open(self, header: bytes, ct: memoryview, into: Optional[memoryview]) -> memoryview:
        """Authenticate and decrypt one record, into ``into`` when given (exactly its
        plaintext's size) or into a buffer of the channel's; its plaintext."""
        nonce = self._nonce(False)
        try:
            if not _INTO:
                plain = memoryview(self._rx.decrypt(nonce, ct, header))
                if into is None:
                    return plain
                into[:] = plain
                return into
            if into is None:
                if self._pt is None:
                    self._pt = bytearray(RECORD_MAX)
                into = memoryview(self._pt)[: len(ct) - TAG]
            self._rx.decrypt_into(nonce, ct, header, into)
            return into
        except InvalidTag:
            raise WireError("record failed authentication") from None

    def _fill(self) -> None:
        header, ct = self._record()
        self._plain = self._open(header, ct, None)

    def recv_into(self, view: memoryview, n: int = 0) -> int:
        """Up to ``n`` (default: ``len(view)``) bytes into ``view``; never 0 (a closed
        or lying peer raises :class:`WireError`). A whole record that fits is opened
        straight into ``view`` (one copy less: the restore's fresh memory)."""
        want = n or len(view)
        if not self._plain:
            header, ct = self._record()
            size = len(ct) - TAG
            if size <= want:
                return len(self._open(header, ct, view[:size]))
            self._plain = self._open(header, ct, None)
        k = min(want, len(self._plain))
        view[:k] = self._plain[:k]
        self._plain = self._plain[k:]
        return k

    def recv_exact(self, n: int) -> bytes:
        """Exactly ``n`` bytes (held as they arrive: no allocation ahead of the data)."""
        out = bytearray()
        while len(out) < n:
            if not self._plain:
                self._fill()
            k = min(n - len(out), len(self._plain))
            out += self._plain[:k]
            self._plain = self._plain[k:]
        return bytes(out)

    # -- control frames --------------------------------------------------------------------
    def send_frame(self, data: bytes) -> None:
        self.sendall(_HEADER.pack(len(data)) + data)

    def recv_frame(self, limit: int = MAX_FRAME) -> bytes:
        (n,) = _HEADER.unpack(self.recv_exact(_HEADER.size))
        if n > limit:
            raise WireError(f"frame of {n} bytes refused")
        return self.recv_exact(n)


# ---------------------------------------------------------------------- the handshake


def client_handshake(
    sock: socket.socket, ident: Identity, server_rank: int, timeout: float = 10.0
) -> Channel:
    """Prove the secret to rank ``server_rank`` and have it prove the secret back, all
    within ``timeout`` seconds; the encrypted channel of the session."""
    deadline = time.monotonic() + timeout
    launch = _text(ident.launch, LAUNCH_MAX, "launch tag")
    series = _text(ident.series, SERIES_MAX, "series")
    nc = secrets.token_bytes(NONCE)
    body = _FIXED.pack(MAGIC, nc, ident.rank, server_rank, len(launch), len(series))
    body += launch + series
    hello = body + _mac(ident.secret, _CLIENT, body)
    old = sock.gettimeout()
    sock.settimeout(timeout)
    sock.sendall(hello)
    reply = raw_recv_exact(sock, _SERVER_HELLO, deadline)
    ns, mac = reply[:NONCE], reply[NONCE:]
    if not hmac.compare_digest(mac, _mac(ident.secret, _SERVER, hello, ns)):
        raise WireError(f"the peer is not rank {server_rank} of this job (failed authentication)")
    c2s, s2c, fin = _keys(ident.secret, hello, ns)
    sock.sendall(_mac(fin, b"client finished"))
    sock.settimeout(old)
    return Channel(sock, c2s, s2c)


class ServerHandshake:
    """One server-side handshake fed the bytes as they arrive: :meth:`need` says how many
    to read next (never more than the handshake has: nothing of the session is read
    early), :meth:`feed` takes them and returns the server hello to send when the
    client hello proved the secret; :attr:`done` once the client finished."""

    def __init__(self, ident: Identity) -> None:
        self.ident = ident
        self._buf = bytearray()
        self._want = _FIXED.size
        self._phase = 0
        self._keys: Optional[Tuple[bytes, bytes, bytes]] = None
        self.done = False
        #: The client's rank, once its hello is verified.
        self.peer_rank: Optional[int] = None

    def need(self) -> int:
        return self._want - len(self._buf)

    def feed(self, data: bytes) -> Optional[bytes]:
        if self.done or len(data) > self.need():
            raise WireError("handshake: more bytes than asked for")
        self._buf += data
        if self.need():
            return None
        if self._phase == 0:
            magic, _nc, _cr, _sr, nl, ns_ = _FIXED.unpack(self._buf)
            if magic != MAGIC:
                raise WireError("not a partner-copy client (bad magic or version)")
            if nl > LAUNCH_MAX or ns_ > SERIES_MAX:
                raise WireError("client hello too long")
            self._phase, self._want = 1, _FIXED.size + nl + ns_ + MAC
            return None
        if self._phase == 1:
            return self._hello_done()
        assert self._keys is not None
        if not hmac.compare_digest(bytes(self._buf), _mac(self._keys[2], b"client finished")):
            raise WireError("client did not finish the handshake (a replayed hello?)")
        self.done = True
        return None

    def _hello_done(self) -> bytes:
        ident = self.ident
        hello = bytes(self._buf)
        body, mac = hello[:-MAC], hello[-MAC:]
        if not hmac.compare_digest(mac, _mac(ident.secret, _CLIENT, body)):
            raise WireError("peer failed authentication")
        _m, _nc, client_rank, server_rank, nl, _ns = _FIXED.unpack_from(body)
        launch = body[_FIXED.size : _FIXED.size + nl]
        series = body[_FIXED.size + nl :]
        if server_rank != ident.rank:
            raise WireError(
                f"hello meant for rank {server_rank} reached rank {ident.rank} (relayed?)"
            )
        if launch != ident.launch.encode() or series != ident.series.encode():
            raise WireError("hello of another launch or series of the job")
        if client_rank >= ident.world_size or client_rank == ident.rank:
            raise WireError(f"hello from rank {client_rank}: no other rank of this job")
        self.peer_rank = client_rank
        ns = secrets.token_bytes(NONCE)
        self._keys = _keys(ident.secret, hello, ns)
        self._buf = bytearray()
        self._phase, self._want = 2, _FINISHED
        return ns + _mac(ident.secret, _SERVER, hello, ns)

    def channel(self, sock: socket.socket) -> Channel:
        if not self.done or self._keys is None:
            raise WireError("handshake not finished")
        c2s, s2c, _fin = self._keys
        return Channel(sock, s2c, c2s)


def server_handshake(sock: socket.socket, ident: Identity, deadline: float) -> Channel:
    """Run the server side of the handshake on a blocking socket, all of it by
    ``deadline`` (monotonic); the session's channel."""
    hs = ServerHandshake(ident)
    while not hs.done:
        reply = hs.feed(raw_recv_exact(sock, hs.need(), deadline))
        if reply is not None:
            sock.sendall(reply)
    return hs.channel(sock)
