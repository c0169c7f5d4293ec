"""The checkpoint manifest: what a checkpoint holds, and proof of what its bytes were.

The manifest is written last; its presence is what makes a checkpoint exist. It records,
for every payload file, the relative path, size and chunked content hash, plus the
checkpoint's identity (user, key, step, job, node) and progress (tokens, wall time).

The manifest protects itself: it carries a checksum over its own canonical serialisation,
and a reader accepts the file only if its bytes are *exactly* that serialisation. So any
single changed byte in the manifest - a digit of a size, a hash character, even whitespace
- is detected, not just the bytes of the payload.

A checksum proves integrity, not good intent: anyone who writes a checkpoint writes its
manifest, and root-run code reads manifests of every user. So every field is validated
as hostile input: no non-finite number anywhere (``NaN``, ``Infinity``, ``1e400``: they
break arithmetic downstream), no control characters in any name (``job``, ``node``, the
keys of ``meta``: a newline would forge lines in ``status`` output), paths that stay
inside the checkpoint, hashes that are hashes.
"""

from __future__ import annotations

import json
import math
import re
import time
import unicodedata
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import xxhash

from slurm_ckpt.core.hashing import DEFAULT_CHUNK_SIZE, HASH_ALGO, chunk_count
from slurm_ckpt.core.manifest_limits import check_bytes, check_entries
from slurm_ckpt.core.names import validate_key, validate_relpath, validate_user
from slurm_ckpt.core.replicas import suspect_text
from slurm_ckpt.errors import InvalidName, VerifyError

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
#: Where the manifest of a copy found damaged goes (:meth:`PosixTier.uncommit`): the step
#: stops counting - no listing, restore or flush takes it for a checkpoint - and the
#: evidence stays until the step is written again or swept.
DAMAGED_MANIFEST_NAME = "manifest.json.damaged"
_HEX32 = set("0123456789abcdef")


@dataclass(frozen=True)
class FileEntry:
    """One payload file: relative path, size in bytes, file hash and chunk digests."""

    path: str
    size: int
    hash: str
    chunks: List[str] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        return {"path": self.path, "size": self.size, "hash": self.hash, "chunks": self.chunks}


