"""The ledger's file format: JSON Lines with a checksummed trailer, parsed lazily.

File layout (every line valid JSON)::

    {"format":"slurm_ckpt.ledger","version":1,"node":...,"records":N,"failures":{...}}
    ["alice","run1",100,<TAB>{"tiers":{"local":"COMMITTED","pfs":"FLUSHING"},...}]

(``"pfs"`` there is the warm tier's slot, :data:`~slurm_ckpt.ledger.record.WARM_SLOT`.)
    ...
    {"end":N,"xxh3_64":"<hex digest of every byte before this line>"}

Loading only cuts each line at its tab (the part before it, canonical JSON of
``[user, key, step``, is the index key); a record is parsed when it is needed, and parsed
records are cached across loads, so loading and saving 10,000 records takes tens of
milliseconds. Anything that does not fit the layout, or a checksum mismatch, is
:class:`Corrupt`.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import fields
from typing import Any, Dict, Iterable, List, Optional, Tuple

import xxhash

from slurm_ckpt.ledger.record import STATES, Ident, Record, is_pending

log = logging.getLogger(__name__)

__all__ = [
    "FORMAT",
    "MUTABLE_FIELDS",
    "VERSION",
    "Corrupt",
    "Data",
    "from_raw",
    "parse",
    "pkey",
    "raw_pending",
    "serialise",
    "to_raw",
]

FORMAT = "slurm_ckpt.ledger"
VERSION = 1

FIELD_NAMES = tuple(f.name for f in fields(Record))
_KNOWN = frozenset(FIELD_NAMES) - {"extra"}
MUTABLE_FIELDS = frozenset(_KNOWN - {"user", "key", "step", "tiers"})
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


def raw_pending(raw: Dict[str, Any]) -> bool:
    return is_pending(raw.get("tiers") or {}, raw.get("selected_for_flush"), raw.get("forced"))


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


def from_raw(raw: Dict[str, Any]) -> Record:
    kwargs: Dict[str, Any] = {}
    extra: Dict[str, Any] = {}
    for name, value in raw.items():
        if name in _KNOWN:
            kwargs[name] = value
        else:
            extra[name] = value
    for name in _DICT_FIELDS:
        kwargs[name] = dict(kwargs.get(name) or {})
    kwargs["tiers"] = {t: STATES.get(v, v) for t, v in kwargs["tiers"].items()}
    rec = Record(**kwargs)
    if rec.job is not None:
        rec.job = str(rec.job)
    rec.extra = copy.deepcopy(extra) if extra else extra
    return rec


def to_raw(rec: Record) -> Dict[str, Any]:
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


def pkey(user: str, key: str, step: int) -> bytes:
    """Canonical line prefix of a record: ``["user","key",step,`` (also the index key)."""
    return json.dumps([user, key, step], separators=(",", ":")).encode()[:-1] + b","


def pkey_of(raw: Dict[str, Any]) -> bytes:
    return pkey(raw["user"], raw["key"], raw["step"])


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


class Data:
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
            if raw is None or pkey_of(raw) != pk:
                return None
            self.cache[pk] = (v, raw)
        return raw

    def get(self, ident: Ident) -> Optional[Dict[str, Any]]:
        return self.get_p(pkey(*ident))

    def put(self, raw: Dict[str, Any]) -> None:
        self.records[pkey_of(raw)] = raw
        self.dirty = True

    def pop(self, ident: Ident) -> bool:
        if self.records.pop(pkey(*ident), None) is None:
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


class Corrupt(Exception):
    pass


def parse(blob: bytes, cache: Dict[bytes, Any], where: object) -> Data:
    """File layout (JSON Lines): a header object; one line per record,
    ``["user","key",step,<TAB>{other fields}]`` (valid JSON: the tab is whitespace, and
    it makes the record's identity cheap to cut off); a trailer
    ``{"end": <records>, "xxh3_64": <hex of every byte before the trailer>}``.
    Anything else, or a checksum mismatch, is corrupt."""
    if not blob.endswith(b"\n"):
        raise Corrupt("truncated (no final newline)")
    cut = blob.rfind(b"\n", 0, len(blob) - 1) + 1
    first = blob.find(b"\n")
    if cut <= 0 or first + 1 > cut:
        raise Corrupt("no header or trailer")
    try:
        trailer = json.loads(blob[cut:])
        header = json.loads(blob[:first])
    except (ValueError, UnicodeDecodeError):
        raise Corrupt("unreadable header or trailer") from None
    if not isinstance(trailer, dict) or not isinstance(header, dict):
        raise Corrupt("bad header or trailer")
    if header.get("format") != FORMAT:
        raise Corrupt("not a slurm_ckpt ledger")
    if trailer.get("xxh3_64") != xxhash.xxh3_64_hexdigest(memoryview(blob)[:cut]):
        raise Corrupt("checksum mismatch")
    count = header.get("records")
    if trailer.get("end") != count or not isinstance(count, int):
        raise Corrupt("record count mismatch")
    failures = header.get("failures") or {}
    if not isinstance(failures, dict):
        raise Corrupt("bad failure counters")
    data = Data(cache)
    for code, n in failures.items():
        if isinstance(n, int) and not isinstance(n, bool):
            data.failures[str(code)] = n
    body = blob[first + 1 : cut - 1]
    if count == 0:
        if body:
            raise Corrupt("record count mismatch")
        return data
    # Fast path: "P1<TAB>R1<NL>P2<TAB>R2..." -> [P1, R1, P2, R2, ...] in C.
    parts = body.replace(b"\n", _SEP).split(_SEP)
    if len(parts) == 2 * count:
        data.records = dict(zip(parts[0::2], parts[1::2]))
        if len(data.records) != count:
            log.warning("ledger %s: duplicate records; keeping the last", where)
    else:
        _parse_slow(body, count, data, where)
    if len(cache) > 2 * len(data.records) + 256:
        cache.clear()
    return data


def _parse_slow(body: bytes, count: int, data: Data, where: object) -> None:
    """Lines not in the canonical form: parse each one, re-key it, drop bad ones."""
    lines = body.split(b"\n")
    if len(lines) != count:
        raise Corrupt("record count mismatch")
    bad = 0
    for line in lines:
        raw = _decode_line(line)
        if raw is None:
            bad += 1
            continue
        data.records[pkey_of(raw)] = raw
    data.dirty = True  # rewrite in canonical form at the next transaction
    if bad:
        log.warning(
            "ledger %s: ignored %d malformed record(s); reconcile with the tiers to rebuild them",
            where,
            bad,
        )


def serialise(data: Data, node: str, now: float) -> bytes:
    """The whole ledger as bytes (see the module docstring for the layout)."""
    header = {
        "format": FORMAT,
        "version": VERSION,
        "node": node,
        "updated_at": now,
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
        raise ValueError(f"cannot serialise ledger: {exc}") from exc
    lines.append(b"")
    body = b"\n".join(lines)
    trailer = {"end": len(data.records), "xxh3_64": xxhash.xxh3_64_hexdigest(body)}
    return body + json.dumps(trailer, separators=(",", ":")).encode() + b"\n"
