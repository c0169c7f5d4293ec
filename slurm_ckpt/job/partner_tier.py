"""The partner's disk, read as a tier: a rank relaunched on a spare restores straight from
the node holding its partner copy.

Why a tier and not a fetch first: fetching the step onto the spare's local tier and then
restoring it from there costs, before the job trains again, fresh memory twice (the
spare's copy and the restored tensors), two passes of hashing and a write the restore
does not need. Read as a tier, the restore goes through the same
:class:`~slurm_ckpt.job.state_reader.StateReader` as the PFS or the object store:

* every hash chunk of every blob is one **ranged request** (a frame on the job's
  authenticated, encrypted transport, :mod:`.partner_wire`), answered by the holder with
  exactly those bytes (sealed records, :func:`.partner_fetch.send_range`);
* the bytes are received **straight into the fresh memory** the restored tensors are
  views of, and hashed against the (authenticated) manifest by the thread that received
  them, while the other connections are still receiving: the verification is the read;
* a copy that fails verification, a holder that went away mid-read, a holder that holds
  nothing: the restore goes on as for any tier, with the same step from the next tier or
  an older step (the agreement across ranks is unchanged: this tier's steps count like
  any other tier's).

Who holds the copy: the ring the copies went round was built over the job's old node
set, so the tier asks every other rank of the relaunched step (nearest in rank order
first) which steps of this rank's series it holds, with their manifests; the first
holder of a step is the one read.

The spare's own copy of the restored step, so that two copies exist again, is taken
after the restore, in the background and within the copies' bandwidth cap
(:meth:`~slurm_ckpt.job.partner.PartnerLink.adopt`); the job trains meanwhile.

A partner copy is the holder's file: this rank never deletes it, and a copy found bad
here is logged, not marked in this node's ledger (it is not this node's copy).
"""

from __future__ import annotations

import json
import logging
import threading
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from slurm_ckpt.core.manifest import Manifest
from slurm_ckpt.errors import CkptError, NotFound, TierError, VerifyError
from slurm_ckpt.job.partner_fetch import (
    RANGE,
    ask,
    check_own,
    connect,
    others_nearest_first,
    retried,
)
from slurm_ckpt.job.partner_net import Peer
from slurm_ckpt.job.partner_wire import Channel, WireError
from slurm_ckpt.tiers.base import StepInfo

if TYPE_CHECKING:  # pragma: no cover - the link is built above this module
    from slurm_ckpt.job.partner import PartnerLink

log = logging.getLogger(__name__)

__all__ = ["PARTNER", "PARTNER_RAM", "STREAMS", "PartnerTier"]

#: The tier's name (``Restored.tier``, ``RESUMED ... tier=partner``).
PARTNER = "partner"
#: The same over the RAM copies the other ranks hold (:mod:`.ram_replica`).
PARTNER_RAM = "partner-ram"
#: Connections one restore keeps open to the holder (each carries one ranged request at
#: a time; the holder serves a few connections at once, see ``partner.MAX_CONNECTIONS``).
STREAMS = 4

_Conn = Channel


