"""Partner copies: every committed local checkpoint of a rank also lands on a partner
node's local tier, so that losing one node loses no checkpoint.

A :class:`PartnerLink` per Checkpointer runs two kinds of background threads:

* the **sender**: after each local commit (:meth:`PartnerLink.offer`) it streams that
  step, read back from the local tier, to its ring partner (:mod:`.partner_net`). One
  step at a time in a single slot: a newer commit replaces a step still waiting, never
  the one on the wire. Memory: one piece of :data:`COPY_PIECE` (256 KiB) at a time;
  bandwidth: its own cap (``[partner] bandwidth``), separate from the flush's.
* the **receiver**: a TCP server accepting authenticated peers of this job (strangers
  wait in a small pending pool with a deadline and never hold a session slot:
  :mod:`.partner_gate`; everything on the wire is encrypted: :mod:`.partner_wire`). It commits
  the copy through the local tier's writer in copy mode - the sender's manifest byte for
  byte, every chunk hashed and compared with that manifest as it arrives, the manifest
  last - under the *owner's* series key. The rest of the toolkit therefore sees a
  checkpoint of that series: the epilog/stager flush it as the owner (it is the user's
  file), restore reads it, ``list`` shows it. The ledger record says it is a partner
  copy (``extra["partner_of"]``: the node it came from) and keeps it selected for the
  flush, so a node lost mid-job costs nothing: the partner's epilog flushes it.

Only the newest ``keep_partner`` partner copies of each series are kept here (older ones
are superseded by policy; the owner still holds its own).

Nothing here may fail training: every error is logged and counted
(:class:`PartnerStats`); the save that was not copied is still on the owner's disk.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from slurm_ckpt.core.chunks import BandwidthLimiter
from slurm_ckpt.core.manifest import Manifest
from slurm_ckpt.errors import CkptError, NotFound, VerifyError
from slurm_ckpt.job.background import yielding
from slurm_ckpt.job.partner_fetch import FETCH, Fetched, fetch_own, receive_step, send_step
from slurm_ckpt.job.partner_fetch import serve as serve_fetch
from slurm_ckpt.job.partner_gate import HANDSHAKE_DEADLINE_S, Gate
from slurm_ckpt.job.partner_net import (
    Peer,
    Rendezvous,
    listening_socket,
    no_delay,
    ring_partner,
)
from slurm_ckpt.job.partner_wire import Channel, Identity, WireError, client_handshake
from slurm_ckpt.ledger.ledger import Ledger
from slurm_ckpt.ledger.record import WARM_SLOT, Record, State
from slurm_ckpt.tiers.base import Tier

log = logging.getLogger(__name__)

__all__ = ["PartnerLink", "PartnerStats"]

#: Socket timeout of one send/receive (a silent peer is given up on).
IO_TIMEOUT_S = 60.0
#: A connecting peer must have proved the job's secret within this time of ``accept``
#: (all of the handshake, however slowly it dribbles in: :mod:`.partner_gate`).
HANDSHAKE_TIMEOUT_S = HANDSHAKE_DEADLINE_S
#: How long a sender waits for every rank to publish its address.
RENDEZVOUS_TIMEOUT_S = 300.0
#: Authenticated sessions served at once (a few ranks per node send to one node); a
#: stranger never holds one (it waits in the gate's pending pool until it proves the
#: secret, and is dropped at the deadline or when newer connections need the room).
MAX_CONNECTIONS = 8
#: Bytes per system call of a background partner copy, on both ends (read, seal and send one record
#: on the sender; receive, open, hash and write on the receiver). Small on purpose: the copy runs
#: while training does, and each call is a stretch of kernel work (a loopback or NIC send, a copy
#: out of the socket, a page-cache write) that a training or collective thread waking on that core
#: waits behind. Measured on 2 cores with two lock-step gloo ranks (docs/partner.md, "Training
#: throughput"): with 4 MiB pieces a training step that overlapped the bytes of a copy took 13-16
#: ms longer (of about 20), with 256 KiB 5-7 ms (the training and gloo threads waited longer on the
#: run queue; their own CPU time per step barely changed). The extra system calls cost little (64
#: MiB is 256 of them). A fetch for a restore, which the whole job waits for, keeps ``piece``.
COPY_PIECE = 256 * 2**10

_GO, _HAVE, _NO, _OK, _FAIL = b"G", b"H", b"N", b"K", b"F"


@dataclass
class PartnerStats:
    """Counters of one link (a snapshot: a copy)."""

    sent: int = 0
    send_failures: int = 0
    send_skipped: int = 0
    bytes_sent: int = 0
    received: int = 0
    receive_failures: int = 0
    refused: int = 0
    bytes_received: int = 0
    deleted: int = 0
    #: Steps served back to their owner (a rank relaunched on a spare) and fetched here.
    served: int = 0
    fetched: int = 0
    fetch_failures: int = 0
    last_sent_step: Optional[int] = None
    last_received_step: Optional[int] = None
    last_error: Optional[str] = None
    partner: Optional[str] = None


class PartnerLink:
    """Sender and receiver of one rank's partner copies (see the module docstring)."""

    def __init__(
        self,
        local: Tier,
        ledger: Optional[Ledger],
        *,
        user: str,
        key: str,
        base_key: str,
        rank: int,
        world_size: int,
        node: str,
        job: Optional[str],
        rendezvous: Rendezvous,
        host: str,
        bind: str = "",
        bandwidth: float = 0.0,
        keep_partner: int = 2,
        piece: int = 16 * 2**20,
        copy_piece: int = COPY_PIECE,
        on_event: Optional[Any] = None,
    ) -> None:
        self.local, self.ledger = local, ledger
        self.user, self.key, self.base_key = user, key, base_key
        self.rank, self.world_size, self.node, self.job = rank, world_size, node, job
        self.rdv = rendezvous
        self.keep_partner = keep_partner
        #: Piece of a fetch served or taken for a restore (the job waits: large).
        self.piece = piece
        #: Piece of a background copy (training runs meanwhile: small; COPY_PIECE).
        self.copy_piece = max(1, min(copy_piece, piece))
        self.limiter = BandwidthLimiter(bandwidth) if bandwidth and bandwidth > 0 else None
        self.emit = on_event
        self.cv = threading.Condition()
        self._stats = PartnerStats()
        self._pending: Optional[int] = None
        self._sending: Optional[int] = None
        #: The step being fetched onto the local tier after a restore read it from its
        #: holder (:meth:`adopt`).
        self._adopting: Optional[int] = None
        self._stop = False
        #: Set at close(): a copy on the wire may finish, a wait for addresses ends.
        self._closing = False
        self._partner: Optional[Peer] = None
        self._key_re = re.compile(re.escape(base_key) + r"\.rank\d{5}")
        self._secret = self.secret = rendezvous.secret()
        #: What binds this rank's sessions (:class:`~.partner_wire.Identity`).
        self.ident = Identity(self.secret, rank, world_size, rendezvous.launch, base_key)
        self.rendezvous_timeout = RENDEZVOUS_TIMEOUT_S
        self._sock = listening_socket(bind)
        self.port = self._sock.getsockname()[1]
        #: The address published for this rank (published again by :meth:`rebind`).
        self.host = host
        rendezvous.publish(node, host, self.port)
        self._conns = threading.BoundedSemaphore(MAX_CONNECTIONS)
        #: Sessions of other kinds, by the first bytes of their first frame (the RAM
        #: tier's replication, :mod:`.ram_replica`): ``fn(channel, frame)``.
        self.handlers: Dict[bytes, Callable[[Channel, bytes], None]] = {}
        #: The partners' RAM copies held here, read as a tier (None: RAM tier off).
        self.ram_held: Optional[Any] = None
        self._retention_lock = threading.Lock()
        self._threads: List[threading.Thread] = []
        #: The accept loop's gate; its identity is the link's (:meth:`rebind` swaps both).
        self.gate = Gate(
            self._sock, self.ident, self._session, self._refused, io_timeout=IO_TIMEOUT_S
        )
        loops = (("ckpt-partner-send", self._send_loop), ("ckpt-partner-recv", self._accept_loop))
        for name, target in loops:
            # background work like the local writer's: it yields the CPU to training
            # (job/background.py); the receiver's connection threads inherit it
            t = threading.Thread(target=yielding(target), name=f"{name}-{key}", daemon=True)
            t.start()
            self._threads.append(t)

    # -- state ------------------------------------------------------------------------
    @property
    def stats(self) -> PartnerStats:
        with self.cv:
            return dataclasses.replace(self._stats)

    def count(self, **add: Any) -> None:
        """Add to the link's counters (``last_*`` and ``partner``: set them), from any
        thread; the fetch side (:mod:`.partner_fetch`) counts what it serves and takes."""
        with self.cv:
            for name, value in add.items():
                if name.startswith("last_") or name == "partner":
                    setattr(self._stats, name, value)
                else:
                    setattr(self._stats, name, getattr(self._stats, name) + value)
            self.cv.notify_all()

    def event(self, name: str, **info: Any) -> None:
        """Emit an event to the job's event log, never raising (events never break
        checkpointing)."""
        if self.emit is not None:
            try:
                self.emit(name, **info)
            except Exception:  # noqa: BLE001 - events never break checkpointing
                log.debug("[ckpt] partner event %s not logged", name, exc_info=True)

    def idle(self) -> bool:
        with self.cv:
            return self._pending is None and self._sending is None and self._adopting is None

    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        """Wait until no copy is queued or on the wire, and no fetch of an adopted step
        runs (tests, close())."""
        until = None if timeout is None else time.monotonic() + timeout
        with self.cv:
            while (
                self._pending is not None or self._sending is not None or self._adopting is not None
            ):
                left = None if until is None else until - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.cv.wait(left if left is not None else 1.0)
            return True

    # -- sender -----------------------------------------------------------------------
    def offer(self, step: int) -> None:
        """A step was committed locally: copy it to the partner (newest wins the slot)."""
        with self.cv:
            if self._pending is not None:
                self._stats.send_skipped += 1
            self._pending = step
            self.cv.notify_all()

    def _send_loop(self) -> None:
        while True:
            with self.cv:
                while self._pending is None and not self._stop:
                    self.cv.wait()
                if self._stop:
                    return
                step, self._pending = self._pending, None
                self._sending = step
            try:
                self._send(step)
            except Exception as exc:  # noqa: BLE001 - a failed copy never fails training
                reason = " ".join(str(exc).split()) or type(exc).__name__
                if not isinstance(exc, (CkptError, OSError)):
                    log.exception("[ckpt] step=%d: unexpected error in the partner copy", step)
                log.warning("[ckpt] step=%d: partner copy failed: %s", step, reason)
                self._partner = None  # look the addresses up again next time
                self.count(send_failures=1, last_error=reason)
                self.event("partner_failed", step=step, error=reason)
            finally:
                with self.cv:
                    self._sending = None
                    self.cv.notify_all()

    def forget_target(self) -> None:
        """Look the partner's address up again before the next copy (it failed)."""
        self._partner = None

    def target(self) -> Optional[Peer]:
        """The ring partner copies (disk and RAM) go to (None: one node)."""
        if self._partner is None:
            peers = self.rdv.peers(RENDEZVOUS_TIMEOUT_S, stop=lambda: self._closing)
            self._partner = ring_partner(peers, self.rank)
            if self._partner is not None:
                p = self._partner
                self.count(partner=f"rank {p.rank} on {p.node}")
                log.info("[ckpt] partner copies go to rank %d on %s", p.rank, p.node)
        return self._partner

    def _send(self, step: int) -> None:
        peer = self.target()
        if peer is None:
            return  # one node: nowhere to send to
        t0 = time.monotonic()
        with self.local.reader(self.user, self.key, step) as reader:
            m = reader.manifest
            sock = no_delay(socket.create_connection((peer.host, peer.port), IO_TIMEOUT_S))
            with sock:
                sock.settimeout(IO_TIMEOUT_S)
                ch = client_handshake(sock, self.ident, peer.rank, HANDSHAKE_TIMEOUT_S)
                ch.send_frame(reader.manifest_bytes)
                answer = ch.recv_exact(1)
                if answer == _HAVE:
                    return
                if answer != _GO:
                    raise WireError(f"partner refused step {step}: {_reason(ch)}")
                send_step(ch, reader, self.copy_piece, self.limiter)
                answer = ch.recv_exact(1)
                if answer != _OK:
                    raise WireError(f"partner did not commit step {step}: {_reason(ch)}")
        seconds = time.monotonic() - t0
        self.count(sent=1, bytes_sent=m.total_bytes, last_sent_step=step)
        self.event("partner_done", step=step, partner_s=seconds, node=peer.node)
        log.info("[ckpt] step=%d partner copy on %s in %.3fs", step, peer.node, seconds)

    # -- receiver ---------------------------------------------------------------------
    def _accept_loop(self) -> None:
        self.gate.run(lambda: self._stop)

    def rebind(self, launch: str) -> None:
        """Bind every later session to ``launch`` (in-job recovery: a new membership
        epoch, :mod:`slurm_ckpt.job.recovery`): this rank's address is published again
        under it, handshakes of any other launch are refused both ways (a process of an
        older epoch can neither serve this rank nor reach it), and the partner's address
        is looked up again (a spare took a rank's place)."""
        self.rdv.launch = launch
        self.ident = dataclasses.replace(self.ident, launch=launch)
        self.gate.ident = self.ident
        self.rdv.publish(self.node, self.host, self.port)
        self.forget_target()

    def _refused(self, reason: str) -> None:
        self.count(refused=1)
        log.warning("[ckpt] partner connection refused: %s", reason)

    def _session(self, ch: Channel, peer_rank: int) -> bool:
        """An authenticated peer: served on a thread of its own if a slot is free."""
        if not self._conns.acquire(blocking=False):
            return False  # too many at once: the sender retries with its next step
        try:
            threading.Thread(
                target=self._serve, args=(ch,), name="ckpt-partner-conn", daemon=True
            ).start()
        except BaseException:
            self._conns.release()
            raise
        return True

    def _serve(self, conn: Channel) -> None:
        step: Optional[int] = None
        try:
            with conn:
                mbytes = conn.recv_frame()
                if mbytes.startswith(FETCH):
                    try:
                        serve_fetch(self, conn, mbytes)
                    except (CkptError, OSError) as exc:
                        reason = " ".join(str(exc).split()) or type(exc).__name__
                        log.warning("[ckpt] partner fetch request not served: %s", reason)
                    return
                handler = next((h for p, h in self.handlers.items() if mbytes.startswith(p)), None)
                if handler is not None:
                    handler(conn, mbytes)
                    return
                m = Manifest.from_bytes(mbytes, "partner manifest")
                step = m.step
                why = self._refusal(m)
                if why is not None:
                    self.count(refused=1)
                    conn.sendall(_NO)
                    conn.send_frame(why.encode())
                    log.warning("[ckpt] partner copy of %s/%d refused: %s", m.key, m.step, why)
                    return
                if self._present(m, mbytes):
                    conn.sendall(_HAVE)
                    return
                conn.sendall(_GO)
                try:
                    self._receive(conn, m)
                except Exception as exc:
                    with contextlib.suppress(OSError, CkptError):
                        conn.sendall(_FAIL)
                        conn.send_frame(" ".join(str(exc).split())[:500].encode())
                    raise
                # Recorded (ledger, retention) before the sender hears of it: once its
                # copy is acknowledged, this node's books already say so.
                self._after_commit(m)
                conn.sendall(_OK)
        except Exception as exc:  # noqa: BLE001 - a bad peer never hurts this rank
            reason = " ".join(str(exc).split()) or type(exc).__name__
            if not isinstance(exc, (CkptError, OSError)):
                log.exception("[ckpt] unexpected error receiving a partner copy")
            log.warning("[ckpt] partner copy (step %s) not received: %s", step, reason)
            self.count(receive_failures=1, last_error=reason)
        finally:
            self._conns.release()

    def _refusal(self, m: Manifest) -> Optional[str]:
        """Why this manifest is no partner copy for us to take (None: take it)."""
        if m.user != self.user:
            return "another user's checkpoint"
        if m.key == self.key or not self._key_re.fullmatch(m.key):
            return "not a rank series of this job's checkpoint"
        if m.meta.get("base_key") != self.base_key:
            return "not a rank series of this job's checkpoint"
        free = self.local.free_bytes()
        if free is not None and free < m.total_bytes:
            return "not enough space on the partner's local tier"
        return None

    def _present(self, m: Manifest, mbytes: bytes) -> bool:
        """Already here (identical), or a stale different copy of the step is removed."""
        try:
            have = self.local.manifest_bytes(m.user, m.key, m.step)
        except NotFound:
            return False
        except VerifyError:
            have = b""
        if have == mbytes:
            return True
        # Another timeline's copy of this step (the owner restored from an older one and
        # came back here): the owner's newer commit supersedes it.
        self.local.delete(m.user, m.key, m.step)
        return False

    def _receive(self, conn: Channel, m: Manifest) -> None:
        """Stream every file in, chunk digests checked against the manifest; commit."""
        receive_step(conn, self.local, m, self.copy_piece)

    def refuse_series(self, key: str) -> Optional[str]:
        """Why a fetch of ``key`` is not served here (None: serve it): only the other
        rank series of this job's checkpoint."""
        if key == self.key or not self._key_re.fullmatch(key):
            return "not a rank series of this job's checkpoint"
        return None

    def fetch(self, step: Optional[int] = None) -> Optional[Fetched]:
        """Bring this rank's newest step (or ``step``) over from the rank holding its
        partner copy onto the local tier (:mod:`.partner_fetch`); None if none did."""
        return fetch_own(self, step)

    def adopt(self, step: int) -> None:
        """After a restore read ``step`` straight from the rank holding it
        (:mod:`.partner_tier`): fetch it onto this node's local tier in the background,
        within the copies' cap, so that two copies of the step exist again and this
        node's books owe its flush. The job trains meanwhile; close() waits for it."""
        with self.cv:
            if self._adopting is not None or self._stop or self._closing:
                return
            self._adopting = step
        threading.Thread(
            target=self._adopt, args=(step,), name="ckpt-partner-adopt", daemon=True
        ).start()

    def _adopt(self, step: int) -> None:
        try:
            fetch_own(self, step, paced=True)
        except Exception:  # noqa: BLE001 - never fails training
            log.exception("[ckpt] unexpected error fetching step %d onto this node", step)
        finally:
            with self.cv:
                self._adopting = None
                self.cv.notify_all()

    def _after_commit(self, m: Manifest) -> None:
        self.count(received=1, bytes_received=m.total_bytes, last_received_step=m.step)
        if self.ledger is not None:
            try:
                self.ledger.update(m.user, m.key, m.step, _partner_record(m, self.ledger))
            except (CkptError, OSError) as exc:
                log.warning("[ckpt] ledger: partner copy not recorded: %s", exc)
        self.event("partner_received", step=m.step, key=m.key, source=m.node or "")
        self._retain(m.key)

    # -- retention --------------------------------------------------------------------
    def _retain(self, key: str) -> None:
        """Keep the newest ``keep_partner`` partner copies of ``key``; older ones are
        superseded (the owner holds its own, the flush takes the newest)."""
        with self._retention_lock:
            try:
                infos = sorted(self.local.steps(self.user, key), key=lambda i: i.step)
                for info in infos[: max(0, len(infos) - self.keep_partner)]:
                    step = info.step
                    if not self._is_partner_copy(key, step, info.manifest.node):
                        continue
                    self.local.delete(self.user, key, step)
                    self.count(deleted=1)
                    if self.ledger is not None:
                        self.ledger.update(self.user, key, step, _deleted)
            except (CkptError, OSError) as exc:
                log.warning("[ckpt] partner retention failed: %s", exc)

    def _is_partner_copy(self, key: str, step: int, written_on: Optional[str]) -> bool:
        """A copy retention may drop: marked as a partner copy, or verified on the PFS.
        Another rank's checkpoint without a record is one only if another node wrote it
        (one written here, by an earlier job, may be the only copy: kept)."""
        rec = None if self.ledger is None else self.ledger.get(self.user, key, step)
        if rec is None:
            return written_on is not None and written_on != self.node
        return bool(rec.extra.get("partner_of")) or rec.tiers.get(WARM_SLOT) == State.VERIFIED

    # -- the end ----------------------------------------------------------------------
    def close(self, timeout: Optional[float] = 30.0) -> None:
        """Finish the copy on the wire (bounded), stop serving, withdraw the address."""
        self._closing = True
        self.wait_idle(timeout)
        with self.cv:
            self._stop = True
            self.cv.notify_all()
        with contextlib.suppress(OSError):
            self._sock.close()
        for t in self._threads:
            t.join(timeout=2.0)
        self.rdv.withdraw()


def _reason(ch: Channel) -> str:
    try:
        return ch.recv_frame(4096).decode("utf-8", "replace")
    except (CkptError, OSError):
        return "no reason given"


def _partner_record(m: Manifest, ledger: Ledger) -> Any:
    now = ledger.clock()

    def fn(rec: Optional[Record]) -> Record:
        if rec is None:
            rec = Record(m.user, m.key, m.step, created_at=now)
        rec.set_state("local", State.COMMITTED, now)
        rec.nbytes = m.total_bytes
        rec.job = m.job
        # Selected: the epilog (or stager) of this node flushes it unless the PFS has
        # it verified already - the whole point when the owner's node is gone.
        rec.selected_for_flush = True
        if rec.tiers.get(WARM_SLOT) not in (State.VERIFIED.value, State.FLUSHING.value):
            rec.tiers[WARM_SLOT] = State.FLUSH_PENDING
        rec.extra["partner_of"] = m.node or "?"
        return rec

    return fn


def _deleted(rec: Optional[Record]) -> Optional[Record]:
    if rec is None:
        return None
    rec.tiers["local"] = State.DELETED
    return rec