@dataclass(frozen=True)
class Manifest:
    """Everything needed to find, verify and resume from one checkpoint."""

    user: str
    key: str
    step: int
    files: List[FileEntry]
    tokens: Optional[int] = None
    wall_time: float = field(default_factory=time.time)
    job: Optional[str] = None
    node: Optional[str] = None
    meta: Dict[str, Any] = field(default_factory=dict)
    hash_algo: str = HASH_ALGO
    chunk_size: int = DEFAULT_CHUNK_SIZE
    format_version: int = FORMAT_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def file(self, path: str) -> FileEntry:
        for f in self.files:
            if f.path == path:
                return f
        raise KeyError(path)

    def _body(self) -> Dict[str, Any]:
        return {
            "format_version": self.format_version,
            "user": self.user,
            "key": self.key,
            "step": self.step,
            "tokens": self.tokens,
            "wall_time": self.wall_time,
            "job": self.job,
            "node": self.node,
            "hash_algo": self.hash_algo,
            "chunk_size": self.chunk_size,
            "files": [f.to_dict() for f in sorted(self.files, key=lambda f: f.path)],
            "meta": self.meta,
        }

    def to_bytes(self) -> bytes:
        body = self._body()
        body["checksum"] = _checksum(body)
        return _serialise(body)

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "manifest") -> Manifest:
        """Parse and fully validate; any inconsistency raises :class:`VerifyError`.

        The bytes are held to the size, depth and entry limits first
        (:mod:`~slurm_ckpt.core.manifest_limits`); a parser that still runs out of stack
        or memory on them is damage of this manifest too, never an error of the reader.
        """
        try:
            return cls._from_bytes(data, where)
        except (RecursionError, MemoryError) as exc:
            raise VerifyError(f"{where}: not a valid manifest ({type(exc).__name__})") from None

    @classmethod
    def _from_bytes(cls, data: bytes, where: str) -> Manifest:
        check_bytes(data, where)
        try:
            doc = _loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise VerifyError(f"{where}: not a valid manifest ({exc})") from None
        if not isinstance(doc, dict) or "checksum" not in doc:
            raise VerifyError(f"{where}: not a valid manifest (no checksum)")
        if _serialise(doc) != data:
            raise VerifyError(f"{where}: manifest bytes altered (not canonical)")
        claimed = doc.pop("checksum")
        if claimed != _checksum(doc):
            raise VerifyError(f"{where}: manifest checksum mismatch")
        try:
            return cls._from_doc(doc, where)
        except (KeyError, TypeError, ValueError, InvalidName) as exc:
            raise VerifyError(f"{where}: malformed manifest ({exc})") from None

    @classmethod
    def _from_doc(cls, doc: Dict[str, Any], where: str) -> Manifest:
        version = doc["format_version"]
        if version != FORMAT_VERSION:
            raise VerifyError(f"{where}: unsupported manifest format version {version!r}")
        if doc["hash_algo"] != HASH_ALGO:
            raise VerifyError(f"{where}: unsupported hash {doc['hash_algo']!r}")
        chunk_size = int(doc["chunk_size"])
        if chunk_size <= 0:
            raise ValueError("chunk_size must be positive")
        check_entries(len(doc["files"]), where)
        files = []
        seen = set()
        for f in doc["files"]:
            path = validate_relpath(f["path"])
            size = int(f["size"])
            chunks = [str(c) for c in f["chunks"]]
            if size < 0 or len(chunks) != chunk_count(size, chunk_size) or path in seen:
                raise ValueError(f"inconsistent entry for {path}")
            if not all(len(c) == 32 and set(c) <= _HEX32 for c in chunks):
                raise ValueError(f"bad chunk digest for {path}")
            digest = f["hash"]
            if not isinstance(digest, str) or len(digest) != 32 or not set(digest) <= _HEX32:
                raise ValueError(f"bad file hash for {path}")
            seen.add(path)
            files.append(FileEntry(path, size, digest, chunks))
        step = int(doc["step"])
        if step < 0:
            raise ValueError("negative step")
        return cls(
            user=validate_user(doc["user"]),
            key=validate_key(doc["key"]),
            step=step,
            files=files,
            tokens=None if doc["tokens"] is None else int(doc["tokens"]),
            wall_time=_finite(doc["wall_time"], "wall_time"),
            job=_label(doc["job"], "job"),
            node=_label(doc["node"], "node"),
            meta=_meta(doc["meta"]),
            hash_algo=doc["hash_algo"],
            chunk_size=chunk_size,
            format_version=version,
        )


def _no_number(text: str) -> Any:
    raise ValueError(f"non-finite number {text} is not allowed")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} out of range")
    return value


def _loads(text: str) -> Any:
    """``json.loads`` that refuses ``NaN``, ``Infinity`` and floats that overflow."""
    return json.loads(text, parse_constant=_no_number, parse_float=_finite_float)


