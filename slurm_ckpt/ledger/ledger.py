"""The per-node flush ledger: what state each checkpoint is in on each tier.

One file per node (``ledger.json``, format in :mod:`slurm_ckpt.ledger.codec`) shared by
every writer on that node: the training process, the epilog, the stager daemon and the
CLI. Records are :class:`~slurm_ckpt.ledger.record.Record`; the node's published summary
is :mod:`slurm_ckpt.ledger.node_status`.

Safety
------
* **Crashes.** The file is only ever replaced whole
  (:func:`~slurm_ckpt.core.fsio.atomic_replace`): a SIGKILL at any point leaves the old or
  the new ledger, never a torn one. Temp files left by a killed writer are removed by the
  next writer.
* **Concurrent writers.** Every read-modify-write runs under an exclusive lock on
  ``ledger.lock`` (:class:`~slurm_ckpt.ledger.lockfile.LockFile`: mode 0600, so no other
  user can open it, let alone hold it) and re-reads the file after taking the lock, so
  no update is lost. Readers do not take the lock: they see the old or the new file.
* **Lost or corrupt file.** The ledger is a cache; the truth is on the tiers (committed
  manifests). A missing file is an empty ledger. An unparsable one (or one whose checksum
  does not match) is moved aside to ``ledger.json.corrupt-<epoch>``, a warning is logged,
  the ledger starts empty (counting the event as failure ``ledger_corrupt``) and
  :meth:`Ledger.reconcile` rebuilds it from a scan of the tiers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

from slurm_ckpt.core import fsio
from slurm_ckpt.core.names import validate_node
from slurm_ckpt.errors import EXIT_FAILED, CkptError, NotFound
from slurm_ckpt.ledger import codec
from slurm_ckpt.ledger.codec import Corrupt, Data, from_raw, raw_pending, to_raw
from slurm_ckpt.ledger.lockfile import LockBusy, LockFile
from slurm_ckpt.ledger.reconcile import reconcile_data
from slurm_ckpt.ledger.record import (
    WARM_SLOT,
    Ident,
    Record,
    State,
    apply_fields,
    check_ident,
    check_tier,
    merge_durations,
    one_line,
)

log = logging.getLogger(__name__)

__all__ = ["LEDGER_NAME", "LOCK_NAME", "Ledger", "LedgerError"]

LEDGER_NAME = "ledger.json"
LOCK_NAME = "ledger.lock"


class LedgerError(CkptError):
    """The ledger cannot be read or written (lock busy, disk full, permission)."""

    exit_code = EXIT_FAILED


class Ledger:
    """The flush ledger of one node, stored as ``directory/ledger.json``.

    All mutating methods are atomic transactions under the ledger lock. Do not call
    ledger methods from inside an :meth:`update` callback (that raises
    :class:`RuntimeError`): the callback works on the copy it is given.
    """

    def __init__(
        self,
        directory: Path,
        node: str,
        *,
        lock_timeout: float = 60.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.node = validate_node(node)
        self.directory = Path(directory)
        self.path = self.directory / LEDGER_NAME
        self.lock_path = self.directory / LOCK_NAME
        self.lock_timeout = float(lock_timeout)
        self.clock = clock
        try:
            self.directory.mkdir(mode=0o755, parents=True, exist_ok=True)
        except OSError as exc:
            raise LedgerError(
                f"cannot create ledger directory {self.directory}: {exc.strerror or exc}"
            ) from exc
        self._lock = LockFile(self.directory, LOCK_NAME, self.lock_timeout)
        self._local = threading.local()
        self._cache: Dict[bytes, Dict[str, Any]] = {}

    def __repr__(self) -> str:
        return f"Ledger({str(self.directory)!r}, node={self.node!r})"

    # -- low level ------------------------------------------------------------------------

    def _read_blob(self) -> Optional[bytes]:
        try:
            with open(self.path, "rb") as fh:
                return fh.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise LedgerError(f"cannot read ledger {self.path}: {exc.strerror or exc}") from exc

    def _load(self, recover: bool) -> Data:
        """Read the ledger. With ``recover`` (lock held) a corrupt file is moved aside."""
        blob = self._read_blob()
        if blob is None:
            return Data(self._cache)
        try:
            return codec.parse(blob, self._cache, self.path)
        except Corrupt as exc:
            if not recover:
                raise
            aside = self._move_aside()
            log.warning(
                "ledger %s is corrupt (%s); moved to %s and starting empty; "
                "reconcile with the tiers to rebuild it",
                self.path,
                exc,
                aside,
            )
            data = Data(self._cache)
            data.failures["ledger_corrupt"] = 1
            data.dirty = True
            return data

    def _move_aside(self) -> Path:
        base = f"{LEDGER_NAME}.corrupt-{int(self.clock())}"
        target = self.directory / base
        n = 1
        while target.exists():
            target = self.directory / f"{base}.{n}"
            n += 1
        try:
            os.replace(self.path, target)
        except OSError as exc:
            raise LedgerError(
                f"ledger {self.path} is corrupt and cannot be moved aside: {exc.strerror or exc}"
            ) from exc
        return target

    def _save(self, data: Data) -> None:
        try:
            blob = codec.serialise(data, self.node, self.clock())
        except ValueError as exc:
            raise LedgerError(f"{self.path}: {exc}") from exc
        try:
            dfd = fsio.open_dir(str(self.directory))
            try:
                # The lock is held: no other writer has a temp file in flight.
                fsio.remove_stale_temps(dfd, LEDGER_NAME)
                fsio.atomic_replace(dfd, LEDGER_NAME, blob, 0o644)  # readable by the CLI
            finally:
                os.close(dfd)
        except OSError as exc:
            raise LedgerError(f"cannot write ledger {self.path}: {exc.strerror or exc}") from exc
        data.dirty = False

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[Data]:
        if getattr(self._local, "in_txn", False):
            raise RuntimeError("ledger transaction already open in this thread (nested call)")
        try:
            self._lock.acquire()
        except LockBusy:
            raise LedgerError(
                f"ledger lock {self.lock_path} busy for {self.lock_timeout:g}s; "
                "another process holds it"
            ) from None
        except OSError as exc:
            raise LedgerError(
                f"cannot lock ledger {self.lock_path}: {exc.strerror or exc}"
            ) from exc
        self._local.in_txn = True
        try:
            data = self._load(recover=True)
            yield data
            if data.dirty:
                self._save(data)
        finally:
            self._local.in_txn = False
            self._lock.release()

    def snapshot(self) -> Data:
        """Lock-free read; falls back to a locked recovery if the file is corrupt."""
        try:
            return self._load(recover=False)
        except Corrupt:
            if getattr(self._local, "in_txn", False):
                return Data(self._cache)
            with self._transaction() as data:
                return data

    # -- transactions -----------------------------------------------------------------------

    def _put(self, data: Data, rec: Record) -> None:
        data.put(to_raw(rec))

    def record_local_commit(
        self,
        user: str,
        key: str,
        step: int,
        nbytes: int,
        seq: int,
        job: Optional[object],
        selected_for_flush: bool,
        forced: bool = False,
        durations: Optional[Dict[str, float]] = None,
    ) -> Record:
        """A checkpoint was committed on the local tier.

        Creates (or refreshes) the record: ``local=COMMITTED``; when selected or forced and
        the PFS holds no live copy, ``WARM_SLOT=FLUSH_PENDING``. A re-commit of a step keeps
        ``pinned`` and a verified PFS state.
        """
        check_ident(user, key, step)
        now = self.clock()
        with self._transaction() as data:
            raw = data.get((user, key, step))
            rec = from_raw(raw) if raw is not None else Record(user, key, step, created_at=now)
            rec.tiers["local"] = State.COMMITTED
            rec.committed_at["local"] = now
            rec.nbytes = int(nbytes)
            rec.seq = int(seq)
            rec.job = None if job is None else str(job)
            rec.selected_for_flush = bool(selected_for_flush)
            rec.forced = bool(forced) or rec.forced
            merge_durations(rec, durations)
            warm = rec.tiers.get(WARM_SLOT)
            if rec.needs_flush and warm not in (State.VERIFIED, State.FLUSHING):
                rec.tiers[WARM_SLOT] = State.FLUSH_PENDING
                rec.error = None
                rec.attempts = 0
            rec.updated_at = now
            self._put(data, rec)
            return rec

    def mark(
        self,
        user: str,
        key: str,
        step: int,
        tier: str,
        state: object,
        reason: Optional[str] = None,
        *,
        code: Optional[str] = None,
        create: bool = False,
        **fields: Any,
    ) -> Record:
        """Set the state of a checkpoint on ``tier`` (and any other record ``fields``).

        ``COMMITTED`` stamps ``committed_at[tier]``, ``FLUSHING`` stamps
        ``flush_started_at[tier]`` and counts an attempt, ``VERIFIED`` stamps
        ``verified_at[tier]`` (see :meth:`Record.set_state`). ``reason`` (one line)
        becomes the record's last error; ``code`` also bumps that failure counter.
        ``durations`` is merged, not replaced. Raises
        :class:`~slurm_ckpt.errors.NotFound` if the record does not exist, unless
        ``create``.
        """
        done = self.mark_many(
            [(user, key, step)], tier, state, reason, code=code, create=create, **fields
        )
        if not done:
            raise NotFound(f"no ledger record for {user}/{key} step {step}")
        return done[0]

    def mark_many(
        self,
        idents: Iterable[Ident],
        tier: str,
        state: object,
        reason: Optional[str] = None,
        *,
        code: Optional[str] = None,
        create: bool = False,
        **fields: Any,
    ) -> List[Record]:
        """:meth:`mark` for many checkpoints in ONE transaction (one rewrite of the file,
        however many there are: an epilog handing 10,000 checkpoints to the stager must
        not rewrite the ledger 10,000 times). Missing records are skipped unless
        ``create``; returns the records stored."""
        check_tier(tier)
        st = State(state)
        unknown = set(fields) - codec.MUTABLE_FIELDS
        if unknown:
            raise TypeError(f"mark(): unknown record field(s): {', '.join(sorted(unknown))}")
        idents = list(idents)
        for ident in idents:
            check_ident(*ident)
        now = self.clock()
        out: List[Record] = []
        with self._transaction() as data:
            for ident in idents:
                raw = data.get(ident)
                if raw is None:
                    if not create:
                        continue
                    rec = Record(*ident, created_at=now)
                else:
                    rec = from_raw(raw)
                rec.set_state(tier, st, now, reason)
                apply_fields(rec, fields)
                rec.updated_at = now
                self._put(data, rec)
                out.append(rec)
            if code and out:
                _bump(data, code, len(out))
        return out

    def update(
        self, user: str, key: str, step: int, fn: Callable[[Optional[Record]], Optional[Record]]
    ) -> Optional[Record]:
        """Generic transaction on one record.

        ``fn`` gets a copy of the record (None if absent) and returns the record to store,
        or None to leave the ledger unchanged. Returns the stored record (or the current
        one when nothing changed). ``fn`` may run again on the next call, never twice in
        one; it must not call the ledger.
        """
        check_ident(user, key, step)
        with self._transaction() as data:
            raw = data.get((user, key, step))
            current = from_raw(raw) if raw is not None else None
            new = fn(current)
            if new is None:
                return from_raw(raw) if raw is not None else None
            if not isinstance(new, Record) or new.ident != (user, key, step):
                raise ValueError("update(): the callback must return the same record or None")
            new.updated_at = self.clock()
            if not new.created_at:
                new.created_at = new.updated_at
            self._put(data, new)
            return new

    def update_many(
        self,
        changes: Iterable[Tuple[Ident, Callable[[Optional[Record], float], Optional[Record]]]],
        bump: Optional[Dict[str, int]] = None,
    ) -> int:
        """Several record updates in ONE transaction (one rewrite of the file): the flush
        engine buffers a round's state changes and writes them together, so a backlog of
        12,000 checkpoints costs a few rewrites, not 24,000. Each ``fn(record, now)`` gets
        a copy of the record as the changes before it left it (None if absent) and
        returns the record to store, or None to leave it; ``bump`` adds to failure
        counters. Returns the number of records stored."""
        changes = list(changes)
        for ident, _fn in changes:
            check_ident(*ident)
        now = self.clock()
        stored = 0
        with self._transaction() as data:
            for ident, fn in changes:
                raw = data.get(ident)
                new = fn(from_raw(raw) if raw is not None else None, now)
                if new is None:
                    continue
                if not isinstance(new, Record) or new.ident != tuple(ident):
                    raise ValueError("update_many(): a change must return its record or None")
                new.updated_at = now
                if not new.created_at:
                    new.created_at = now
                self._put(data, new)
                stored += 1
            for code, n in (bump or {}).items():
                _bump(data, code, n)
        return stored

    def forget(self, user: str, key: str, step: int) -> bool:
        """Drop a record. Returns whether it existed."""
        with self._transaction() as data:
            return data.pop((user, key, step))

    def count_failure(self, code: str, n: int = 1) -> int:
        """Bump the failure counter ``code``; returns the new count."""
        with self._transaction() as data:
            return _bump(data, code, n)

    def expire(self, max_age_s: float) -> int:
        """Forget records that need nothing more from this node and are older than
        ``max_age_s``: no live local copy, nothing pending or in flight. Returns the count."""
        cutoff = self.clock() - float(max_age_s)
        with self._transaction() as data:
            doomed = [
                (raw["user"], raw["key"], raw["step"])
                for raw in data.decode_all()
                if raw.get("updated_at", 0.0) < cutoff
                and (raw.get("tiers") or {}).get("local") in (None, State.DELETED.value)
                and not raw.get("pinned")
                and State.FLUSHING.value not in (raw.get("tiers") or {}).values()
            ]
            for ident in doomed:
                data.pop(ident)
            return len(doomed)

    def reconcile(
        self,
        local_steps: Iterable[Tuple[str, str, int, int]],
        warm_verified_steps: Iterable[Tuple[str, str, int, int]],
        *,
        prune: bool = True,
        jobs: Optional[Dict[Tuple[str, str, int], Optional[str]]] = None,
        since: Optional[float] = None,
    ) -> Dict[str, int]:
        """Bring the ledger in line with what is committed on the tiers.

        ``local_steps``: ``(user, key, step, nbytes)`` of every committed checkpoint on this
        node's local tier. ``warm_verified_steps``: the same for verified warm-tier copies.

        * A local checkpoint without a record gets one (``local=COMMITTED``, selected for
          flush: unknown history is treated cautiously). A record whose local state is
          not live becomes ``COMMITTED``.
        * A record of this node whose step has a verified warm copy becomes ``WARM_SLOT=VERIFIED``
          (PFS entries never create records: the PFS is shared by all nodes).
        * With ``prune`` (the scans are complete): a record whose local copy is live but
          absent from the scan becomes ``local=DELETED``; one whose PFS copy was verified
          but is gone gets its PFS state cleared (so it is flushed again) if the local copy
          still exists, else ``WARM_SLOT=DELETED``.

        ``jobs`` maps ``(user, key, step)`` to the job id found in its manifest, so that
        records rebuilt from a scan still say which job wrote them (``ckpt-slurm status``
        groups by job).

        ``since`` (this ledger's clock when the scans began): a record changed at or after
        it is newer than the scans and is left as it is. Two hooks on one node reconcile at
        once (the epilogs of two jobs ending together): without it, the slower one's stale
        view undid the other's flush (its list of verified steps predates the flush, so
        the prune cleared the warm state and the steps were owed again, forever) or its
        retention (a scan that saw a copy since deleted brought the record back).

        Returns counts: ``added``, ``fixed``, ``pruned``.
        """
        jobs = jobs or {}
        local_map = {(u, k, int(s)): int(n) for u, k, s, n in local_steps}
        warm_map = {(u, k, int(s)): int(n) for u, k, s, n in warm_verified_steps}
        for u, k, s in list(local_map) + list(warm_map):
            check_ident(u, k, s)
        now = self.clock()
        with self._transaction() as data:
            return reconcile_data(
                data, local_map, warm_map, now, prune=prune, jobs=jobs, since=since
            )

    # -- reads (lock-free) -------------------------------------------------------------------

    def get(self, user: str, key: str, step: int) -> Optional[Record]:
        raw = self.snapshot().get((user, key, step))
        return None if raw is None else from_raw(raw)

    def records(
        self, user: Optional[str] = None, key: Optional[str] = None, job: Optional[object] = None
    ) -> List[Record]:
        """All records, optionally filtered, sorted by (user, key, step)."""
        return [from_raw(r) for r in self.select(self.snapshot(), user, key, job)]

    def pending_flush(
        self, user: Optional[str] = None, key: Optional[str] = None, job: Optional[object] = None
    ) -> List[Record]:
        """Records still owed to the PFS: local copy ``COMMITTED``/``VERIFIED``, selected or
        forced, and the PFS state is neither ``VERIFIED`` nor ``DELETED`` (``FAILED`` and
        ``BAD`` copies are owed again). Forced ones first, then oldest commit first."""
        recs = [from_raw(r) for r in self._pending_raw(self.snapshot(), user, key, job)]
        recs.sort(key=lambda r: (not r.forced, r.committed_at.get("local", 0.0), r.ident))
        return recs

    def pending_bytes(
        self, user: Optional[str] = None, key: Optional[str] = None, job: Optional[object] = None
    ) -> int:
        return sum(
            int(r.get("nbytes", 0)) for r in self._pending_raw(self.snapshot(), user, key, job)
        )

    def failures(self) -> Dict[str, int]:
        """Failure counters by reason code."""
        return dict(self.snapshot().failures)

    @staticmethod
    def select(
        data: Data,
        user: Optional[str],
        key: Optional[str],
        job: Optional[object],
        pred: Optional[Callable[[Dict[str, Any]], bool]] = None,
    ) -> List[Dict[str, Any]]:
        jobs = None if job is None else str(job)
        if user is not None:
            # Filter on the canonical line prefix without parsing the records.
            head = [user] if key is None else [user, key]
            prefix = json.dumps(head, separators=(",", ":")).encode()[:-1] + b","
            pkeys: Iterable[bytes] = [pk for pk in data.records if pk.startswith(prefix)]
        else:
            pkeys = data.records
        out = [
            raw
            for raw in data.decode_all(pkeys)
            if (key is None or raw["key"] == key)
            and (user is None or raw["user"] == user)
            and (jobs is None or str(raw.get("job")) == jobs)
            and (pred is None or pred(raw))
        ]
        out.sort(key=lambda r: (r["user"], r["key"], r["step"]))
        return out

    def _pending_raw(
        self, data: Data, user: Optional[str], key: Optional[str], job: Optional[object]
    ) -> List[Dict[str, Any]]:
        return self.select(data, user, key, job, raw_pending)

    # -- node status ------------------------------------------------------------------------


def _bump(data: Data, code: str, n: int = 1) -> int:
    code = one_line(code, 64) or "unknown"
    data.failures[code] = data.failures.get(code, 0) + int(n)
    data.dirty = True
    return data.failures[code]
