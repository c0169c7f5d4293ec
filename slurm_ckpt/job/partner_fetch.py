"""Fetch a rank's own checkpoint back from the node that holds its partner copy.

When a node dies and ``ckpt-srun --spares`` relaunches the step with a spare in its
place, the rank on the spare finds nothing on its new node's local tier. Its newest
checkpoints are on its partner's disk (the ring successor of the job's *original* node
layout), and with ``flush_every`` high the warm tier holds only older ones. This module
brings that copy over, verified, so the restore reads it as a local checkpoint:

* **Who holds it.** The ring the copies went round was built over the old node set,
  which the relaunched ranks no longer see. So the fetching rank asks every other rank
  of the relaunched step (nearest in rank order first) which steps of its series it
  holds, and takes the newest. Only ranks whose local tier lacks their own series ask:
  a survivor never does, and one list request per other rank is a few milliseconds.
* **Transport.** The same authenticated, encrypted connection as the copies
  (:mod:`.partner_wire`: handshake bound to both ranks, the launch and the series;
  every byte after it sealed with AES-GCM), on the same server thread and bounded
  buffer. The request is a control frame starting with :data:`FETCH`; the holder
  only serves rank series of this job and user.
* **Verification.** The received manifest must be the asking rank's own series, step,
  rank and world size. Every chunk is hashed and compared with that manifest as it
  arrives and the copy is committed through the local tier's writer in copy mode,
  manifest last; a mismatch aborts the write, so nothing unsound is ever committed.
  The restore then reads and verifies it again, as from any tier.
* **Falling back.** No holder (the partner node is gone too), a refused or failed
  fetch: nothing is committed, and the restore goes on over the other tiers (the warm
  tier). The failure is logged and counted, never raised.

The step agreement of :class:`~slurm_ckpt.job.restore.Restorer` then counts the fetched
step like any local one. Every rank fetches (or not) before it lists its steps, so the
agreement stays the same deterministic min-reduce.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Protocol, Tuple

import xxhash

from slurm_ckpt.core.chunks import BandwidthLimiter, io_buffer
from slurm_ckpt.core.manifest import Manifest
from slurm_ckpt.errors import CkptError, NotFound, VerifyError
from slurm_ckpt.job.partner_net import Peer, Rendezvous, no_delay
from slurm_ckpt.job.partner_wire import Channel, Identity, WireError, client_handshake
from slurm_ckpt.ledger.ledger import Ledger
from slurm_ckpt.ledger.record import WARM_SLOT, Record, State
from slurm_ckpt.tiers.base import RangeSource, Tier, TierReader

log = logging.getLogger(__name__)

__all__ = [
    "FETCH",
    "RANGE",
    "Fetched",
    "ask",
    "check_own",
    "connect",
    "fetch_own",
    "others_nearest_first",
    "receive_step",
    "relaunched",
    "retried",
    "send_range",
    "send_step",
    "serve",
]

#: First bytes of a fetch request frame (a copy's first frame is a manifest: JSON).
FETCH = b"FETCH1\n"
#: Socket timeout of a fetch's list request and of each read of the copy.
FETCH_TIMEOUT_S = 30.0

#: Tries of one request when the connection fails (see :func:`retried`).
ATTEMPTS = 4

_GO, _NO, _OK = b"G", b"N", b"K"


class FetchLink(Protocol):
    """What fetching and serving read of the rank's partner link
    (:class:`~slurm_ckpt.job.partner.PartnerLink`): who this rank is, its tiers and
    ledger, the rendezvous, and where to count and log. A protocol, not the link's
    class: the link imports this module, and this module needs no more of it."""

    user: str
    key: str
    rank: int
    world_size: int
    local: Tier
    ledger: Optional[Ledger]
    rdv: Rendezvous
    rendezvous_timeout: float
    ident: Identity
    piece: int
    limiter: Optional[BandwidthLimiter]
    #: The partners' RAM copies held here, read as a tier (None: RAM tier off).
    ram_held: Optional[Any]

    def refuse_series(self, key: str) -> Optional[str]:
        """Why a request for ``key`` is refused (None: served)."""
        ...

    def count(self, **add: Any) -> None:
        """Add to the link's counters."""
        ...

    def event(self, name: str, **info: Any) -> None:
        """Emit an event (never raises)."""
        ...


