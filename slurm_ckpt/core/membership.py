"""Who is in the job now: the membership protocol of in-job recovery.

Why: when a node dies, the surviving ranks keep their processes and a hot spare takes the
lost rank's place (:mod:`slurm_ckpt.job.recovery`). For that, every process must learn the
same answer to "who is rank r now, and where do we meet", and a process that was replaced
(stopped, partitioned, given up) must learn that it is out. The answer is a numbered
**epoch**, written by one **coordinator** (ckpt-srun, or a test's launcher) into a
**recovery directory** that every process of the job can read. Files are the whole
protocol: no daemon, no torch, no SLURM here, so it works the same on a laptop.

The recovery directory
----------------------
``$SLURM_CKPT_RECOVERY_DIR`` (or the API's argument). Under SLURM ckpt-srun makes it at the
job's timeline directory + ``/recovery``. It must be a directory owned by the user and
writable by nobody else (``0700``); anything else is refused (:class:`MembershipError`).
Every file is written atomically (a hidden temp file, then rename) and read without
following a symlink, without blocking (``O_NONBLOCK``), as a regular singly linked file of
the directory's owner, at most :data:`MAX_BYTES`; a file that fails any of these, or does
not parse exactly as below, is ignored (never trusted, never a traceback).

Files (all JSON objects, UTF-8):

``epoch-<N>.json`` (written by the coordinator; ranks read the newest valid one)::

    {"epoch": N,                      # 0 = the launch, then 1, 2, ... per re-form
     "world_size": W,
     "members": {"0": {"host": "node1", "task": 0}, ..., "<W-1>": {...}},
     "rendezvous": {"host": "node1", "port": 29517},
     "lost": [2],                      # ranks replaced by this epoch (empty for 0)
     "created": 1767000000.0}          # unix time

  ``members`` names every rank ``0..W-1`` exactly once; ``task`` is the launcher's number
  of the process serving that rank (under SLURM its ``SLURM_PROCID``; a spare keeps its
  own), unique within the epoch. Ranks keep their numbers across epochs: a survivor's
  entry is unchanged, a lost rank's entry names the spare that replaces it. A process
  whose ``(rank, task)`` is not in the newest epoch is **fenced**: it must exit without
  committing or serving. ``rendezvous`` is where the epoch's process group meets: rank 0
  of the epoch hosts a TCP store there, and every rank uses the key prefix ``epoch-<N>/``.

``spare-<task>.json`` (written by a hot spare when it is ready to take a rank)::

    {"task": T, "host": "node4", "pid": 4242}

  The coordinator deletes it when it gives the spare a rank (a spare is used once).

``rank-<r>.done`` (written by rank ``r`` when it finished training; content ``{"rank": r}``):
  lets the coordinator tell a rank that ended from a rank that was lost.

``end.json`` (written by the coordinator when the job is over; ``{"created": t}``): waiting
  spares exit 0.

A coordinator uses :class:`Coordinator`: ``launch(members)`` writes epoch 0,
``declare_lost(ranks)`` writes epoch N+1 with ready spares in the lost ranks' places and a
fresh rendezvous port (or returns ``None`` when there are not enough ready spares: the
caller falls back to relaunching every rank), ``end()`` writes ``end.json``. That is all a
launcher needs.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import stat
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from slurm_ckpt.core.fsio import O_DIR, atomic_replace, read_regular, unlink_quiet
from slurm_ckpt.errors import CkptError

__all__ = [
    "END_FILE",
    "MAX_BYTES",
    "RECOVERY_DIR_ENV",
    "SPARE_ENV",
    "TASK_ENV",
    "Coordinator",
    "Epoch",
    "Member",
    "MembershipError",
    "RecoveryDir",
    "Spare",
    "task_from_env",
]

#: Where the recovery directory is (an absolute path).
RECOVERY_DIR_ENV = "SLURM_CKPT_RECOVERY_DIR"
#: ``1`` in the environment of a hot spare (the same script, started ahead of time).
SPARE_ENV = "SLURM_CKPT_SPARE"
#: The launcher's number of this process (``task``), when not ``SLURM_PROCID``.
TASK_ENV = "SLURM_CKPT_TASK"
#: The file that says the job is over.
END_FILE = "end.json"
#: Largest file read (an epoch of 100 000 ranks is about 4 MiB).
MAX_BYTES = 16 * 2**20
#: Largest world size accepted.
MAX_WORLD = 1_000_000

_EPOCH_RE = re.compile(r"^epoch-(0|[1-9][0-9]{0,8})\.json$")
_SPARE_RE = re.compile(r"^spare-(0|[1-9][0-9]{0,8})\.json$")
_DONE_RE = re.compile(r"^rank-(0|[1-9][0-9]{0,8})\.done$")
_HOST_RE = re.compile(r"^[A-Za-z0-9_.:\-\[\]]{1,255}$")


class MembershipError(CkptError):
    """The recovery directory is missing or unsafe, or a coordinator was misused."""


def _int(v: Any, lo: int, hi: int) -> Optional[int]:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        return None
    return v


def _host(v: Any) -> Optional[str]:
    return v if isinstance(v, str) and _HOST_RE.match(v) else None


@dataclass(frozen=True)
class Member:
    """The process serving one rank: its host and the launcher's task number."""

    host: str
    task: int


