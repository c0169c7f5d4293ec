"""RAM snapshots of a rank, taken at its own interval and replicated into the partner's
memory over the partner link (the RAM tier's moving part; the store is
:mod:`slurm_ckpt.job.ram_tier`).

* **The snapshot** (caller's thread, :meth:`RamCopies.save`): the state is copied into
  one of the rank's own RAM slots (the staging copy of :mod:`.staging`: preallocated,
  reused, several threads for big tensors). That copy is all training waits for.
* **The commit and the copy** (one background thread): the slot's files are hashed per
  chunk into a manifest (:func:`.ram_tier.manifest_of`) and committed into the store:
  from then on the restore can read it. Then the same bytes, with the same manifest,
  go to the ring partner (:func:`.partner_net.ring_partner`) over the job's
  authenticated, encrypted transport: one connection kept open (the handshake of
  :mod:`.partner_wire` once, bound to both ranks, the launch and the series; then a
  manifest frame and the payload per snapshot, every byte sealed into AES-GCM records
  like any partner copy), in pieces of :data:`.partner.COPY_PIECE` as the disk copies.
* **The holder** (the partner's receiver, :meth:`RamCopies.serve_put`): it refuses what
  is not a rank series of this job, receives straight into one of its slots for that
  series, hashes every chunk on arrival against the manifest and commits only a copy
  whose every chunk matched. At most ``keep`` listed per series, ``keep + 1`` slots.
* **The interval** (:class:`Interval`): every N calls, or ``"auto"``: the cost of a
  snapshot (the caller's stall, the background thread's CPU time, and the CPU time a
  received copy costs the holder) and the wall time of its copy are measured, and the
  interval set to the smallest N that keeps the cost within ``budget`` of N steps and
  lets each copy end before the next is due (in ``"auto"`` a snapshot due while the
  previous one's copy still runs waits for it).
* **Cannot keep up**: a snapshot is never dropped silently. When a newer snapshot
  arrives while the previous one still waits for its copy, the older one is superseded:
  counted (``behind``), an event (``ram_behind``) and a warning in the log (at most one
  line per :data:`WARN_EVERY_S`, with the count). A snapshot that finds no slot (all
  pinned) or no memory is counted (``not_taken``) and reported the same way.

Nothing here fails training: errors are logged, counted and reported in the stats.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import math
import socket
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, Optional

import psutil

from slurm_ckpt.core.chunks import BandwidthLimiter
from slurm_ckpt.core.hashing import chunk_digest
from slurm_ckpt.core.manifest import Manifest
from slurm_ckpt.errors import CkptError, VerifyError
from slurm_ckpt.job.background import yielding
from slurm_ckpt.job.options import RamOptions
from slurm_ckpt.job.partner import COPY_PIECE, HANDSHAKE_TIMEOUT_S, PartnerLink
from slurm_ckpt.job.partner_net import no_delay
from slurm_ckpt.job.partner_wire import Channel, WireError, client_handshake
from slurm_ckpt.job.ram_tier import RamStore, RamTier, Slot, manifest_of
from slurm_ckpt.job.staging import StagingArea
from slurm_ckpt.job.state import STATE_FORMAT, flatten, index_bytes, layout

log = logging.getLogger(__name__)

__all__ = ["RAMPUT", "Interval", "RamCopies", "RamStats"]

#: First bytes of the frame that opens a RAM replication session (a disk copy's first
#: frame is a manifest, a fetch's ``FETCH1``).
RAMPUT = b"RAMPUT1\n"
#: A replication session idle this long is closed by the holder (the sender opens a new
#: one for its next snapshot).
IDLE_S = 300.0
#: Socket timeout of one send or receive within a snapshot's copy.
IO_TIMEOUT_S = 60.0
#: At most one "cannot keep up" warning line per this many seconds (each one counted).
WARN_EVERY_S = 30.0
#: Step times the interval's median is taken over.
STEP_WINDOW = 32

_GO, _NO, _OK, _FAIL = b"G", b"N", b"K", b"F"


class Refused(WireError):
    """The holder refused one snapshot (the session stays open)."""


@dataclass
class RamStats:
    """Counters of the RAM tier (a copy; also in ``Checkpointer.stats`` as ``ram_*``)."""

    snapshots: int = 0
    not_taken: int = 0
    replicated: int = 0
    behind: int = 0
    replica_failures: int = 0
    received: int = 0
    receive_failures: int = 0
    refused: int = 0
    every: int = 1
    step_s: Optional[float] = None
    cost_s: Optional[float] = None
    copy_s: Optional[float] = None
    held_own: int = 0
    held_partner: int = 0
    bytes_own: int = 0
    bytes_partner: int = 0
    allocations: int = 0
    last_step: Optional[int] = None
    last_replicated_step: Optional[int] = None
    last_received_step: Optional[int] = None
    last_error: Optional[str] = None


class Interval:
    """Every ``every`` calls, or (``"auto"``) as often as ``budget`` of step time allows."""

    def __init__(self, every: Any, budget: float) -> None:
        self.fixed: Optional[int] = None if every == "auto" else int(every)
        self.budget = float(budget)
        self.k = self.fixed or 1
        self.since: Optional[int] = None  # calls since the last snapshot (None: none yet)
        self._last: Optional[float] = None
        self._steps: Deque[float] = collections.deque(maxlen=STEP_WINDOW)
        self.cost_s: Optional[float] = None
        self.copy_s: Optional[float] = None

    @property
    def step_s(self) -> Optional[float]:
        return statistics.median(self._steps) if self._steps else None

    def tick(self, now: float) -> bool:
        """One call at a step boundary: whether a snapshot is due now."""
        if self._last is not None:
            self._steps.append(now - self._last)
        self._last = now
        if self.since is None:
            return True
        self.since += 1
        return self.since >= self.k

    def taken(self) -> None:
        self.since = 0

    def measured(self, cost_s: float, copy_s: float) -> int:
        """One snapshot's cost (stall + background CPU) and its copy's wall time; returns
        the interval from now on."""
        a = 0.3
        self.cost_s = cost_s if self.cost_s is None else (1 - a) * self.cost_s + a * cost_s
        self.copy_s = copy_s if self.copy_s is None else (1 - a) * self.copy_s + a * copy_s
        step = self.step_s
        if self.fixed is None and step:
            # (less a hair: 0.01 / (0.02 * 0.1) is 5.000000000000001 in floats)
            by_budget = math.ceil(self.cost_s / (self.budget * step) - 1e-9)
            by_copy = math.ceil(self.copy_s / step - 1e-9)
            self.k = max(1, by_budget, by_copy)
        return self.k


@dataclass
class _Pending:
    slot: Slot
    step: int
    tokens: Optional[int]
    meta: Dict[str, Any]
    stall_s: float


class RamCopies:
    """One rank's RAM tier: its own snapshots, their replication, and the copies it holds
    for its partner (see the module docstring)."""

    def __init__(
        self,
        opts: RamOptions,
        *,
        user: str,
        key: str,
        base_key: str,
        prefix: str,
        rank: int,
        world_size: int,
        job: Optional[str],
        node: str,
        chunk_size: int,
        staging_limit: int = 0,
        link: Optional[PartnerLink] = None,
        on_event: Optional[Callable[..., None]] = None,
    ) -> None:
        self.opts = opts
        self.user, self.key, self.base_key, self.prefix = user, key, base_key, prefix
        self.rank, self.world_size, self.job, self.node = rank, world_size, job, node
        self.chunk_size = chunk_size
        self.staging_limit = staging_limit
        self.own = RamStore(opts.keep, max_series=1)
        self.held = RamStore(opts.keep)
        self.tier = RamTier(self.own, user)
        #: The link the copies go over (None: not replicated) and the one this rank holds
        #: its partner's copies through (partner copies on: always).
        self.link = link if opts.replicate else None
        self.partner_link = link
        if link is not None:
            # The holder's side is served whether or not this rank replicates its own.
            link.ram_held = RamTier(self.held, user, name="ram-held")
            link.handlers[RAMPUT] = self.serve_put
        self.interval = Interval(opts.every, opts.budget)
        self.limiter = BandwidthLimiter(opts.bandwidth) if opts.bandwidth else None
        self.emit = on_event
        self.cv = threading.Condition()
        self._stats = RamStats(every=self.interval.k)
        self._pending: Optional[_Pending] = None
        self._busy = False
        self._stop = False
        self._conn: Optional[Channel] = None
        #: The launch tag (membership epoch included) the kept session was opened under.
        self._conn_launch = ""
        #: CPU seconds the last received copy cost this rank (its holder's side).
        self._recv_cpu = 0.0
        self._warned = 0.0
        self._unwarned = 0
        self._thread = threading.Thread(
            target=yielding(self._loop), name=f"ckpt-ram-{key}", daemon=True
        )
        self._thread.start()

    # -- state -------------------------------------------------------------------------
    @property
    def stats(self) -> RamStats:
        with self.cv:
            s = dataclasses.replace(self._stats)
        s.held_own, s.bytes_own = self.own.held()
        s.held_partner, s.bytes_partner = self.held.held()
        s.allocations = self.own.allocations + self.held.allocations
        s.step_s, s.cost_s, s.copy_s = (
            self.interval.step_s,
            self.interval.cost_s,
            self.interval.copy_s,
        )
        return s

    def _count(self, **add: Any) -> None:
        with self.cv:
            for name, value in add.items():
                if name.startswith("last_") or name == "every":
                    setattr(self._stats, name, value)
                else:
                    setattr(self._stats, name, getattr(self._stats, name) + value)

    def _event(self, name: str, **info: Any) -> None:
        if self.emit is not None:
            try:
                self.emit(name, **info)
            except Exception:  # noqa: BLE001 - events never break checkpointing
                log.debug("[ckpt] ram event %s not logged", name, exc_info=True)

    def _report(self, what: str, step: int, **info: Any) -> None:
        """A snapshot that will not be replicated (or taken): event always, a log line at
        most every WARN_EVERY_S (with the count since the last one)."""
        self._event(what, step=step, **info)
        self._unwarned += 1
        now = time.monotonic()
        if now - self._warned >= WARN_EVERY_S:
            s = self.stats
            log.warning(
                "[ckpt] RAM tier cannot keep up: step %d %s (%d such since the last line; "
                "%d behind, %d not taken in all; interval every %d steps)",
                step,
                "superseded before its copy" if what == "ram_behind" else "not taken",
                self._unwarned,
                s.behind,
                s.not_taken,
                s.every,
            )
            self._warned, self._unwarned = now, 0

    def idle(self) -> bool:
        with self.cv:
            return self._pending is None and not self._busy

    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        """Until no snapshot waits for its commit or copy (tests, benchmarks, close())."""
        until = None if timeout is None else time.monotonic() + timeout
        with self.cv:
            while self._pending is not None or self._busy:
                left = None if until is None else until - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.cv.wait(1.0 if left is None else min(left, 1.0))
            return True

    # -- the snapshot (caller's thread) ------------------------------------------------
    def save(
        self, state: Any, step: int, tokens: Optional[int], meta: Dict[str, Any], force: bool
    ) -> bool:
        """Called at every step boundary: take a snapshot when the interval says so (or
        ``force``); returns whether one was taken."""
        t0 = time.monotonic()
        due = self.interval.tick(t0)
        if not (due or force):
            return False
        if not force and self.interval.fixed is None and not self.idle():
            return False  # "auto": the next one when the copy before it is done
        self.interval.taken()
        if callable(state):  # built only now that a snapshot is due
            state = state()
        slot = self.own.begin(self.key, step)
        if slot is None:
            with self.cv:
                old, self._pending = self._pending, None
            if old is not None:
                self._supersede(old, step)
                slot = self.own.begin(self.key, step)
        if slot is None:
            self._count(not_taken=1)
            self._report("ram_not_taken", step, reason="every buffer in use")
            return False
        try:
            filled = self._fill(slot, state, step)
        except BaseException:  # a state that cannot be snapshotted: the caller's error
            self.own.abandon(slot)
            raise
        if not filled:
            self.own.abandon(slot)
            self._count(not_taken=1)
            self._report("ram_not_taken", step, reason="does not fit the memory limit")
            return False
        pend = _Pending(slot, step, tokens, meta, time.monotonic() - t0)
        with self.cv:
            old, self._pending = self._pending, pend
            self.cv.notify_all()
        if old is not None:
            self._supersede(old, step)
        return True

    def _fill(self, slot: Slot, state: Any, step: int) -> bool:
        index, tensors = flatten(state)
        blobs = layout(index)
        sizes = [b["nbytes"] for b in blobs]
        if slot.area is None:
            slot.area = StagingArea(self.staging_limit)
        area = slot.area
        if not area.ensure(sizes, tensors):
            return False
        if slot.blob_sizes != sizes:  # allocated afresh (a new layout): counted
            slot.blob_sizes = sizes
            self.own.counted()
        views = area.snapshot(index, tensors)
        files = {f"{self.prefix}/{n}": memoryview(v).cast("B") for n, v in views.items()}
        files[f"{self.prefix}/index.json"] = memoryview(index_bytes(index))
        slot.files = files
        return True

    def _supersede(self, old: _Pending, newer: int) -> None:
        self.own.abandon(old.slot)
        self._count(behind=1)
        self._report("ram_behind", old.step, newer=newer)

    # -- commit and copy (background thread) -------------------------------------------
    def _loop(self) -> None:
        while True:
            with self.cv:
                while self._pending is None and not self._stop:
                    self.cv.wait()
                if self._pending is None:
                    return
                pend, self._pending = self._pending, None
                self._busy = True
            try:
                self._commit_and_copy(pend)
            except Exception:  # noqa: BLE001 - never fails training
                log.exception("[ckpt] step=%d: unexpected error in the RAM tier", pend.step)
            finally:
                with self.cv:
                    self._busy = False
                    self.cv.notify_all()

    def _commit_and_copy(self, pend: _Pending) -> None:
        cpu0, t0 = time.thread_time(), time.monotonic()
        meta = dict(pend.meta)
        meta.update(
            rank=self.rank,
            world_size=self.world_size,
            base_key=self.base_key,
            reason="ram",
            state_format=STATE_FORMAT,
        )
        m = manifest_of(
            pend.slot.files,
            user=self.user,
            key=self.key,
            step=pend.step,
            tokens=pend.tokens,
            job=self.job,
            node=self.node,
            meta=meta,
            chunk_size=self.chunk_size,
        )
        mbytes = m.to_bytes()
        self.own.commit(pend.slot, m, mbytes)
        self._count(snapshots=1, last_step=pend.step)
        t1 = time.monotonic()
        try:
            if self.link is not None:
                self._replicate(pend.slot, m, mbytes)
        except (CkptError, OSError) as exc:
            reason = " ".join(str(exc).split()) or type(exc).__name__
            log.warning("[ckpt] step=%d: RAM copy to the partner failed: %s", pend.step, reason)
            self._count(replica_failures=1, last_error=reason)
            self._event("ram_replica_failed", step=pend.step, error=reason)
        finally:
            self.own.unpin(pend.slot)
        # The cost: training's stall, this thread's CPU, and the CPU the partner spends
        # receiving (measured here as the holder of the partner's copies: the ring
        # makes them alike), all taken from cores training could use.
        cost = pend.stall_s + (time.thread_time() - cpu0) + self._recv_cpu
        k = self.interval.measured(cost, time.monotonic() - t1 + (t1 - t0))
        with self.cv:
            changed = k != self._stats.every
            self._stats.every = k
        if changed:
            self._event("ram_interval", every=k, cost_s=round(cost, 6))

    def _connect(self) -> Optional[Channel]:
        assert self.link is not None
        peer = self.link.target()
        if peer is None:
            return None  # one node: nowhere to send to
        s = no_delay(socket.create_connection((peer.host, peer.port), timeout=IO_TIMEOUT_S))
        try:
            s.settimeout(IO_TIMEOUT_S)
            ch = client_handshake(s, self.link.ident, peer.rank, HANDSHAKE_TIMEOUT_S)
            ch.send_frame(RAMPUT + json.dumps({"key": self.key}).encode())
        except BaseException:
            s.close()
            raise
        self._conn_launch = self.link.ident.launch
        return ch

    def drop_session(self) -> None:
        """End the kept replication session now, waking a copy blocked on it: in-job
        recovery re-formed the job (its holder may be gone or stopped; the next snapshot
        goes to the partner of the new membership)."""
        conn = self._conn
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)

    def _launch(self) -> str:
        link = self.partner_link
        return link.ident.launch if link is not None else ""

    def _drop_conn(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _replicate(self, slot: Slot, m: Manifest, mbytes: bytes) -> None:
        assert self.link is not None
        if self._conn is not None and self._conn_launch != self.link.ident.launch:
            self._drop_conn()  # opened under an older membership epoch: its holder is gone
        for attempt in (0, 1):
            fresh = self._conn is None
            if fresh:
                try:
                    self._conn = self._connect()
                except (CkptError, OSError):
                    self.link.forget_target()  # look the addresses up again next time
                    raise
                if self._conn is None:
                    return
            assert self._conn is not None
            try:
                self._send(self._conn, slot, m, mbytes)
            except Refused:
                raise
            except (CkptError, OSError):
                self._drop_conn()
                if fresh or attempt:
                    self.link.forget_target()
                    raise
                continue  # a kept connection that went stale: once more, on a new one
            self._count(replicated=1, last_replicated_step=m.step)
            return

    def _send(self, s: Channel, slot: Slot, m: Manifest, mb: bytes) -> None:
        """One snapshot over the open session: its manifest, then (once the holder said
        go) its payload, sealed into records by the channel like every partner copy."""
        s.send_frame(mb)
        answer = s.recv_exact(1)
        if answer == _NO:
            raise Refused(f"partner refused step {m.step}: {_reason(s)}")
        if answer != _GO:
            raise WireError(f"partner answered {answer!r} to step {m.step}")
        for e in m.files:
            view = slot.files[e.path]
            for pos in range(0, e.size, COPY_PIECE):
                piece = view[pos : pos + COPY_PIECE]
                if self.limiter is not None:
                    self.limiter.acquire(len(piece))
                s.sendall(piece)
        answer = s.recv_exact(1)
        if answer != _OK:
            raise WireError(f"partner did not keep step {m.step}: {_reason(s)}")

    # -- the holder (the partner link's connection thread) -----------------------------
    def serve_put(self, conn: Channel, first: bytes) -> None:
        """One replication session from a peer (authenticated by the link): snapshots
        until the peer hangs up, each verified chunk by chunk before it is committed.
        A peer speaking wrongly or gone mid-answer ends the session (counted here)."""
        try:
            self._put_session(conn)
        except (CkptError, OSError) as exc:
            reason = " ".join(str(exc).split()) or type(exc).__name__
            self._count(receive_failures=1, last_error=reason)
            log.warning("[ckpt] RAM copy session ended: %s", reason)

    def _put_session(self, conn: Channel) -> None:
        conn.settimeout(IDLE_S)
        bound = self._launch()
        while True:
            try:
                mbytes = conn.recv_frame()
            except (WireError, OSError):
                return  # the sender went away or stayed idle: it reconnects when it sends
            if not mbytes or self._launch() != bound:
                # A session of an older membership epoch (in-job recovery): its sender may
                # be a fenced process, whose copies this rank must never take.
                return
            conn.settimeout(IO_TIMEOUT_S)
            m = Manifest.from_bytes(mbytes, "RAM copy manifest")
            why = self._refusal(m)
            slot = self.held.begin(m.key, m.step) if why is None else None
            if why is None and slot is None:
                why = "every RAM slot of this series is in use, or too many series held"
            if slot is not None and m.total_bytes - slot.nbytes > _spare_memory():
                self.held.abandon(slot)  # new memory needed, and more than it can spare
                slot, why = None, "not enough memory on the partner"
            if why is not None or slot is None:
                self._count(refused=1)
                conn.sendall(_NO)
                conn.send_frame((why or "refused").encode())
                log.warning("[ckpt] RAM copy of %s/%d refused: %s", m.key, m.step, why)
                conn.settimeout(IDLE_S)
                continue
            cpu0 = time.thread_time()
            try:
                self.held.allocate(slot, {e.path: e.size for e in m.files})
                conn.sendall(_GO)
                _receive_into(conn, slot, m)
            except BaseException as exc:
                self.held.abandon(slot)
                reason = " ".join(str(exc).split()) or type(exc).__name__
                self._count(receive_failures=1, last_error=reason)
                self._event("ram_receive_failed", step=m.step, key=m.key, error=reason)
                log.warning("[ckpt] RAM copy of %s/%d not kept: %s", m.key, m.step, reason)
                with contextlib.suppress(OSError, CkptError):
                    conn.sendall(_FAIL)
                    conn.send_frame(reason[:500].encode())
                return  # the stream is out of step: the sender opens a new session
            self._recv_cpu = time.thread_time() - cpu0
            self.held.commit(slot, m, mbytes)
            self.held.unpin(slot)
            self._count(received=1, last_received_step=m.step)
            conn.sendall(_OK)
            conn.settimeout(IDLE_S)

    def _refusal(self, m: Manifest) -> Optional[str]:
        link = self.partner_link
        if m.user != self.user:
            return "another user's snapshot"
        if link is not None and link.refuse_series(m.key) is not None:
            return "not a rank series of this job's checkpoint"
        if m.meta.get("base_key") != self.base_key:
            return "not a rank series of this job's checkpoint"
        return None

    # -- the end -----------------------------------------------------------------------
    def close(self, timeout: Optional[float] = 30.0) -> None:
        """Commit and copy what is pending (bounded), end the session, free the memory."""
        self.wait_idle(timeout)
        with self.cv:
            self._stop = True
            self.cv.notify_all()
        self._thread.join(timeout=5.0)
        conn = self._conn
        if conn is not None:
            with contextlib.suppress(OSError, CkptError):
                conn.send_frame(b"")
        self._drop_conn()
        self.own.close()
        self.held.close()


def _receive_into(conn: Channel, slot: Slot, m: Manifest) -> None:
    """Every file of ``m`` into ``slot``, each chunk hashed against the manifest as soon
    as it is in (a mismatch raises before the next chunk is taken). The channel opens
    each record straight into the slot when it fits (no copy besides the decryption)."""
    cs = m.chunk_size
    for e in m.files:
        view = slot.files[e.path]
        for ci, digest in enumerate(e.chunks):
            off, end = ci * cs, min(e.size, (ci + 1) * cs)
            pos = off
            while pos < end:
                pos += conn.recv_into(view[pos:end], min(COPY_PIECE, end - pos))
            if chunk_digest(view[off:end]) != digest:
                raise VerifyError(f"{e.path}: bytes {off}-{end} do not match the manifest")


def _spare_memory() -> int:
    """Bytes a holder may newly allocate for a copy: half the available memory."""
    return int(psutil.virtual_memory().available // 2)


def _reason(s: Channel) -> str:
    try:
        return s.recv_frame(4096).decode("utf-8", "replace")
    except (CkptError, OSError):
        return "no reason given"