@dataclass
class Fetched:
    """One step brought over from a partner and committed on the local tier."""

    step: int
    node: str
    nbytes: int
    seconds: float


def relaunched() -> bool:
    """Whether this is a step ckpt-srun relaunched after a node loss."""
    n = os.environ.get("SLURM_CKPT_RELAUNCH", "0")
    return n.isdigit() and int(n) > 0


# ------------------------------------------------------------------------- the bytes


def send_step(
    sock: Channel,
    reader: TierReader,
    piece: int,
    limiter: Optional[BandwidthLimiter] = None,
) -> None:
    """Stream every payload file of ``reader``'s step, in manifest order, ``piece`` bytes
    at a time (each first taken from ``limiter``, when there is one).

    Each piece is read into one buffer and sealed (encrypted and authenticated) before
    it leaves: ``sendfile`` cannot be used, since the bytes must pass through the
    cipher. The receiver also hashes every chunk against the manifest."""
    buf: Optional[memoryview] = None
    for e in reader.manifest.files:
        src = reader.open(e.path)
        try:
            buf = send_range(sock, src, 0, e.size, piece, f"{reader.where}/{e.path}", limiter, buf)
        finally:
            src.close()


def send_range(
    sock: Channel,
    src: RangeSource,
    pos: int,
    end: int,
    piece: int,
    where: str,
    limiter: Optional[BandwidthLimiter] = None,
    buf: Optional[memoryview] = None,
) -> Optional[memoryview]:
    """Bytes ``[pos, end)`` of ``src`` into ``sock``, ``piece`` at a time (each first taken
    from ``limiter``): read into ``buf`` (made on first need; returned for the next call)
    and sealed into records from it."""
    while pos < end:
        n = min(piece, end - pos)
        if limiter is not None:
            limiter.acquire(n)
        if buf is None:
            buf = io_buffer(piece)
        got = src.readinto(buf[:n], pos)
        if got <= 0:
            raise VerifyError(f"{where}: short read at {pos}")
        sock.sendall(buf[:got])
        pos += got
    return buf


def receive_step(sock: Channel, local: Tier, m: Manifest, piece: int) -> None:
    """Stream every file of ``m`` in, each chunk's digest checked against the manifest
    before the next is taken; commit (manifest last). Any mismatch aborts the write."""
    buf = io_buffer(piece)
    with local.writer(m.user, m.key, m.step, copy_of=m) as w:
        for e in m.files:
            sink = w.file(e.path, e.size)
            for ci, digest in enumerate(e.chunks):
                off = ci * m.chunk_size
                end = min(e.size, off + m.chunk_size)
                h = xxhash.xxh3_128()
                pos = off
                while pos < end:
                    n = min(piece, end - pos)
                    view = buf[:n]
                    got = 0
                    while got < n:
                        got += sock.recv_into(view[got:], n - got)
                    h.update(view)
                    sink.write(view, pos)
                    pos += n
                if h.hexdigest() != digest:
                    raise VerifyError(f"{e.path}: bytes {off}-{end} do not match the manifest")
            sink.finish()
        w.commit()


# ------------------------------------------------------------------------ the holder


def serve(link: FetchLink, conn: Channel, request: bytes) -> None:
    """Answer one fetch request (the holder's side; ``conn`` is authenticated)."""
    try:
        req = json.loads(request[len(FETCH) :])
        op, key = str(req["op"]), str(req["key"])
    except (ValueError, KeyError, TypeError):
        raise WireError("malformed fetch request") from None
    why = link.refuse_series(key)
    # "src": "ram": the RAM copies held here for other ranks (:mod:`.ram_replica`).
    tier = link.ram_held if req.get("src") == "ram" else link.local
    if why is None and tier is None:
        why = "no RAM tier here"
    if why is not None:
        link.count(refused=1)
        conn.sendall(_NO)
        conn.send_frame(why.encode())
        log.warning("[ckpt] partner fetch of %s refused: %s", key, why)
        return
    if op == "list":
        conn.sendall(_GO)
        steps = [i.step for i in _held_here(link, tier, key)]
        conn.send_frame(json.dumps(steps).encode())
        return
    if op == "manifests":
        docs = []
        for info in _held_here(link, tier, key):
            with contextlib.suppress(NotFound, VerifyError):
                docs.append(tier.manifest_bytes(link.user, key, info.step))
        conn.sendall(_GO)
        conn.send_frame(json.dumps([d.decode() for d in docs]).encode())
        return
    if op not in ("get", "open"):
        raise WireError(f"unknown fetch request {op!r}")
    step = int(req["step"])
    try:
        reader = tier.reader(link.user, key, step)
    except (NotFound, VerifyError) as exc:
        conn.sendall(_NO)
        conn.send_frame(f"no step {step} here ({exc})".encode())
        return
    with reader:
        conn.sendall(_GO)
        conn.send_frame(reader.manifest_bytes)
        if op == "open":
            _serve_ranges(conn, reader, link.piece)
            return
        # A restore waiting on it goes uncapped (the whole job waits); the spare's copy
        # taken after a restore from here (``paced``) shares the copies' cap.
        send_step(conn, reader, link.piece, link.limiter if req.get("paced") else None)
    if conn.recv_exact(1) == _OK:
        link.count(served=1)
        log.info("[ckpt] served step %d of %s back to its owner", step, key)