def has_control(text: str) -> bool:
    """Control characters (C0, C1, DEL), format characters (bidi overrides, zero-width),
    Unicode line/paragraph separators or surrogates: none of them may sit in a label
    root prints (a bidi override makes a line read backwards)."""
    if text.isascii():  # the common case, in C: ASCII's only such characters are C0/DEL
        return not text.isprintable()
    return any(unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp", "Cs") for c in text)


def _finite(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{name} must be a finite number")
    return out


def _label(value: Any, name: str) -> Optional[str]:
    """``job``/``node``: None, or one line of printable text (at most 256 characters)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"{name} must be a string")
    text = str(value)
    if len(text) > 256 or has_control(text):
        raise ValueError(f"{name} must be one line of at most 256 printable characters")
    return text


def _is_relpath(path: Any) -> bool:
    try:
        validate_relpath(path)
    except InvalidName:
        return False
    return True


def _meta(value: Any, depth: int = 0) -> Any:
    """``meta`` (a dict): every key, at any depth, printable text."""
    if depth == 0 and not isinstance(value, dict):
        raise ValueError("meta must be an object")
    if depth > 32:
        raise ValueError("meta nested too deep")
    if isinstance(value, dict):
        for k, v in value.items():
            if has_control(k) or len(k) > 256:
                raise ValueError("meta keys must be one line of at most 256 printable characters")
            _meta(v, depth + 1)
        return dict(value) if depth == 0 else value
    if isinstance(value, list):
        for v in value:
            _meta(v, depth + 1)
    return value


def _serialise(doc: Dict[str, Any]) -> bytes:
    return (json.dumps(doc, sort_keys=True, indent=1, ensure_ascii=True) + "\n").encode()


def _checksum(body: Dict[str, Any]) -> str:
    return xxhash.xxh3_128_hexdigest(_serialise(body))


_CHECKSUM_LINE = re.compile(rb'\A\{\n "checksum": "([0-9a-f]{32})",\n')


@dataclass(frozen=True)
class ManifestFacts:
    """The few manifest fields status needs."""

    user: str
    key: str
    step: int
    wall_time: float
    nbytes: int
    job: Optional[str]
    node: Optional[str]
    #: ``meta["data_version"]`` (what the checkpoint was trained on), one line, or None.
    data_version: Optional[str] = None
    #: Why the replicas did not agree on this step (:mod:`slurm_ckpt.core.replicas`).
    suspect: Optional[str] = None


def data_version_of(meta: Any) -> Optional[str]:
    """``meta["data_version"]`` as one printable line of at most 200 characters."""
    value = meta.get("data_version") if isinstance(meta, dict) else None
    if value is None:
        return None
    text = "".join(c if c.isprintable() else " " for c in str(value))
    text = " ".join(text.split())
    return text[:197] + "..." if len(text) > 200 else text


def manifest_facts(data: bytes) -> ManifestFacts:
    """Check a manifest's integrity and pull out what status needs; VerifyError if bad.

    The fast path relies on the canonical form :class:`Manifest` writes (sorted keys, so
    the checksum is the first line): the checksum is recomputed over the file's own bytes
    minus that line, which is exactly the serialisation it was computed over, so any
    changed byte is still caught, and only C-speed ``json.loads`` remains (the full
    :meth:`Manifest.from_bytes` re-serialises twice in pure Python, about 3x the cost).
    Anything the fast path cannot settle goes through the full parse, which decides.
    """
    check_bytes(data)
    try:
        return _facts(data)
    except (RecursionError, MemoryError) as exc:
        raise VerifyError(f"manifest: not a valid manifest ({type(exc).__name__})") from None


def _facts(data: bytes) -> ManifestFacts:
    m = _CHECKSUM_LINE.match(data)
    if m is not None and xxhash.xxh3_128_hexdigest(b"{\n" + data[m.end() :]) == m.group(1).decode():
        try:
            doc = _loads(data.decode("utf-8"))
            files = doc["files"]
            check_entries(len(files))
            nbytes = sum(int(f["size"]) for f in files)
            if (
                doc["format_version"] == FORMAT_VERSION
                and type(doc["step"]) is int
                and isinstance(doc["wall_time"], (int, float))
                and isinstance(doc["user"], str)
                and isinstance(doc["key"], str)
                and all(int(f["size"]) >= 0 for f in files)
                and all(_is_relpath(f["path"]) for f in files)
                and _meta(doc["meta"]) is not None
            ):
                return ManifestFacts(
                    doc["user"],
                    doc["key"],
                    doc["step"],
                    _finite(doc["wall_time"], "wall_time"),
                    nbytes,
                    _label(doc["job"], "job"),
                    _label(doc["node"], "node"),
                    data_version_of(doc.get("meta")),
                    suspect_text(doc.get("meta")),
                )
        except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError):
            pass
    full = Manifest.from_bytes(data)
    return ManifestFacts(
        full.user,
        full.key,
        full.step,
        full.wall_time,
        full.total_bytes,
        full.job,
        full.node,
        data_version_of(full.meta),
        suspect_text(full.meta),
    )