@dataclass(frozen=True)
class Spare:
    """A hot spare that said it is ready."""

    task: int
    host: str
    pid: int

    def to_bytes(self) -> bytes:
        return json.dumps({"task": self.task, "host": self.host, "pid": self.pid}).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Optional[Spare]:
        obj = _load(data)
        if obj is None:
            return None
        task, host, pid = (
            _int(obj.get("task"), 0, 10**9),
            _host(obj.get("host")),
            _int(obj.get("pid"), 1, 2**31),
        )
        if task is None or host is None or pid is None:
            return None
        return cls(task, host, pid)


@dataclass(frozen=True)
class Epoch:
    """One membership of the job: who serves each rank and where the group meets."""

    epoch: int
    world_size: int
    members: Mapping[int, Member]
    host: str
    port: int
    lost: Tuple[int, ...] = ()
    created: float = field(default=0.0, compare=False)

    def has(self, rank: int, task: int) -> bool:
        """Whether the process ``task`` serving ``rank`` is still in this epoch."""
        m = self.members.get(rank)
        return m is not None and m.task == task

    def rank_of(self, task: int) -> Optional[int]:
        for r, m in self.members.items():
            if m.task == task:
                return r
        return None

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "epoch": self.epoch,
                "world_size": self.world_size,
                "members": {
                    str(r): {"host": m.host, "task": m.task}
                    for r, m in sorted(self.members.items())
                },
                "rendezvous": {"host": self.host, "port": self.port},
                "lost": list(self.lost),
                "created": self.created,
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Optional[Epoch]:
        """The epoch, or ``None`` for anything that is not exactly the format above."""
        obj = _load(data)
        if obj is None:
            return None
        n = _int(obj.get("epoch"), 0, 10**9)
        w = _int(obj.get("world_size"), 1, MAX_WORLD)
        raw, rv, lost_raw = obj.get("members"), obj.get("rendezvous"), obj.get("lost", [])
        created = obj.get("created", 0.0)
        if n is None or w is None or not isinstance(raw, dict) or not isinstance(rv, dict):
            return None
        if (
            not isinstance(lost_raw, list)
            or isinstance(created, bool)
            or not isinstance(created, (int, float))
        ):
            return None
        if not math.isfinite(float(created)) or len(raw) != w:
            return None
        members: Dict[int, Member] = {}
        tasks = set()
        for key, val in raw.items():
            if not isinstance(key, str) or not key.isdigit() or not isinstance(val, dict):
                return None
            r, host, task = int(key), _host(val.get("host")), _int(val.get("task"), 0, 10**9)
            if r >= w or str(r) != key or host is None or task is None or task in tasks:
                return None
            tasks.add(task)
            members[r] = Member(host, task)
        host, port = _host(rv.get("host")), _int(rv.get("port"), 1, 65535)
        lost = [_int(x, 0, w - 1) for x in lost_raw]
        if host is None or port is None or any(x is None for x in lost):
            return None
        return cls(
            n, w, members, host, port, tuple(int(x) for x in lost if x is not None), float(created)
        )