def _held_here(link: FetchLink, tier: Any, key: str) -> List[Any]:
    try:
        return list(tier.steps(link.user, key))
    except NotFound:
        return []


#: A range request: file index in the manifest, offset, length (a MACed frame).
RANGE = struct.Struct("!IQQ")


def _serve_ranges(conn: Channel, reader: TierReader, piece: int) -> None:
    """A restore reading the step straight from here (:mod:`.partner_tier`): after the
    manifest, any number of range requests of its payload files, each answered with
    exactly those bytes, until the reader hangs up or sends an empty frame. Only ranges
    inside the manifest's files are served; the reader hashes what it gets against that
    manifest, as any tier's reader does."""
    files = reader.manifest.files
    sources: Dict[int, RangeSource] = {}
    buf: Optional[memoryview] = None
    try:
        while True:
            try:
                req = conn.recv_frame(RANGE.size)
            except (WireError, OSError):
                return  # the reader is done (hung up, or idle past the socket's timeout)
            if not req:
                return
            if len(req) != RANGE.size:
                raise WireError("malformed range request")
            i, off, n = RANGE.unpack(req)
            if i >= len(files) or off + n > files[i].size:
                raise WireError("range outside the step's files")
            src = sources.get(i)
            if src is None:
                src = sources[i] = reader.open(files[i].path)
            where = f"{reader.where}/{files[i].path}"
            buf = send_range(conn, src, off, off + n, piece, where, None, buf)
    finally:
        for src in sources.values():
            src.close()


# ----------------------------------------------------------------------- the fetcher


def connect(link: FetchLink, peer: Peer) -> Channel:
    """An authenticated, encrypted session with rank ``peer`` (refused by any other)."""
    s = no_delay(socket.create_connection((peer.host, peer.port), timeout=FETCH_TIMEOUT_S))
    try:
        s.settimeout(FETCH_TIMEOUT_S)
        return client_handshake(s, link.ident, peer.rank)
    except BaseException:
        s.close()
        raise


def ask(link: FetchLink, s: Channel, req: Dict[str, Any]) -> None:
    s.send_frame(FETCH + json.dumps(req).encode())
    if s.recv_exact(1) != _GO:
        try:
            why = s.recv_frame(4096).decode("utf-8", "replace")
        except (CkptError, OSError):
            why = "no reason given"
        raise WireError(f"refused: {why}")


def retried(fn: Any, *args: Any) -> Any:
    """``fn(*args)``, again after a short pause when the connection failed: a holder
    serves a few connections at once and hangs up on more (many ranks lost at once ask
    it together); a copy that failed verification is not asked for again."""
    for attempt in range(ATTEMPTS):
        try:
            return fn(*args)
        except VerifyError:
            raise
        except (CkptError, OSError):
            if attempt == ATTEMPTS - 1:
                raise
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")  # pragma: no cover


def _held(link: FetchLink, peer: Peer) -> List[int]:
    with connect(link, peer) as s:
        ask(link, s, {"op": "list", "key": link.key})
        steps = json.loads(s.recv_frame())
    return [int(x) for x in steps]


def check_own(link: FetchLink, m: Manifest, step: int, node: str) -> None:
    """The manifest a holder sent must be this rank's own series, step, rank and world
    size (a holder answering with another checkpoint is refused)."""
    meta = m.meta
    if (m.user, m.key, m.step) != (link.user, link.key, step) or (
        meta.get("rank", 0),
        meta.get("world_size", 1),
    ) != (link.rank, link.world_size):
        raise VerifyError(f"{node} sent {m.key}/{m.step}, not {link.key}/{step}")