class PartnerTier:
    """This rank's own series as the other ranks of the step hold it (read only)."""

    name = PARTNER

    def __init__(self, link: PartnerLink, ram: bool = False) -> None:
        """``ram``: the holders' RAM copies (tier ``partner-ram``), not their disks."""
        self.link = link
        self.src = "ram" if ram else "disk"
        self.name = PARTNER_RAM if ram else PARTNER
        self._listed: Optional[Dict[int, Tuple[Peer, Manifest, bytes]]] = None

    # -- what the restore asks ---------------------------------------------------------
    def where(self, user: str, key: str, step: Optional[int] = None) -> str:
        got = (self._listed or {}).get(step) if step is not None else None
        node = got[0].node if got is not None else "?"
        kind = "RAM copy" if self.src == "ram" else "partner copy"
        return f"{kind} on {node}:{key}" + ("" if step is None else f"/step-{step}")

    location = where

    def steps(self, user: str, key: str) -> List[StepInfo]:
        if (user, key) != (self.link.user, self.link.key):
            return []
        return [
            StepInfo(PARTNER, user, key, step, m)
            for step, (_peer, m, _b) in sorted(self._listing().items())
        ]

    def manifest(self, user: str, key: str, step: int) -> Manifest:
        return self._held(user, key, step)[1]

    def manifest_bytes(self, user: str, key: str, step: int) -> bytes:
        return self._held(user, key, step)[2]

    def reader(self, user: str, key: str, step: int) -> PartnerReader:
        peer, m, mbytes = self._held(user, key, step)
        return PartnerReader(self.link, peer, m, mbytes, self.where(user, key, step), self.src)

    def verify(self, user: str, key: str, step: int) -> Any:
        """Not offered: the holder's copy is verified by reading it (the restore did)."""
        raise TierError(f"{self.where(user, key, step)}: verified only by reading it")

    def delete(self, user: str, key: str, step: int) -> None:
        raise TierError(f"{self.where(user, key, step)}: the holder's copy is not ours to delete")

    # -- the listing -------------------------------------------------------------------
    def _held(self, user: str, key: str, step: int) -> Tuple[Peer, Manifest, bytes]:
        got = self._listing().get(step) if (user, key) == (self.link.user, self.link.key) else None
        if got is None:
            raise NotFound(f"{self.where(user, key, step)}: no rank holds it")
        return got

    def _listing(self) -> Dict[int, Tuple[Peer, Manifest, bytes]]:
        """Step -> (holder, manifest, its bytes), asked once per restore (the restore
        lists its tiers more than once). Never raises: a rank that cannot be asked is
        logged and skipped, no answer at all is an empty tier."""
        if self._listed is not None:
            return self._listed
        link = self.link
        self._listed = listed = {}
        try:
            peers = link.rdv.peers(link.rendezvous_timeout)
        except (CkptError, OSError) as exc:
            log.warning("[ckpt] partner tier: %s", exc)
            return listed
        for r in others_nearest_first(link, peers):
            peer = peers[r]
            try:
                docs = retried(_manifests, link, peer, self.src)
            except (CkptError, OSError, ValueError) as exc:
                log.warning("[ckpt] partner tier: rank %d on %s: %s", r, peer.node, exc)
                continue
            for doc in docs:
                try:
                    m = Manifest.from_bytes(doc, f"partner manifest from {peer.node}")
                    check_own(link, m, m.step, peer.node)
                except CkptError as exc:
                    log.warning("[ckpt] partner tier: %s", exc)
                    continue
                listed.setdefault(m.step, (peer, m, doc))
        if not listed:
            log.info("[ckpt] %s tier: no rank holds a copy of %s", self.name, link.key)
        return listed


def _manifests(link: PartnerLink, peer: Peer, src: str) -> List[bytes]:
    with connect(link, peer) as s:
        ask(link, s, {"op": "manifests", "key": link.key, "src": src})
        docs = json.loads(s.recv_frame())
    return [str(d).encode() for d in docs]


