"""Structured events: one JSON line per save, flush, failure and hook run, per node.

Why a log next to the ledger: the ledger holds *state* (what is where right now) and
forgets finished records; an operator debugging a bad night also needs *history* (how
long each save stalled training, which flush failed and why, when the epilog ran and how
long it took), and dashboards need counters that only ever grow. Both come from here.

Where
-----
``<metrics.events_dir>/events-<node>.jsonl`` when ``metrics.events_dir`` is configured
(the node is in the name because such a directory may be shared by nodes), else
``<ledger dir>/events.jsonl`` (node-local already). See :func:`events_path`.

Line format
-----------
One compact JSON object per line::

    {"ts": 1700000000.123, "type": "flush", "node": "n001", "pid": 4242,
     "user": "alice", "key": "run1", "step": 100, "flush_s": 3.2, "nbytes": 1048576}

``ts``, ``type``, ``node`` and ``pid`` are always present; the rest are the caller's
fields (non-finite floats become null, unknown objects their ``str``). Standard types and
the fields the metrics read from them:

* ``save``: ``user``, ``key``, ``step``, ``stall_s`` (time the training loop was blocked)
* ``local_write``: ``user``, ``key``, ``step``, ``local_s``, ``nbytes``
* ``flush``: ``user``, ``key``, ``step``, ``flush_s``, ``nbytes``, ``tier``
* ``failure``: ``reason`` (a short code such as ``flush_failed``), ``error`` (one line)
* ``hook``: ``hook`` (``prolog``/``epilog``/``stager``), ``seconds``, ``ok``
* ``admission`` / ``admission_refused``: a PFS slot granted / not granted within the
  flusher's budget: ``wait_s``, ``queue_depth``, ``holders``, ``priority``

Other names (lower-case, ``[a-z][a-z0-9_]*``) are accepted, so a newer caller never
breaks an older reader.

Concurrency and rotation
------------------------
Each line is appended with ``O_APPEND`` and exactly one ``write(2)``: the kernel places
and writes it under the inode lock, so lines of concurrent processes on one node never
interleave (true on local filesystems; NFS gives no such promise, one more reason the
default lives on node-local storage). When the file has reached ``max_bytes``, the writer
that notices takes an ``flock`` on ``<file>.lock``, checks that nobody rotated in the
meantime (same inode), shifts ``<file>.1`` -> ``<file>.2`` ... and renames the file to
``<file>.1``. A writer that opened the old file a moment earlier appends to ``<file>.1``:
nothing is lost.

Summary
-------
Under the same lock each event also updates ``<file>.summary.json``: counts per type, the
total of flushed bytes, the last numeric fields per series (``user/key``) or per hook, and
the suspect steps: ``replicas_suspect`` events counted once per ``(user, key, step)``
(every rank of a job emits one for the same step, and root's hooks record one per step
they find flagged in a manifest; a rank's series ``KEY.rankNNNNN`` counts as ``KEY``).
The steps remembered for that are bounded (:mod:`slurm_ckpt.ledger.suspect_steps`), so a
user who forges many suspect steps cannot grow the file without bound.
:mod:`slurm_ckpt.ledger.metrics` reads it to export counters and the last hook runs
without re-reading the log. It is a cache: losing it only resets counters (Prometheus
handles counter resets).

Emitting never raises for I/O problems (a full disk must not break checkpointing): it
logs one warning per file and returns False.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import re
import socket
import threading
import time
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Union

from slurm_ckpt.core import fsio
from slurm_ckpt.core.config import Config
from slurm_ckpt.core.names import node_name, validate_node
from slurm_ckpt.ledger.suspect_steps import SUSPECT, count_of, remember, seen

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_BACKUPS",
    "DEFAULT_MAX_BYTES",
    "EVENT_TYPES",
    "SUSPECT",
    "EventLog",
    "configure",
    "current",
    "default_node",
    "emit",
    "events_path",
    "listener",
    "read_events",
    "read_summary",
    "summary_path",
]

#: The event types slurm_ckpt itself emits (others are accepted too).
EVENT_TYPES = ("save", "local_write", "flush", "failure", "hook", "admission", "admission_refused")
#: A slot for a flush to the PFS granted / not granted within the budget
#: (:func:`slurm_ckpt.admission.decisions.decision_event`): ``wait_s``, ``queue_depth``,
#: ``holders``, ``priority``.
ADMISSION_TYPES = ("admission", "admission_refused")
DEFAULT_MAX_BYTES = 16 * 2**20
DEFAULT_BACKUPS = 3
#: One line is written with one write(2); keep it well below any sane pipe/page limits.
MAX_LINE = 64 * 1024
_MAX_STR = 4096
_MAX_LABELS = 512
_RESERVED = frozenset({"ts", "type"})
_TYPE_RE = re.compile(r"[a-z][a-z0-9_]{0,63}")
_SUMMARY_FORMAT = "slurm_ckpt.events_summary"
_O_APPEND = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_FILE_MODE = 0o644
#: The rotation/summary lock is waited for at most this long (then: no summary update).
_LOCK_WAIT_S = 5.0
#: Temp files of the summary older than this are a killed writer's.
_STALE_TMP_S = 3600.0

PathLike = Union[str, "os.PathLike[str]"]


def default_node() -> str:
    """The short host name, as a node name. Code that runs under SLURM passes the SLURM
    node name instead (:func:`slurm_ckpt.slurm.env.this_node`, the one reader of SLURM's
    variables)."""
    return node_name(socket.gethostname())


def events_path(cfg: Config, node: Optional[str] = None) -> Path:
    """The event log of ``node`` (default: this one) under ``cfg``; see the module doc."""
    if cfg.metrics.events_dir is not None:
        name = validate_node(node or default_node())
        return Path(cfg.metrics.events_dir) / f"events-{name}.jsonl"
    return Path(cfg.ledger.dir) / "events.jsonl"


def summary_path(path: PathLike) -> Path:
    """The summary file kept next to the event log ``path``."""
    return Path(os.fspath(path) + ".summary.json")


def _clean(value: Any, depth: int = 0) -> Any:
    """A JSON-safe copy: finite numbers, bounded strings, plain containers."""
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Enum):
        return _clean(value.value, depth)
    if isinstance(value, str):
        return value if len(value) <= _MAX_STR else value[: _MAX_STR - 3] + "..."
    if isinstance(value, os.PathLike):
        return _clean(os.fspath(value), depth)
    if depth < 4 and isinstance(value, dict):
        return {str(k): _clean(v, depth + 1) for k, v in value.items()}
    if depth < 4 and isinstance(value, (list, tuple, set, frozenset)):
        return [_clean(v, depth + 1) for v in value]
    return _clean(str(value), depth)


class EventLog:
    """The event log of one node: append, rotate, summarise. Safe across processes."""

    def __init__(
        self,
        path: PathLike,
        node: Optional[str] = None,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        backups: int = DEFAULT_BACKUPS,
        summary: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if max_bytes < 1 or backups < 1:
            raise ValueError("EventLog: max_bytes and backups must be at least 1")
        self.path = Path(os.fspath(path))
        self.node = validate_node(node or default_node())
        self.max_bytes = int(max_bytes)
        self.backups = int(backups)
        self.summary = summary
        self._clock = clock
        self._warned = False
        self._local = threading.Lock()  # threads of one process: one rotation at a time

    @classmethod
    def from_config(cls, cfg: Config, node: Optional[str] = None, **kw: Any) -> EventLog:
        """The node's event log as the site configuration places it."""
        return cls(events_path(cfg, node), node, **kw)

    def __repr__(self) -> str:
        return f"EventLog({str(self.path)!r}, node={self.node!r})"

    @property
    def summary_path(self) -> Path:
        return summary_path(self.path)

    @property
    def lock_path(self) -> Path:
        return Path(os.fspath(self.path) + ".lock")

    # -- writing ------------------------------------------------------------------------

    def make(self, event_type: str, **fields: Any) -> Dict[str, Any]:
        """The event as it will be written (validated and cleaned), without writing it."""
        if not isinstance(event_type, str) or not _TYPE_RE.fullmatch(event_type):
            raise ValueError(f"event type {event_type!r}: use lower-case [a-z][a-z0-9_]*")
        clash = _RESERVED & set(fields)
        if clash:
            raise TypeError(f"emit(): field(s) {', '.join(sorted(clash))} are reserved")
        event: Dict[str, Any] = {
            "ts": round(self._clock(), 6),
            "type": event_type,
            "node": self.node,
            "pid": os.getpid(),
        }
        for name, value in fields.items():
            event[name] = _clean(value)
        return event

    def emit(self, event_type: str, **fields: Any) -> bool:
        """Append one event (and update the summary). False if it could not be written."""
        event = self.make(event_type, **fields)
        line = _encode(event)
        try:
            self._append(line)
        except OSError as exc:
            self._warn(exc)
            return False
        if self.summary:
            try:
                with self._locked():
                    self._update_summary(event)
            except OSError as exc:
                self._warn(exc)
        return True

    def emit_suspect_once(self, **fields: Any) -> bool:
        """Append a :data:`SUSPECT` event unless the summary already counted its
        ``(user, key, step)``: True when it was written. The check and the append are
        one step under the summary's lock, so root's hooks - prolog, epilog, stager, in
        any order and as often as they scan - record each suspect step they find once."""
        if not self.summary:
            return self.emit(SUSPECT, **fields)
        event = self.make(SUSPECT, **fields)
        try:
            with self._locked():
                doc = read_summary(self.path)
                if seen(doc, event):
                    return False
                self._append(_encode(event), locked=True)
                self._update_summary(event, doc)
        except OSError as exc:
            self._warn(exc)
            return False
        return True

    def _warn(self, exc: OSError) -> None:
        if not self._warned:  # once per log: a full disk must not flood the job's output
            self._warned = True
            log.warning("event log %s not written: %s", self.path, exc.strerror or exc)

    def _open_log(self) -> int:
        """The log, opened for appending: never through a symlink, never blocking on a
        FIFO, only a regular file with one link (OSError otherwise)."""
        fd = os.open(self.path, _O_APPEND, _FILE_MODE)
        try:
            fsio.check_file(fd, str(self.path))
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _append(self, line: bytes, locked: bool = False) -> None:
        self.path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        fd = self._open_log()
        try:
            st = os.fstat(fd)
            if st.st_size and st.st_size + len(line) > self.max_bytes:
                os.close(fd)
                fd = -1
                if locked:
                    self._rotate_held(st.st_ino)
                else:
                    self._rotate(st.st_ino)
                fd = self._open_log()
            n = os.write(fd, line)
            if n != len(line):  # only on ENOSPC/EDQUOT: the line is torn; readers skip it
                raise OSError(errno.ENOSPC, f"short write ({n} of {len(line)} bytes)")
        finally:
            if fd >= 0:
                os.close(fd)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        # 0600, and never waited on for long: a lock file other users could open is one
        # they could hold forever, stalling every writer (root's hooks among them).
        with self._local:
            fd = os.open(
                self.lock_path,
                os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                0o600,
            )
            try:
                fsio.check_file(fd, str(self.lock_path))
                end = time.monotonic() + _LOCK_WAIT_S
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() >= end:
                            raise OSError(errno.EAGAIN, f"{self.lock_path} stays locked") from None
                        time.sleep(0.01)
                yield
            finally:
                os.close(fd)

    def _rotate(self, inode: int) -> None:
        with self._locked():
            self._rotate_held(inode)

    def _rotate_held(self, inode: int) -> None:
        """Rotate, the lock held."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return
        if st.st_ino != inode:
            return  # another writer rotated while we waited for the lock
        base = os.fspath(self.path)
        for i in range(self.backups - 1, 0, -1):
            with contextlib.suppress(FileNotFoundError):
                os.replace(f"{base}.{i}", f"{base}.{i + 1}")
        os.replace(base, f"{base}.1")

    def _update_summary(self, event: Dict[str, Any], doc: Optional[Dict[str, Any]] = None) -> None:
        if doc is None:
            doc = read_summary(self.path)
        etype = event["type"]
        doc["counts"][etype] = int(doc["counts"].get(etype, 0)) + 1
        if etype == SUSPECT and remember(doc, event):
            doc["suspect_steps"] = count_of(doc) + 1
        if etype == "flush":
            nbytes = event.get("nbytes")
            if isinstance(nbytes, int) and not isinstance(nbytes, bool) and nbytes > 0:
                doc["flushed_bytes"] = int(doc.get("flushed_bytes", 0)) + nbytes
        if etype in ADMISSION_TYPES:
            # Summed, so that rate(sum)/rate(count) is the mean wait for a PFS slot.
            wait = event.get("wait_s")
            if isinstance(wait, (int, float)) and not isinstance(wait, bool) and wait >= 0:
                doc["admission_wait_s"] = float(doc.get("admission_wait_s", 0.0)) + wait
        label = _label(event)
        if label is not None:
            last = doc["last"].setdefault(etype, {})
            entry = {"ts": event["ts"]}
            for name, value in event.items():
                if name in ("ts", "type", "pid", "step"):
                    continue
                if isinstance(value, (bool, int, float)):
                    entry[name] = value
            last[label] = entry
            excess = len(last) - _MAX_LABELS
            if excess > 0:
                for old in sorted(last, key=lambda k: last[k].get("ts", 0.0))[:excess]:
                    del last[old]
        doc["updated_at"] = event["ts"]
        blob = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
        target = self.summary_path
        dfd = fsio.open_dir(str(target.parent))
        try:
            fsio.remove_stale_temps(dfd, target.name, _STALE_TMP_S)
            # Not durable: a cache; a crash costs a counter reset at most.
            fsio.atomic_replace(dfd, target.name, blob, _FILE_MODE, durable=False)
        finally:
            os.close(dfd)


def _encode(event: Dict[str, Any]) -> bytes:
    line = json.dumps(event, separators=(",", ":"), allow_nan=False, default=str) + "\n"
    data = line.encode()
    if len(data) <= MAX_LINE:
        return data
    head = {k: event[k] for k in ("ts", "type", "node", "pid")}
    head["truncated"] = len(data)
    for name in ("user", "key", "step", "reason", "hook"):
        if name in event:
            head[name] = event[name]
    return (json.dumps(head, separators=(",", ":"), default=str)[: MAX_LINE - 1] + "\n").encode()


def _label(event: Dict[str, Any]) -> Optional[str]:
    """The series a summary entry belongs to: a hook's name, ``pool`` for the admission
    decisions (one queue, cluster-wide), or ``user/key``."""
    if event["type"] in ADMISSION_TYPES:
        return "pool"
    if event["type"] == "hook":
        hook = event.get("hook")
        return str(hook) if hook else None
    user, key = event.get("user"), event.get("key")
    if isinstance(user, str) and isinstance(key, str) and user and key:
        return f"{user}/{key}"
    return None


def _empty_summary() -> Dict[str, Any]:
    return {"format": _SUMMARY_FORMAT, "counts": {}, "flushed_bytes": 0, "last": {}}


def read_summary(path: PathLike) -> Dict[str, Any]:
    """The summary of the event log ``path`` (an empty one if missing or unreadable)."""
    target = summary_path(path)
    try:
        dfd = fsio.open_dir(str(target.parent))
        try:
            doc = json.loads(fsio.read_regular(dfd, target.name, 4 * 2**20)[0])
        finally:
            os.close(dfd)
    except (OSError, ValueError, UnicodeDecodeError):
        return _empty_summary()
    if (
        not isinstance(doc, dict)
        or doc.get("format") != _SUMMARY_FORMAT
        or not isinstance(doc.get("counts"), dict)
        or not isinstance(doc.get("last"), dict)
    ):
        return _empty_summary()
    return doc


def read_events(path: PathLike, since: Optional[float] = None) -> Iterator[Dict[str, Any]]:
    """Every readable event of the log ``path``, oldest first (rotated files included).

    Lines that are not JSON objects (a line torn by a full disk) are skipped.
    """
    base = os.fspath(path)
    files: List[str] = []
    i = 1
    while os.path.exists(f"{base}.{i}"):
        files.append(f"{base}.{i}")
        i += 1
    files.reverse()
    files.append(base)
    for name in files:
        try:
            fd = os.open(name, fsio.O_READ | os.O_NONBLOCK)
            try:
                fsio.check_file(fd, name)
            except BaseException:
                os.close(fd)
                raise
            with os.fdopen(fd, "rb") as fh:
                for raw in fh:
                    try:
                        event = json.loads(raw)
                    except (ValueError, UnicodeDecodeError):
                        continue
                    if not isinstance(event, dict):
                        continue
                    if since is not None and float(event.get("ts", 0.0)) < since:
                        continue
                    yield event
        except OSError:
            continue  # gone (rotated meanwhile), or not a plain file: skipped


# -- the process-wide log -------------------------------------------------------------------

_current: Optional[EventLog] = None
_current_lock = threading.Lock()


def configure(
    cfg: Optional[Config] = None,
    node: Optional[str] = None,
    *,
    path: Optional[PathLike] = None,
    **kw: Any,
) -> Optional[EventLog]:
    """Set the log :func:`emit` writes to: from ``cfg`` (see :func:`events_path`) or an
    explicit ``path``; neither switches events off. Returns the new log."""
    global _current
    if path is not None:
        new: Optional[EventLog] = EventLog(path, node, **kw)
    elif cfg is not None:
        new = EventLog.from_config(cfg, node, **kw)
    else:
        new = None
    with _current_lock:
        _current = new
    return new


def current() -> Optional[EventLog]:
    """The log :func:`emit` writes to (None until :func:`configure`)."""
    return _current


def emit(event_type: str, **fields: Any) -> bool:
    """Append an event to the configured log (see :func:`configure`).

    Without a configured log this does nothing and returns False, so library code can emit
    unconditionally; the hooks and the job wrapper configure it from the site config.
    """
    target = _current
    if target is None:
        return False
    return target.emit(event_type, **fields)


#: Checkpointer progress callback names -> (event type, fields renamed).
_CHECKPOINTER_EVENTS = {
    "save_returned": "save",
    "local_done": "local_write",
    "flush_done": "flush",
    "local_failed": "failure",
    "flush_failed": "failure",
    # the replicas' verdicts (slurm_ckpt.core.replicas): what the suspect-steps metric
    # counts and what an admin reads to find the node that corrupts
    "replicas_suspect": "replicas_suspect",
    "replicas_unchecked": "replicas_unchecked",
}
_FAILURE_CODES = {"local_failed": "local_write_failed", "flush_failed": "flush_failed"}


def listener(
    user: str,
    key: str,
    job: Optional[object] = None,
    log_: Optional[EventLog] = None,
) -> Callable[[str, Dict[str, Any]], None]:
    """An ``on_event(name, info)`` callback for the job layer's Checkpointer.

    Turns its progress callbacks into events (``save_returned`` -> ``save``,
    ``local_done`` -> ``local_write``, ``flush_done`` -> ``flush``, ``*_failed`` ->
    ``failure``, ``replicas_suspect`` and ``replicas_unchecked`` as they are) tagged with
    the series; other callbacks are ignored. Writes to ``log_``,
    or to the configured log at the time of each call.
    """

    def on_event(name: str, info: Dict[str, Any]) -> None:
        etype = _CHECKPOINTER_EVENTS.get(name)
        if etype is None:
            return
        fields = dict(info)
        fields.update(user=user, key=key)
        if job is not None:
            fields.setdefault("job", str(job))
        if etype == "failure":
            fields.setdefault("reason", _FAILURE_CODES[name])
        for reserved in _RESERVED:
            fields.pop(reserved, None)
        target = log_ if log_ is not None else _current
        if target is not None:
            target.emit(etype, **fields)

    return on_event
