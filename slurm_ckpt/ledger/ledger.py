"""The per-node flush ledger: what state each checkpoint is in on each tier.

One JSON file per node (``ledger.json``) shared by every writer on that node: the training
process, the epilog, the stager daemon and the CLI.

Safety
------
* **Crashes.** The file is only ever replaced whole: write a temp file in the same
  directory, fsync it, rename it over ``ledger.json``, fsync the directory. A SIGKILL at any
  point leaves the old or the new ledger, never a torn one. Temp files left by a killed
  writer are removed by the next writer.
* **Concurrent writers.** Every read-modify-write runs under an exclusive
  :class:`filelock.FileLock` on ``ledger.lock`` and re-reads the file after taking the
  lock, so no update is lost. Readers do not take the lock: they see the old or the new
  file.
* **Lost or corrupt file.** The ledger is a cache; the truth is on the tiers (committed
  manifests). A missing file is an empty ledger. An unparsable one (or one whose checksum
  does not match) is moved aside to ``ledger.json.corrupt-<epoch>``, a warning is logged,
  the ledger starts empty (counting the event as failure ``ledger_corrupt``) and
  :meth:`Ledger.reconcile` rebuilds it from a scan of the tiers.

File layout (JSON Lines, every line valid JSON)::

    {"format":"slurm_ckpt.ledger","version":1,"node":...,"records":N,"failures":{...}}
    ["alice","run1",100,<TAB>{"tiers":{"local":"COMMITTED","pfs":"FLUSHING"},...}]
    ...
    {"end":N,"xxh3_64":"<hex digest of every byte before this line>"}

Speed: loading only cuts each line at its tab (the part before it, canonical JSON of
``[user, key, step``, is the index key); a record is parsed when it is needed, and parsed
records are cached across loads. Loading and saving 10,000 records takes tens of
milliseconds.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import json
import logging
import math
import os
import re
import secrets
import stat
import threading
import time
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import xxhash
from filelock import FileLock, Timeout

from slurm_ckpt.core.fsio import write_all as _write_all
from slurm_ckpt.core.names import validate_node
from slurm_ckpt.core.retention import CkptInfo
from slurm_ckpt.errors import CkptError, InvalidName, NotFound, TierError

log = logging.getLogger(__name__)

__all__ = [
    "FORMAT",
    "LEDGER_NAME",
    "LOCK_NAME",
    "Ledger",
    "LedgerError",
    "Record",
    "State",
    "read_node_statuses",
    "status_path",
    "validate_node_name",
]

FORMAT = "slurm_ckpt.ledger"
VERSION = 1
LEDGER_NAME = "ledger.json"
LOCK_NAME = "ledger.lock"
STATUS_FORMAT = "slurm_ckpt.node_status"
_TMP_MARK = ".tmp-"
_MAX_REASON = 500
_MAX_STATUS_BYTES = 4 * 1024 * 1024
_STATUS_LIST_CAP = 50
_STALE_STATUS_TMP_S = 3600.0

_TIER_RE = re.compile(r"[a-z][a-z0-9_-]{0,31}")

Ident = Tuple[str, str, int]


class LedgerError(CkptError):
    """The ledger cannot be read or written (lock busy, disk full, permission)."""

    exit_code = 1


class State(str, Enum):
    """State of one checkpoint on one tier."""

    WRITING = "WRITING"  # being written, no manifest yet
    COMMITTED = "COMMITTED"  # manifest committed, not (re)verified
    VERIFIED = "VERIFIED"  # bytes checked against the manifest
    FLUSH_PENDING = "FLUSH_PENDING"  # selected for copying to this tier, not started
    FLUSHING = "FLUSHING"  # a copy to this tier is in progress
    FAILED = "FAILED"  # the last copy attempt failed (may be retried)
    BAD = "BAD"  # failed verification on this tier
    DELETED = "DELETED"  # removed from this tier (retention, GC, or found missing)


_STATES = {s.value: s for s in State}
_LIVE_LOCAL = (State.COMMITTED.value, State.VERIFIED.value)
_NOT_PENDING_PFS = (State.VERIFIED.value, State.DELETED.value)
_FAILED_STATES = (State.FAILED.value, State.BAD.value)


def _one_line(text: object, limit: int = _MAX_REASON) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


#: Node names become file names of the per-node status; one rule for the whole toolkit.
validate_node_name = validate_node


def _check_tier(tier: str) -> str:
    if not isinstance(tier, str) or not _TIER_RE.fullmatch(tier):
        raise InvalidName(f"tier name {tier!r}: use lower-case letters, digits, '-', '_'")
    return tier


# -- records ------------------------------------------------------------------------------


@dataclass
class Record:
    """One checkpoint ``(user, key, step)`` as this node knows it.

    ``tiers`` maps a tier name to a :class:`State` (a state written by a newer version of
    this software that this one does not know stays a plain string). ``committed_at``,
    ``flush_started_at`` and ``verified_at`` map a tier name to epoch seconds. ``seq`` is the
    0-based position of the save in its run (-1: unknown). ``durations`` holds metrics such
    as ``snapshot_s``, ``local_s``, ``flush_s``. ``extra`` keeps fields this version does
    not know, so they survive a rewrite.
    """

    user: str
    key: str
    step: int
    tiers: Dict[str, str] = field(default_factory=dict)
    nbytes: int = 0
    seq: int = -1
    selected_for_flush: bool = False
    forced: bool = False
    pinned: bool = False
    job: Optional[str] = None
    committed_at: Dict[str, float] = field(default_factory=dict)
    flush_started_at: Dict[str, float] = field(default_factory=dict)
    verified_at: Dict[str, float] = field(default_factory=dict)
    error: Optional[str] = None
    attempts: int = 0
    durations: Dict[str, float] = field(default_factory=dict)
    created_at: float = 0.0
    updated_at: float = 0.0
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def ident(self) -> Ident:
        return (self.user, self.key, self.step)

    def state(self, tier: str) -> Optional[State]:
        """The state on ``tier`` (None: no state there, or one this version does not know)."""
        value = self.tiers.get(tier)
        return None if value is None else _STATES.get(getattr(value, "value", value))

    @property
    def needs_flush(self) -> bool:
        return bool(self.selected_for_flush or self.forced)

    @property
    def pending_flush(self) -> bool:
        """Committed locally, must reach the PFS, and has no verified (or retired) copy there."""
        return _is_pending(self.tiers, self.selected_for_flush, self.forced)

    def to_local_info(self) -> CkptInfo:
        """This record as the local retention planner sees it."""
        return CkptInfo(
            step=self.step,
            wall_time=self.committed_at.get("local", self.created_at),
            seq=self.seq,
            nbytes=self.nbytes,
            selected_for_flush=self.selected_for_flush,
            forced=self.forced,
            pinned=self.pinned,
            verified=self.tiers.get("local") == State.VERIFIED.value,
            pfs_verified=self.tiers.get("pfs") == State.VERIFIED.value,
            next_tier_verified=None,
        )


_FIELD_NAMES = tuple(f.name for f in fields(Record))
_KNOWN = frozenset(_FIELD_NAMES) - {"extra"}
_MUTABLE_FIELDS = frozenset(_KNOWN - {"user", "key", "step", "tiers"})
_DICT_FIELDS = ("tiers", "committed_at", "flush_started_at", "verified_at", "durations")
_DEFAULTS: Dict[str, Any] = {
    "nbytes": 0,
    "seq": -1,
    "selected_for_flush": False,
    "forced": False,
    "pinned": False,
    "job": None,
    "error": None,
    "attempts": 0,
    "created_at": 0.0,
    "updated_at": 0.0,
}


def _is_pending(tiers: Dict[str, Any], selected: Any, forced: Any) -> bool:
    return bool(
        (selected or forced)
        and tiers.get("local") in _LIVE_LOCAL
        and tiers.get("pfs") not in _NOT_PENDING_PFS
    )


def _raw_pending(raw: Dict[str, Any]) -> bool:
    return _is_pending(raw.get("tiers") or {}, raw.get("selected_for_flush"), raw.get("forced"))


def _raw_ok(raw: Any) -> bool:
    """Cheap structural check of one stored record."""
    if type(raw) is not dict:
        return False
    user, key, step = raw.get("user"), raw.get("key"), raw.get("step")
    if type(user) is not str or type(key) is not str or not user or not key:
        return False
    if type(step) is not int or step < 0:
        return False
    for name in _DICT_FIELDS:
        value = raw.get(name)
        if value is not None and type(value) is not dict:
            return False
    tiers = raw.get("tiers")
    return not tiers or all(type(v) is str for v in tiers.values())


def _from_raw(raw: Dict[str, Any]) -> Record:
    kwargs: Dict[str, Any] = {}
    extra: Dict[str, Any] = {}
    for name, value in raw.items():
        if name in _KNOWN:
            kwargs[name] = value
        else:
            extra[name] = value
    for name in _DICT_FIELDS:
        kwargs[name] = dict(kwargs.get(name) or {})
    kwargs["tiers"] = {t: _STATES.get(v, v) for t, v in kwargs["tiers"].items()}
    rec = Record(**kwargs)
    if rec.job is not None:
        rec.job = str(rec.job)
    rec.extra = copy.deepcopy(extra) if extra else extra
    return rec


def _to_raw(rec: Record) -> Dict[str, Any]:
    raw: Dict[str, Any] = dict(rec.extra)
    raw["user"] = rec.user
    raw["key"] = rec.key
    raw["step"] = int(rec.step)
    for name in _DICT_FIELDS:
        value = getattr(rec, name)
        if value:
            raw[name] = (
                {t: str(getattr(v, "value", v)) for t, v in value.items()}
                if name == "tiers"
                else dict(value)
            )
    for name, default in _DEFAULTS.items():
        value = getattr(rec, name)
        if value != default:
            raw[name] = value
    return raw


# -- the file -----------------------------------------------------------------------------

_IDENT_KEYS = ("user", "key", "step")
_SEP = b"\t"  # never emitted by json.dumps outside strings; JSON whitespace inside a line


def _pkey(user: str, key: str, step: int) -> bytes:
    """Canonical line prefix of a record: ``["user","key",step,`` (also the index key)."""
    return json.dumps([user, key, step], separators=(",", ":")).encode()[:-1] + b","


def _pkey_of(raw: Dict[str, Any]) -> bytes:
    return _pkey(raw["user"], raw["key"], raw["step"])


def _encode_rest(raw: Dict[str, Any]) -> bytes:
    """The part of a record line after the tab: ``{other fields}]``."""
    rest = {k: v for k, v in raw.items() if k not in _IDENT_KEYS}
    return json.dumps(rest, separators=(",", ":"), allow_nan=False).encode() + b"]"


def _row_to_raw(row: Any) -> Optional[Dict[str, Any]]:
    if not isinstance(row, list) or len(row) != 4 or not isinstance(row[3], dict):
        return None
    raw = row[3]  # freshly parsed: ours to change
    raw["user"], raw["key"], raw["step"] = row[0], row[1], row[2]
    return raw if _raw_ok(raw) else None


def _loads(line: bytes) -> Any:
    try:
        return json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None


def _decode_line(line: bytes) -> Optional[Dict[str, Any]]:
    return _row_to_raw(_loads(line))


class _Data:
    """The whole ledger in memory.

    ``records`` maps a record's canonical prefix (:func:`_pkey`) to either the rest of its
    stored line (bytes, not parsed yet) or a raw record dict (parsed or changed). Raw dicts
    are never changed in place: a change builds a new dict. Lines are parsed on demand
    through ``cache`` (``pkey -> (rest, raw)``, shared with later loads, so a daemon
    polling an unchanged ledger does not parse it again).
    """

    __slots__ = ("records", "failures", "dirty", "cache")

    def __init__(self, cache: Optional[Dict[bytes, Tuple[bytes, Dict[str, Any]]]] = None):
        self.records: Dict[bytes, Any] = {}
        self.failures: Dict[str, int] = {}
        self.dirty = False
        self.cache: Dict[bytes, Tuple[bytes, Dict[str, Any]]] = {} if cache is None else cache

    def _cached(self, pk: bytes, rest: bytes) -> Optional[Dict[str, Any]]:
        hit = self.cache.get(pk)
        return hit[1] if hit is not None and hit[0] == rest else None

    def get_p(self, pk: bytes) -> Optional[Dict[str, Any]]:
        v = self.records.get(pk)
        if v is None or isinstance(v, dict):
            return v
        raw = self._cached(pk, v)
        if raw is None:
            raw = _decode_line(pk + _SEP + v)
            if raw is None or _pkey_of(raw) != pk:
                return None
            self.cache[pk] = (v, raw)
        return raw

    def get(self, ident: Ident) -> Optional[Dict[str, Any]]:
        return self.get_p(_pkey(*ident))

    def put(self, raw: Dict[str, Any]) -> None:
        self.records[_pkey_of(raw)] = raw
        self.dirty = True

    def pop(self, ident: Ident) -> bool:
        if self.records.pop(_pkey(*ident), None) is None:
            return False
        self.dirty = True
        return True

    def decode_all(self, pkeys: Optional[Iterable[bytes]] = None) -> List[Dict[str, Any]]:
        """Raw dicts for ``pkeys`` (default: all), in no particular order; malformed records
        are skipped.

        Lines not in the cache are parsed in one ``json.loads`` call: much faster than one
        call per line.
        """
        records, cache = self.records, self.cache
        out: List[Dict[str, Any]] = []
        missing: List[bytes] = []
        for pk in records if pkeys is None else pkeys:
            v = records[pk]
            if type(v) is dict:
                out.append(v)
                continue
            hit = cache.get(pk)
            if hit is not None and hit[0] == v:
                out.append(hit[1])
            else:
                missing.append(pk)
        if missing:
            lines = [pk + _SEP + records[pk] for pk in missing]
            rows = _loads(b"[" + b",".join(lines) + b"]")
            if type(rows) is not list or len(rows) != len(lines):
                rows = [_loads(line) for line in lines]  # some line is not one JSON value
            for pk, row in zip(missing, rows):
                raw = _row_to_raw(row)
                if raw is not None:
                    cache[pk] = (records[pk], raw)
                    out.append(raw)
        return out


class _Corrupt(Exception):
    pass


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        self.node = validate_node_name(node)
        self.directory = Path(directory)
        self.path = self.directory / LEDGER_NAME
        self.lock_path = self.directory / LOCK_NAME
        self.lock_timeout = float(lock_timeout)
        self._clock = clock
        try:
            self.directory.mkdir(mode=0o755, parents=True, exist_ok=True)
        except OSError as exc:
            raise LedgerError(
                f"cannot create ledger directory {self.directory}: {exc.strerror or exc}"
            ) from exc
        self._lock = FileLock(str(self.lock_path), timeout=self.lock_timeout)
        self._local = threading.local()
        self._cache: Dict[bytes, Dict[str, Any]] = {}

    def __repr__(self) -> str:
        return f"Ledger({str(self.directory)!r}, node={self.node!r})"

    # -- low level ------------------------------------------------------------------------

    def _parse(self, blob: bytes) -> _Data:
        """File layout (JSON Lines): a header object; one line per record,
        ``["user","key",step,<TAB>{other fields}]`` (valid JSON: the tab is whitespace, and
        it makes the record's identity cheap to cut off); a trailer
        ``{"end": <records>, "xxh3_64": <hex of every byte before the trailer>}``.
        Anything else, or a checksum mismatch, is corrupt."""
        if not blob.endswith(b"\n"):
            raise _Corrupt("truncated (no final newline)")
        cut = blob.rfind(b"\n", 0, len(blob) - 1) + 1
        first = blob.find(b"\n")
        if cut <= 0 or first + 1 > cut:
            raise _Corrupt("no header or trailer")
        try:
            trailer = json.loads(blob[cut:])
            header = json.loads(blob[:first])
        except (ValueError, UnicodeDecodeError):
            raise _Corrupt("unreadable header or trailer") from None
        if not isinstance(trailer, dict) or not isinstance(header, dict):
            raise _Corrupt("bad header or trailer")
        if header.get("format") != FORMAT:
            raise _Corrupt("not a slurm_ckpt ledger")
        if trailer.get("xxh3_64") != xxhash.xxh3_64_hexdigest(memoryview(blob)[:cut]):
            raise _Corrupt("checksum mismatch")
        count = header.get("records")
        if trailer.get("end") != count or not isinstance(count, int):
            raise _Corrupt("record count mismatch")
        failures = header.get("failures") or {}
        if not isinstance(failures, dict):
            raise _Corrupt("bad failure counters")
        data = _Data(self._cache)
        for code, n in failures.items():
            if isinstance(n, int) and not isinstance(n, bool):
                data.failures[str(code)] = n
        body = blob[first + 1 : cut - 1]
        if count == 0:
            if body:
                raise _Corrupt("record count mismatch")
            return data
        # Fast path: "P1<TAB>R1<NL>P2<TAB>R2..." -> [P1, R1, P2, R2, ...] in C.
        parts = body.replace(b"\n", _SEP).split(_SEP)
        if len(parts) == 2 * count:
            data.records = dict(zip(parts[0::2], parts[1::2]))
            if len(data.records) != count:
                log.warning("ledger %s: duplicate records; keeping the last", self.path)
        else:
            self._parse_slow(body, count, data)
        if len(self._cache) > 2 * len(data.records) + 256:
            self._cache.clear()
        return data

    def _parse_slow(self, body: bytes, count: int, data: _Data) -> None:
        """Lines not in the canonical form: parse each one, re-key it, drop bad ones."""
        lines = body.split(b"\n")
        if len(lines) != count:
            raise _Corrupt("record count mismatch")
        bad = 0
        for line in lines:
            raw = _decode_line(line)
            if raw is None:
                bad += 1
                continue
            data.records[_pkey_of(raw)] = raw
        data.dirty = True  # rewrite in canonical form at the next transaction
        if bad:
            log.warning(
                "ledger %s: ignored %d malformed record(s); reconcile with the tiers to "
                "rebuild them",
                self.path,
                bad,
            )

    def _read_blob(self) -> Optional[bytes]:
        try:
            with open(self.path, "rb") as fh:
                return fh.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise LedgerError(f"cannot read ledger {self.path}: {exc.strerror or exc}") from exc

    def _load(self, recover: bool) -> _Data:
        """Read the ledger. With ``recover`` (lock held) a corrupt file is moved aside."""
        blob = self._read_blob()
        if blob is None:
            return _Data(self._cache)
        try:
            return self._parse(blob)
        except _Corrupt as exc:
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
            data = _Data(self._cache)
            data.failures["ledger_corrupt"] = 1
            data.dirty = True
            return data

    def _move_aside(self) -> Path:
        base = f"{LEDGER_NAME}.corrupt-{int(self._clock())}"
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

    def _remove_stale_temps(self) -> None:
        # Only called with the lock held: no other writer has a temp file in flight.
        prefix = LEDGER_NAME + _TMP_MARK
        with contextlib.suppress(OSError), os.scandir(self.directory) as it:
            for entry in it:
                if entry.name.startswith(prefix):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)

    def _serialise(self, data: _Data) -> bytes:
        header = {
            "format": FORMAT,
            "version": VERSION,
            "node": self.node,
            "updated_at": self._clock(),
            "records": len(data.records),
            "failures": data.failures,
        }
        try:
            lines = [json.dumps(header, separators=(",", ":"), allow_nan=False).encode()]
            lines.extend(
                [
                    pk + _SEP + (v if type(v) is bytes else _encode_rest(v))
                    for pk, v in data.records.items()
                ]
            )
        except (TypeError, ValueError) as exc:
            raise LedgerError(f"cannot serialise ledger {self.path}: {exc}") from exc
        lines.append(b"")
        body = b"\n".join(lines)
        trailer = {"end": len(data.records), "xxh3_64": xxhash.xxh3_64_hexdigest(body)}
        return body + json.dumps(trailer, separators=(",", ":")).encode() + b"\n"

    def _save(self, data: _Data) -> None:
        blob = self._serialise(data)
        self._remove_stale_temps()
        tmp = self.directory / f"{LEDGER_NAME}{_TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        flags |= getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(tmp, flags, 0o644)
            try:
                with contextlib.suppress(OSError):
                    os.fchmod(fd, 0o644)  # readable by the CLI whatever the umask
                _write_all(fd, blob)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
            _fsync_dir(self.directory)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise LedgerError(f"cannot write ledger {self.path}: {exc.strerror or exc}") from exc
        data.dirty = False

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[_Data]:
        if getattr(self._local, "in_txn", False):
            raise RuntimeError("ledger transaction already open in this thread (nested call)")
        try:
            self._lock.acquire()
        except Timeout:
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

    def _snapshot(self) -> _Data:
        """Lock-free read; falls back to a locked recovery if the file is corrupt."""
        try:
            return self._load(recover=False)
        except _Corrupt:
            if getattr(self._local, "in_txn", False):
                return _Data(self._cache)
            with self._transaction() as data:
                return data

    # -- transactions -----------------------------------------------------------------------

    def _put(self, data: _Data, rec: Record) -> None:
        data.put(_to_raw(rec))

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
        the PFS holds no live copy, ``pfs=FLUSH_PENDING``. A re-commit of a step keeps
        ``pinned`` and a verified PFS state.
        """
        _check_ident(user, key, step)
        now = self._clock()
        with self._transaction() as data:
            raw = data.get((user, key, step))
            rec = _from_raw(raw) if raw is not None else Record(user, key, step, created_at=now)
            rec.tiers["local"] = State.COMMITTED
            rec.committed_at["local"] = now
            rec.nbytes = int(nbytes)
            rec.seq = int(seq)
            rec.job = None if job is None else str(job)
            rec.selected_for_flush = bool(selected_for_flush)
            rec.forced = bool(forced) or rec.forced
            _merge_durations(rec, durations)
            pfs = rec.tiers.get("pfs")
            if rec.needs_flush and pfs not in (State.VERIFIED, State.FLUSHING):
                rec.tiers["pfs"] = State.FLUSH_PENDING
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
        **fields: Any,
    ) -> Record:
        """Set the state of a checkpoint on ``tier`` (and any other record ``fields``).

        ``COMMITTED`` stamps ``committed_at[tier]``, ``FLUSHING`` stamps
        ``flush_started_at[tier]`` and counts an attempt, ``VERIFIED`` stamps
        ``verified_at[tier]``. ``reason`` (one line) becomes the record's last error;
        ``code`` also bumps that failure counter. ``durations`` is merged, not replaced.
        Raises :class:`~slurm_ckpt.errors.NotFound` if the record does not exist.
        """
        _check_ident(user, key, step)
        _check_tier(tier)
        st = State(state)
        unknown = set(fields) - _MUTABLE_FIELDS
        if unknown:
            raise TypeError(f"mark(): unknown record field(s): {', '.join(sorted(unknown))}")
        now = self._clock()
        with self._transaction() as data:
            raw = data.get((user, key, step))
            if raw is None:
                raise NotFound(f"no ledger record for {user}/{key} step {step}")
            rec = _from_raw(raw)
            rec.tiers[tier] = st
            if st is State.COMMITTED:
                rec.committed_at[tier] = now
            elif st is State.FLUSHING:
                rec.flush_started_at[tier] = now
                rec.attempts += 1
            elif st is State.VERIFIED:
                rec.verified_at[tier] = now
                rec.committed_at.setdefault(tier, now)
            if reason is not None:
                rec.error = _one_line(reason)
            elif st in (State.FAILED, State.BAD) and rec.error is None:
                rec.error = st.value
            for name, value in fields.items():
                if name == "durations":
                    _merge_durations(rec, value)
                elif name == "job":
                    rec.job = None if value is None else str(value)
                else:
                    setattr(rec, name, value)
            rec.updated_at = now
            if code:
                _bump(data, code)
            self._put(data, rec)
            return rec

    def update(
        self, user: str, key: str, step: int, fn: Callable[[Optional[Record]], Optional[Record]]
    ) -> Optional[Record]:
        """Generic transaction on one record.

        ``fn`` gets a copy of the record (None if absent) and returns the record to store,
        or None to leave the ledger unchanged. Returns the stored record (or the current
        one when nothing changed). ``fn`` may run again on the next call, never twice in
        one; it must not call the ledger.
        """
        _check_ident(user, key, step)
        with self._transaction() as data:
            raw = data.get((user, key, step))
            current = _from_raw(raw) if raw is not None else None
            new = fn(current)
            if new is None:
                return _from_raw(raw) if raw is not None else None
            if not isinstance(new, Record) or new.ident != (user, key, step):
                raise ValueError("update(): the callback must return the same record or None")
            new.updated_at = self._clock()
            if not new.created_at:
                new.created_at = new.updated_at
            self._put(data, new)
            return new

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
        cutoff = self._clock() - float(max_age_s)
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
        pfs_verified_steps: Iterable[Tuple[str, str, int, int]],
        *,
        prune: bool = True,
        jobs: Optional[Dict[Tuple[str, str, int], Optional[str]]] = None,
    ) -> Dict[str, int]:
        """Bring the ledger in line with what is committed on the tiers.

        ``local_steps``: ``(user, key, step, nbytes)`` of every committed checkpoint on this
        node's local tier. ``pfs_verified_steps``: the same for verified PFS copies.

        * A local checkpoint without a record gets one (``local=COMMITTED``, selected for
          flush: unknown history is treated cautiously). A record whose local state is
          not live becomes ``COMMITTED``.
        * A record of this node whose step has a verified PFS copy becomes ``pfs=VERIFIED``
          (PFS entries never create records: the PFS is shared by all nodes).
        * With ``prune`` (the scans are complete): a record whose local copy is live but
          absent from the scan becomes ``local=DELETED``; one whose PFS copy was verified
          but is gone gets its PFS state cleared (so it is flushed again) if the local copy
          still exists, else ``pfs=DELETED``.

        ``jobs`` maps ``(user, key, step)`` to the job id found in its manifest, so that
        records rebuilt from a scan still say which job wrote them (``ckpt-slurm status``
        groups by job).

        Returns counts: ``added``, ``fixed``, ``pruned``.
        """
        jobs = jobs or {}
        local_map = {(u, k, int(s)): int(n) for u, k, s, n in local_steps}
        pfs_map = {(u, k, int(s)): int(n) for u, k, s, n in pfs_verified_steps}
        for u, k, s in list(local_map) + list(pfs_map):
            _check_ident(u, k, s)
        counts = {"added": 0, "fixed": 0, "pruned": 0}
        now = self._clock()
        with self._transaction() as data:
            for ident, nbytes in local_map.items():
                raw = data.get(ident)
                if raw is None:
                    rec = Record(*ident, nbytes=nbytes, created_at=now, updated_at=now)
                    rec.job = jobs.get(ident)
                    rec.tiers["local"] = State.COMMITTED
                    rec.committed_at["local"] = now
                    rec.selected_for_flush = True
                    rec.tiers["pfs"] = State.VERIFIED if ident in pfs_map else State.FLUSH_PENDING
                    if ident in pfs_map:
                        rec.verified_at["pfs"] = now
                    rec.extra["reconciled"] = True
                    self._put(data, rec)
                    counts["added"] += 1
                elif (raw.get("tiers") or {}).get("local") not in _LIVE_LOCAL:
                    rec = _from_raw(raw)
                    rec.tiers["local"] = State.COMMITTED
                    rec.committed_at.setdefault("local", now)
                    if not rec.nbytes:
                        rec.nbytes = nbytes
                    rec.job = rec.job or jobs.get(ident)
                    rec.updated_at = now
                    self._put(data, rec)
                    counts["fixed"] += 1
                elif not raw.get("job") and jobs.get(ident):
                    rec = _from_raw(raw)
                    rec.job = jobs[ident]
                    rec.updated_at = now
                    self._put(data, rec)
                    counts["fixed"] += 1
            for ident, nbytes in pfs_map.items():
                raw = data.get(ident)
                if raw is None or (raw.get("tiers") or {}).get("pfs") == State.VERIFIED.value:
                    continue
                rec = _from_raw(raw)
                rec.tiers["pfs"] = State.VERIFIED
                rec.verified_at.setdefault("pfs", now)
                if not rec.nbytes:
                    rec.nbytes = nbytes
                rec.updated_at = now
                self._put(data, rec)
                counts["fixed"] += 1
            if prune:
                for raw in data.decode_all():
                    ident = (raw["user"], raw["key"], raw["step"])
                    tiers = raw.get("tiers") or {}
                    changed = False
                    rec = _from_raw(raw)
                    if tiers.get("local") in _LIVE_LOCAL and ident not in local_map:
                        rec.tiers["local"] = State.DELETED
                        changed = True
                    if tiers.get("pfs") == State.VERIFIED.value and ident not in pfs_map:
                        if rec.tiers.get("local") in _LIVE_LOCAL and rec.needs_flush:
                            del rec.tiers["pfs"]
                            rec.verified_at.pop("pfs", None)
                        else:
                            rec.tiers["pfs"] = State.DELETED
                        changed = True
                    if changed:
                        rec.updated_at = now
                        self._put(data, rec)
                        counts["pruned"] += 1
        return counts

    # -- reads (lock-free) -------------------------------------------------------------------

    def get(self, user: str, key: str, step: int) -> Optional[Record]:
        raw = self._snapshot().get((user, key, step))
        return None if raw is None else _from_raw(raw)

    def records(
        self, user: Optional[str] = None, key: Optional[str] = None, job: Optional[object] = None
    ) -> List[Record]:
        """All records, optionally filtered, sorted by (user, key, step)."""
        return [_from_raw(r) for r in self._select(self._snapshot(), user, key, job)]

    def pending_flush(
        self, user: Optional[str] = None, key: Optional[str] = None, job: Optional[object] = None
    ) -> List[Record]:
        """Records still owed to the PFS: local copy ``COMMITTED``/``VERIFIED``, selected or
        forced, and the PFS state is neither ``VERIFIED`` nor ``DELETED`` (``FAILED`` and
        ``BAD`` copies are owed again). Forced ones first, then oldest commit first."""
        recs = [_from_raw(r) for r in self._pending_raw(self._snapshot(), user, key, job)]
        recs.sort(key=lambda r: (not r.forced, r.committed_at.get("local", 0.0), r.ident))
        return recs

    def pending_bytes(
        self, user: Optional[str] = None, key: Optional[str] = None, job: Optional[object] = None
    ) -> int:
        return sum(
            int(r.get("nbytes", 0)) for r in self._pending_raw(self._snapshot(), user, key, job)
        )

    def failures(self) -> Dict[str, int]:
        """Failure counters by reason code."""
        return dict(self._snapshot().failures)

    @staticmethod
    def _select(
        data: _Data,
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
        self, data: _Data, user: Optional[str], key: Optional[str], job: Optional[object]
    ) -> List[Dict[str, Any]]:
        return self._select(data, user, key, job, _raw_pending)

    # -- node status ------------------------------------------------------------------------

    def status(self, extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """The summary :meth:`publish_status` writes."""
        data = self._snapshot()
        now = self._clock()
        pending_count = pending_bytes = 0
        in_flight: List[Dict[str, Any]] = []
        failed: List[Dict[str, Any]] = []
        jobs: Dict[str, Dict[str, Any]] = {}
        for raw in self._select(data, None, None, None):
            tiers = raw.get("tiers") or {}
            job = str(raw.get("job"))
            js = jobs.setdefault(
                job,
                {
                    "checkpoints": 0,
                    "pending": 0,
                    "pending_bytes": 0,
                    "in_flight": 0,
                    "failed": 0,
                    "keys": [],
                    "latest_step": None,
                    "latest_pfs_verified_step": None,
                    "last_commit_at": None,
                },
            )
            js["checkpoints"] += 1
            uk = f"{raw['user']}/{raw['key']}"
            if uk not in js["keys"]:
                js["keys"].append(uk)
            step = raw["step"]
            if tiers.get("local") in _LIVE_LOCAL:
                js["latest_step"] = max(step, js["latest_step"] or 0)
            if tiers.get("pfs") == State.VERIFIED.value:
                js["latest_pfs_verified_step"] = max(step, js["latest_pfs_verified_step"] or 0)
            committed = (raw.get("committed_at") or {}).get("local")
            if committed is not None:
                js["last_commit_at"] = max(committed, js["last_commit_at"] or 0.0)
            if _is_pending(tiers, raw.get("selected_for_flush"), raw.get("forced")):
                pending_count += 1
                pending_bytes += int(raw.get("nbytes", 0))
                js["pending"] += 1
                js["pending_bytes"] += int(raw.get("nbytes", 0))
            for tier, st in tiers.items():
                if st == State.FLUSHING.value:
                    js["in_flight"] += 1
                    in_flight.append(
                        {
                            "user": raw["user"],
                            "key": raw["key"],
                            "step": step,
                            "tier": tier,
                            "nbytes": raw.get("nbytes", 0),
                            "since": (raw.get("flush_started_at") or {}).get(tier),
                            "attempts": raw.get("attempts", 0),
                        }
                    )
                elif st in _FAILED_STATES:
                    js["failed"] += 1
                    failed.append(
                        {
                            "user": raw["user"],
                            "key": raw["key"],
                            "step": step,
                            "tier": tier,
                            "state": st,
                            "reason": raw.get("error"),
                            "attempts": raw.get("attempts", 0),
                            "at": raw.get("updated_at"),
                        }
                    )
        failed.sort(key=lambda f: f.get("at") or 0.0, reverse=True)
        return {
            "format": STATUS_FORMAT,
            "version": VERSION,
            "node": self.node,
            "time": now,
            "records": len(data.records),
            "pending": {"count": pending_count, "bytes": pending_bytes},
            "in_flight": in_flight[:_STATUS_LIST_CAP],
            "in_flight_count": len(in_flight),
            "failed": failed[:_STATUS_LIST_CAP],
            "failed_count": len(failed),
            "failures": dict(data.failures),
            "jobs": jobs,
            "extra": dict(extra or {}),
        }

    def publish_status(self, pfs_root: Path, extra: Optional[Dict[str, Any]] = None) -> Path:
        """Write this node's status to ``<pfs_root>/.slurm_ckpt/nodes/<node>.json``.

        Atomic (temp file + rename) and symlink-safe: the directories below ``pfs_root``
        and the temp file are opened with ``O_NOFOLLOW``, and the rename replaces whatever
        sits at the final name (a planted symlink included) without following it.
        """
        blob = json.dumps(self.status(extra), separators=(",", ":"), default=str).encode()
        root = Path(pfs_root)
        final = status_path(root, self.node)
        try:
            root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise TierError(f"PFS root {root} is not usable: {exc.strerror or exc}") from exc
        try:
            dir_fd = _open_subdir(root_fd, (".slurm_ckpt", "nodes"), root)
        finally:
            os.close(root_fd)
        name = final.name
        _remove_old_status_temps(dir_fd, f".{name}{_TMP_MARK}", self._clock())
        tmp = f".{name}{_TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, 0o644, dir_fd=dir_fd)
            try:
                with contextlib.suppress(OSError):
                    os.fchmod(fd, 0o644)
                _write_all(fd, blob)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            with contextlib.suppress(OSError):
                os.fsync(dir_fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise TierError(f"cannot write node status {final}: {exc.strerror or exc}") from exc
        finally:
            os.close(dir_fd)
        return final


def _check_ident(user: str, key: str, step: int) -> None:
    if not isinstance(user, str) or not user or not isinstance(key, str) or not key:
        raise InvalidName(f"ledger record needs a user and a key, got {user!r}/{key!r}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InvalidName(f"checkpoint step must be a whole number >= 0, got {step!r}")


def _merge_durations(rec: Record, durations: Optional[Dict[str, float]]) -> None:
    for name, value in (durations or {}).items():
        v = float(value)
        if math.isfinite(v):
            rec.durations[str(name)] = v


def _bump(data: _Data, code: str, n: int = 1) -> int:
    code = _one_line(code, 64) or "unknown"
    data.failures[code] = data.failures.get(code, 0) + int(n)
    data.dirty = True
    return data.failures[code]


def _open_subdir(parent_fd: int, parts: Tuple[str, ...], root: Path) -> int:
    """Open (creating, mode 0o755) ``parts`` below ``parent_fd`` without following links."""
    fd = os.dup(parent_fd)
    where = root
    try:
        for part in parts:
            where = where / part
            try:
                os.mkdir(part, 0o755, dir_fd=fd)
                with contextlib.suppress(OSError):
                    os.chmod(part, 0o755, dir_fd=fd, follow_symlinks=False)
            except FileExistsError:
                pass
            try:
                child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise TierError(f"{where} is not a directory (symlink?); refusing") from exc
                raise TierError(f"cannot open {where}: {exc.strerror or exc}") from exc
            os.close(fd)
            fd = child
        return fd
    except BaseException:
        os.close(fd)
        raise


def _remove_old_status_temps(dir_fd: int, prefix: str, now: float) -> None:
    # Another process of this node may be publishing right now: only remove temp files
    # old enough to be leftovers of a crashed writer.
    with contextlib.suppress(OSError):
        for entry in os.listdir(dir_fd):
            if not entry.startswith(prefix):
                continue
            with contextlib.suppress(OSError):
                st = os.stat(entry, dir_fd=dir_fd, follow_symlinks=False)
                if now - st.st_mtime > _STALE_STATUS_TMP_S:
                    os.unlink(entry, dir_fd=dir_fd)


def status_path(pfs_root: Path, node: str) -> Path:
    """Where ``node`` publishes its status below ``pfs_root``."""
    return Path(pfs_root) / ".slurm_ckpt" / "nodes" / f"{validate_node_name(node)}.json"


def read_node_statuses(pfs_root: Path) -> List[Dict[str, Any]]:
    """Every node status under ``<pfs_root>/.slurm_ckpt/nodes``, sorted by node name.

    Unreadable, oversized, non-regular (symlinks included) or corrupt files are skipped
    with a warning; a missing directory gives an empty list.
    """
    directory = Path(pfs_root) / ".slurm_ckpt" / "nodes"
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    except OSError as exc:
        log.warning("cannot list node statuses in %s: %s", directory, exc.strerror or exc)
        return []
    out: List[Dict[str, Any]] = []
    for name in names:
        if not name.endswith(".json") or name.startswith("."):
            continue
        path = directory / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            log.warning("skipping node status %s: %s", path, exc.strerror or exc)
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                log.warning("skipping node status %s: not a regular file", path)
                continue
            if st.st_size > _MAX_STATUS_BYTES:
                log.warning("skipping node status %s: too large (%d bytes)", path, st.st_size)
                continue
            with os.fdopen(os.dup(fd), "rb") as fh:
                blob = fh.read(_MAX_STATUS_BYTES + 1)
        except OSError as exc:
            log.warning("skipping node status %s: %s", path, exc.strerror or exc)
            continue
        finally:
            os.close(fd)
        try:
            doc = json.loads(blob)
        except (ValueError, UnicodeDecodeError):
            log.warning("skipping node status %s: not valid JSON", path)
            continue
        if not isinstance(doc, dict) or not isinstance(doc.get("node"), str):
            log.warning("skipping node status %s: not a node status", path)
            continue
        out.append(doc)
    out.sort(key=lambda d: d["node"])
    return out