class _Pool:
    """Up to :data:`STREAMS` open ranged-read sessions with the holder, shared by the
    reader's sources (one request at a time each), closed when the last user is done."""

    def __init__(
        self, link: PartnerLink, peer: Peer, m: Manifest, mbytes: bytes, where: str, src: str
    ):
        self.link, self.peer, self.m, self.mbytes, self.where = link, peer, m, mbytes, where
        self.src = src
        self.cv = threading.Condition()
        self.idle: List[_Conn] = []
        self.count = 0
        #: Sessions this pool may open: :data:`STREAMS`, lowered to those already open
        #: when the holder refuses one more (it serves a few connections at once).
        self.limit = STREAMS
        self.refs = 0
        self.closed = False

    def _open(self) -> _Conn:
        s = connect(self.link, self.peer)
        try:
            req = {"op": "open", "key": self.link.key, "step": self.m.step, "src": self.src}
            ask(self.link, s, req)
            if s.recv_frame() != self.mbytes:
                raise TierError(f"{self.where}: the holder's copy changed since it was listed")
        except BaseException:
            s.close()
            raise
        return s

    def take(self) -> _Conn:
        with self.cv:
            while True:
                if self.closed:
                    raise TierError(f"{self.where}: reader closed")
                if self.idle:
                    return self.idle.pop()
                if self.count < self.limit:
                    self.count += 1
                    break
                self.cv.wait()
        try:
            return retried(self._open)
        except (CkptError, OSError, ValueError) as exc:
            with self.cv:
                self.count -= 1
                others = self.count > 0
                if others:  # the holder is busy: share the sessions already open
                    self.limit = self.count
                self.cv.notify()
            if others:
                return self.take()
            if isinstance(exc, (TierError, VerifyError, NotFound)):
                raise
            raise TierError(f"{self.where}: {exc}") from None

    def give(self, conn: _Conn) -> None:
        with self.cv:
            if not self.closed:
                self.idle.append(conn)
                self.cv.notify()
                return
            self.count -= 1
        conn.close()

    def drop(self, conn: _Conn) -> None:
        conn.close()
        with self.cv:
            self.count -= 1
            self.cv.notify()

    def hold(self) -> None:
        with self.cv:
            self.refs += 1

    def release(self) -> None:
        with self.cv:
            self.refs -= 1
            if self.refs > 0:
                return
            self.closed = True
            idle, self.idle = self.idle, []
            self.count -= len(idle)
            self.cv.notify_all()
        for s in idle:
            s.close()


class PartnerReader:
    """One step of the holder's copy open for ranged reads (a TierReader). The first
    session is opened here, so a holder that no longer has the step, or has another
    copy of it than it listed, is found before any payload is read."""

    def __init__(
        self,
        link: PartnerLink,
        peer: Peer,
        m: Manifest,
        mbytes: bytes,
        where: str,
        src: str = "disk",
    ):
        self.where, self.manifest, self.manifest_bytes = where, m, mbytes
        self._index = {e.path: i for i, e in enumerate(m.files)}
        self._pool = _Pool(link, peer, m, mbytes, where, src)
        self._pool.hold()
        try:
            self._pool.give(self._pool.take())
        except BaseException:
            self._pool.release()
            raise
        self._open = True

    def open(self, relpath: str) -> PartnerSource:
        i = self._index.get(relpath)
        if i is None:
            raise VerifyError(f"{self.where}/{relpath}: not in the manifest")
        return PartnerSource(self._pool, i, self.manifest.files[i].size, f"{self.where}/{relpath}")

    def close(self) -> None:
        if self._open:
            self._open = False
            self._pool.release()

    def __enter__(self) -> PartnerReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PartnerSource:
    """One payload file of the holder's copy (a RangeSource without a descriptor: the
    restore's reader asks for each chunk with :meth:`readinto`, into its own memory)."""

    def __init__(self, pool: _Pool, index: int, size: int, where: str) -> None:
        self.pool, self.index, self.size, self.where = pool, index, size, where
        pool.hold()
        self._open = True

    def readinto(self, buf: memoryview, offset: int) -> int:
        n = min(len(buf), self.size - offset)
        if n <= 0:
            return 0
        s = self.pool.take()
        conn = s
        try:
            s.send_frame(RANGE.pack(self.index, offset, n))
            view = buf[:n]
            got = 0
            while got < n:
                try:
                    got += s.recv_into(view[got:], n - got)
                except WireError as exc:
                    raise TierError(
                        f"{self.where}: the holder stopped sending at {offset + got} ({exc})"
                    ) from None
        except BaseException:
            self.pool.drop(conn)
            raise
        self.pool.give(conn)
        return n

    def fileno(self) -> Optional[int]:
        return None

    def close(self) -> None:
        if self._open:
            self._open = False
            self.pool.release()