def _get(link: FetchLink, peer: Peer, step: int, paced: bool) -> Manifest:
    with connect(link, peer) as s:
        ask(link, s, {"op": "get", "key": link.key, "step": step, "paced": paced})
        m = Manifest.from_bytes(s.recv_frame(), "partner manifest")
        check_own(link, m, step, peer.node)
        receive_step(s, link.local, m, link.piece)
        s.sendall(_OK)
    return m


def others_nearest_first(link: FetchLink, peers: Dict[int, Peer]) -> List[int]:
    """The other ranks of the step, nearest in rank order first (who holds a rank's
    partner copy is usually the next one)."""
    n = link.world_size
    return sorted((r for r in peers if r != link.rank), key=lambda r: (r - link.rank) % n)


def fetch_own(
    link: FetchLink, step: Optional[int] = None, *, paced: bool = False
) -> Optional[Fetched]:
    """Bring this rank's newest step (or ``step``) over from whichever rank holds it, if
    its local tier lacks it; None when no one holds one or the fetch failed (logged and
    counted; the restore then reads the warm tier). ``paced``: the holder sends it
    within its copies' bandwidth cap (nobody waits for it)."""
    t0 = time.monotonic()
    try:
        peers = link.rdv.peers(link.rendezvous_timeout)
    except (CkptError, OSError) as exc:
        log.warning("[ckpt] partner fetch: %s", exc)
        link.count(fetch_failures=1, last_error=str(exc))
        return None
    others = others_nearest_first(link, peers)
    best: Optional[Tuple[int, Peer]] = None
    for r in others:
        try:
            held = retried(_held, link, peers[r])
        except (CkptError, OSError, ValueError) as exc:
            log.warning("[ckpt] partner fetch: rank %d on %s: %s", r, peers[r].node, exc)
            continue
        held = [s for s in held if step is None or s == step]
        if held and (best is None or max(held) > best[0]):
            best = (max(held), peers[r])
    if best is None:
        log.info("[ckpt] partner fetch: no rank holds a copy of %s", link.key)
        return None
    got_step, peer = best
    try:
        link.local.manifest_bytes(link.user, link.key, got_step)
        log.info("[ckpt] partner fetch: step %d is here already", got_step)
        return None
    except NotFound:
        pass
    except VerifyError:
        link.local.delete(link.user, link.key, got_step)
    try:
        m = retried(_get, link, peer, got_step, paced)
    except (CkptError, OSError, ValueError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        log.warning(
            "[ckpt] partner fetch of step %d from %s failed, not committed: %s",
            got_step,
            peer.node,
            reason,
        )
        link.count(fetch_failures=1, last_error=reason)
        return None
    seconds = time.monotonic() - t0
    _record(link, m, peer.node)
    link.count(fetched=1)
    log.info(
        "[ckpt] step %d of %s fetched from its partner copy on %s (%d bytes, %.3fs)",
        got_step,
        link.key,
        peer.node,
        m.total_bytes,
        seconds,
    )
    link.event("partner_fetched", step=got_step, node=peer.node, fetch_s=seconds)
    return Fetched(got_step, peer.node, m.total_bytes, seconds)


def _record(link: FetchLink, m: Manifest, node: str) -> None:
    """The fetched step is this rank's own checkpoint now: committed here, flushed when
    the warm tier lacks it (it may be the only copy left besides the holder's)."""
    if link.ledger is None:
        return
    now = link.ledger.clock()

    def fn(rec: Optional[Record]) -> Record:
        if rec is None:
            rec = Record(m.user, m.key, m.step, created_at=now)
        rec.set_state("local", State.COMMITTED, now)
        rec.nbytes, rec.job = m.total_bytes, m.job
        rec.selected_for_flush = True
        if rec.tiers.get(WARM_SLOT) not in (State.VERIFIED.value, State.FLUSHING.value):
            rec.tiers[WARM_SLOT] = State.FLUSH_PENDING
        rec.extra["fetched_from"] = node
        return rec

    try:
        link.ledger.update(m.user, m.key, m.step, fn)
    except (CkptError, OSError) as exc:
        log.warning("[ckpt] ledger: fetched step not recorded: %s", exc)