def _load(data: bytes) -> Optional[Dict[str, Any]]:
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def task_from_env(environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """This process's task number: ``$SLURM_CKPT_TASK``, else ``$SLURM_PROCID``."""
    env = os.environ if environ is None else environ
    for name in (TASK_ENV, "SLURM_PROCID"):
        v = env.get(name, "")
        if v.isdigit() and len(v) < 10:
            return int(v)
    return None


class RecoveryDir:
    """The recovery directory, opened once (its fd is kept: a rename of the path later
    cannot redirect the protocol). ``create`` makes it (``0700``) when missing."""

    def __init__(self, path: str, create: bool = False) -> None:
        if not path or not os.path.isabs(path):
            raise MembershipError(f"recovery directory must be an absolute path, got {path!r}")
        self.path = path
        if create:
            try:
                os.makedirs(path, mode=0o700, exist_ok=True)
            except OSError as exc:
                raise MembershipError(f"recovery directory {path}: {exc.strerror}") from None
        try:
            self.fd = os.open(path, O_DIR)
        except OSError as exc:
            raise MembershipError(f"recovery directory {path}: {exc.strerror or exc}") from None
        st = os.fstat(self.fd)
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o022:
            os.close(self.fd)
            raise MembershipError(
                f"recovery directory {path} must be owned by uid {os.geteuid()}"
                " and writable by nobody else"
            )

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> Optional[RecoveryDir]:
        env = os.environ if environ is None else environ
        path = env.get(RECOVERY_DIR_ENV, "")
        return cls(path) if path else None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> RecoveryDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading ------------------------------------------------------------------
    def _names(self, pattern: re.Pattern[str]) -> List[Tuple[int, str]]:
        out = []
        for name in os.listdir(self.fd):
            m = pattern.match(name)
            if m:
                out.append((int(m.group(1)), name))
        return sorted(out)

    def _read(self, name: str) -> Optional[bytes]:
        try:
            return read_regular(self.fd, name, MAX_BYTES)[0]
        except OSError:
            return None

    def epoch(self, n: int) -> Optional[Epoch]:
        data = self._read(f"epoch-{n}.json")
        ep = Epoch.from_bytes(data) if data is not None else None
        return ep if ep is not None and ep.epoch == n else None

    def newest_epoch(self) -> Optional[Epoch]:
        """The valid epoch with the highest number (an invalid file is passed over)."""
        for n, _name in reversed(self._names(_EPOCH_RE)):
            ep = self.epoch(n)
            if ep is not None:
                return ep
        return None

    def spares(self) -> List[Spare]:
        """Ready spares, by task number."""
        out = []
        for n, name in self._names(_SPARE_RE):
            data = self._read(name)
            sp = Spare.from_bytes(data) if data is not None else None
            if sp is not None and sp.task == n:
                out.append(sp)
        return out

    def done_ranks(self) -> List[int]:
        return [r for r, _ in self._names(_DONE_RE)]

    def ended(self) -> bool:
        return self._read(END_FILE) is not None

    # -- writing ------------------------------------------------------------------
    def write_epoch(self, ep: Epoch) -> None:
        atomic_replace(self.fd, f"epoch-{ep.epoch}.json", ep.to_bytes(), durable=False)

    def write_spare(self, spare: Spare) -> None:
        atomic_replace(self.fd, f"spare-{spare.task}.json", spare.to_bytes(), durable=False)

    def remove_spare(self, task: int) -> None:
        unlink_quiet(self.fd, f"spare-{task}.json")

    def mark_done(self, rank: int) -> None:
        atomic_replace(
            self.fd, f"rank-{rank}.done", json.dumps({"rank": rank}).encode(), durable=False
        )

    def write_end(self) -> None:
        atomic_replace(
            self.fd, END_FILE, json.dumps({"created": time.time()}).encode(), durable=False
        )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on this machine now (the default rendezvous port picker)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host if host not in ("localhost",) else "127.0.0.1", 0))
        return int(s.getsockname()[1])


PortPicker = Callable[[int, str], int]


class Coordinator:
    """Writes the epochs of one job. One coordinator per job (ckpt-srun, or a launcher).

    ``pick_port(epoch, host)`` gives the rendezvous port of an epoch whose rank 0 runs on
    ``host``; the default binds a free port on this machine, right where every rank runs
    here (a laptop, the tests). A launcher whose ranks run elsewhere passes its own (for
    instance a base port plus the epoch number).
    """

    def __init__(self, directory: RecoveryDir, pick_port: Optional[PortPicker] = None) -> None:
        self.dir = directory
        self.pick_port: PortPicker = pick_port or (lambda _n, host: free_port(_local(host)))
        self.current: Optional[Epoch] = directory.newest_epoch()

    def launch(self, members: Mapping[int, Member], port: Optional[int] = None) -> Epoch:
        """Epoch 0: ``members`` names ranks ``0..W-1``. ``port``: the launch's rendezvous
        (when the launcher already chose one, e.g. ``MASTER_PORT``)."""
        w = len(members)
        if sorted(members) != list(range(w)) or len({m.task for m in members.values()}) != w:
            raise MembershipError("members must name ranks 0..W-1, each by a distinct task")
        host = members[0].host
        ep = Epoch(0, w, dict(members), host, port or self.pick_port(0, host), (), time.time())
        self.dir.write_epoch(ep)
        self.current = ep
        return ep

    def declare_lost(self, ranks: Sequence[int]) -> Optional[Epoch]:
        """Replace ``ranks`` by ready spares in a new epoch, or ``None`` (not enough ready
        spares: the caller relaunches instead). The spares used are removed from the
        ready list; a spare already serving a rank is never picked again."""
        cur = self.current
        if cur is None:
            raise MembershipError("declare_lost before launch")
        lost = sorted(set(int(r) for r in ranks))
        if not lost or any(r not in cur.members for r in lost):
            raise MembershipError(f"lost ranks {lost} are not ranks of epoch {cur.epoch}")
        in_use = {m.task for m in cur.members.values()}
        ready = [s for s in self.dir.spares() if s.task not in in_use]
        if len(ready) < len(lost):
            return None
        members = dict(cur.members)
        for r, sp in zip(lost, ready):
            members[r] = Member(sp.host, sp.task)
        n = cur.epoch + 1
        host = members[0].host
        ep = Epoch(
            n, cur.world_size, members, host, self.pick_port(n, host), tuple(lost), time.time()
        )
        self.dir.write_epoch(ep)
        for sp in ready[: len(lost)]:
            self.dir.remove_spare(sp.task)
        self.current = ep
        return ep

    def forget_spare(self, task: int) -> None:
        """A spare known dead (its heartbeat stopped) is not offered again."""
        self.dir.remove_spare(task)

    def end(self) -> None:
        """The job is over: waiting spares exit 0."""
        self.dir.write_end()


def _local(host: str) -> str:
    try:
        socket.inet_aton(host)
        return host
    except OSError:
        return "0.0.0.0"
