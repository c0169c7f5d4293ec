"""The admission slots on the shared tier itself: a root-owned directory on the PFS.

:mod:`slurm_ckpt.admission.decisions` decides; this module only keeps its
:class:`~slurm_ckpt.admission.state.SlotState` where every node sees it:
``<tiers.pfs.root>/.slurm_ckpt/slots/`` (``[admission] dir`` to move it), holding

* ``lock``: an empty file whose ``flock`` serialises the transactions (held for
  milliseconds: read the state, decide, write it back). The kernel, or the PFS's lock
  manager, drops it when its holder dies, so a crashed process never keeps it;
* ``state.json``: the holders and the queue, replaced whole by ``rename`` (a reader that
  takes no lock sees the old state or the new one, never half of one).

A slot itself is a *lease* in that state, not a lock: a node that dies mid-flush (power,
kernel panic, a fenced client whose locks the PFS only drops minutes later) simply stops
renewing, and its slot is free again ``lease`` seconds after the last renewal.

Why root-owned, and how that is checked (this runs as root, the PFS root is typically
mode 1777, and users are hostile): a user who could open ``lock`` could ``flock`` it
forever and stall every root flusher; one who could write ``state.json`` could hold every
slot, or make root parse a FIFO. So every component below the PFS root is opened relative
to its parent with ``O_NOFOLLOW`` (a symlink fails the open), the directories must be
private to this process's user (:func:`slurm_ckpt.core.trust.unsafe_dir`), the files are
opened non-blocking and refused unless they are regular files with one link
(:func:`slurm_ckpt.core.fsio.check_file`), owned by this user, mode 0600. A directory
that fails the check is not used: the store is refused with a one-line error that says
what to fix (``ckpt-slurm doctor`` reports it too), and callers
flush without a slot rather than lose a checkpoint. A missing directory is created 0755.

Only the owner of the store can take slots in it: the root-run flushers (epilog, stager,
root ``ckpt-slurm flush``, ``maint``). A job's own in-job flush runs as the user, cannot
open the store, and is shaped by jitter and its per-node bandwidth cap instead.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

from slurm_ckpt.admission.policy import AdmissionError
from slurm_ckpt.admission.state import SlotState
from slurm_ckpt.core import fsio, trust
from slurm_ckpt.core.config import LEDGER_SUBDIR, Config

log = logging.getLogger(__name__)

__all__ = ["SLOTS_SUBDIR", "PosixSlotStore", "check_store_dir", "slots_dir"]

T = TypeVar("T")

SLOTS_SUBDIR = "slots"
LOCK_NAME = "lock"
STATE_NAME = "state.json"
_MAX_STATE = 256 * 2**20
_O_FILE = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_LOCK_POLL_S = 0.01


def slots_dir(cfg: Config) -> Path:
    """Where the slots live: ``[admission] dir``, else ``<pfs root>/.slurm_ckpt/slots``.
    A site without a PFS must name a shared directory (an object store has no ``flock``
    and no owners to trust): AdmissionError without one (the config check says so too)."""
    if cfg.admission.dir is not None:
        return Path(cfg.admission.dir)
    if cfg.tiers.pfs is None:
        raise AdmissionError(
            "admission slots need a shared directory on a site without a PFS: set [admission] dir"
        )
    return Path(cfg.tiers.pfs.root) / LEDGER_SUBDIR / SLOTS_SUBDIR


def _trusted_dir(fd: int, where: str, uid: int) -> None:
    """Refuse a store directory that is not private to ``uid`` (the trust rule of
    :func:`slurm_ckpt.core.trust.unsafe_dir`), with the fix in the message."""
    why = trust.unsafe_dir(os.fstat(fd), uid)
    if why is not None:
        raise AdmissionError(
            f"admission store {where}: {why}; fix: chown {uid} {where} && chmod 755 {where}"
        )


def check_store_dir(path: Path, create: bool = True) -> int:
    """Open ``path`` for use as the store and return its fd (the caller closes it).

    The first component that is missing below the deepest existing, *trusted* ancestor is
    created (mode 0755). The ancestors that are the admin's (``/``, the PFS root) are
    opened normally; from ``.slurm_ckpt`` down, every component is opened with
    ``O_NOFOLLOW`` relative to its parent and must be owned by this process's user and
    writable by no one else. Raises :class:`AdmissionError` (one line, with the fix).
    """
    uid = os.geteuid()
    path = Path(os.path.abspath(os.fspath(path)))
    # The store's own directories: the last two components (".slurm_ckpt/slots" by default,
    # or the admin's own choice of the last one). Everything above is the admin's.
    own = 2 if path.parent.name == LEDGER_SUBDIR else 1
    top = path
    for _ in range(own):
        top = top.parent
    try:
        fd = os.open(str(top), fsio.O_DIR)
    except OSError as exc:
        raise AdmissionError(
            f"admission store: cannot open {top}: {exc.strerror or exc} (is the PFS mounted?)"
        ) from None
    where = top
    try:
        for part in path.parts[len(top.parts) :]:
            where = where / part
            try:
                nfd = os.open(part, fsio.O_DIR, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise AdmissionError(f"admission store {where}: does not exist") from None
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
                nfd = os.open(part, fsio.O_DIR, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise AdmissionError(
                        f"admission store {where}: a symbolic link or not a directory; "
                        "refusing it (remove it, or set [admission] dir)"
                    ) from None
                raise AdmissionError(f"admission store {where}: {exc.strerror or exc}") from None
            os.close(fd)
            fd = nfd
            _trusted_dir(fd, str(where), uid)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _trusted_file(fd: int, where: str, uid: int) -> os.stat_result:
    """Refuse a store file unless it is a regular file with one link
    (:func:`slurm_ckpt.core.fsio.check_file`), owned by ``uid``, mode 0600."""
    try:
        st = fsio.check_file(fd, where)
    except fsio.UnsafeFile as exc:
        raise AdmissionError(f"admission store {exc.strerror}") from None
    if st.st_uid != uid or st.st_mode & 0o077:
        raise AdmissionError(
            f"admission store {where}: must be owned by uid {uid}, mode 0600 "
            f"(uid {st.st_uid}, mode {trust.mode_of(st)})"
        )
    return st


class PosixSlotStore:
    """The slot state in a directory on the PFS; see the module docstring.

    ``clock`` must be the clock that deadlines passed to :meth:`transact` refer to
    (the :class:`~slurm_ckpt.admission.decisions.Admission`'s clock).
    """

    def __init__(
        self, directory: os.PathLike | str, clock: Callable[[], float] = time.time
    ) -> None:
        self.directory = Path(os.path.abspath(os.fspath(directory)))
        self.clock = clock
        self.ops = 0
        self.peeks = 0
        self.writes = 0
        self.uid = os.geteuid()
        # Check (and create) it now: a bad store is reported before anyone waits on it.
        os.close(check_store_dir(self.directory))

    @classmethod
    def from_config(cls, cfg: Config, clock: Callable[[], float] = time.time) -> PosixSlotStore:
        return cls(slots_dir(cfg), clock)

    def __repr__(self) -> str:
        return f"PosixSlotStore({str(self.directory)!r})"

    # -- the lock ---------------------------------------------------------------------
    def _lock(self, dfd: int, deadline: Optional[float]) -> int:
        where = f"{self.directory}/{LOCK_NAME}"
        try:
            fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | _O_FILE, 0o600, dir_fd=dfd)
        except OSError as exc:
            raise AdmissionError(f"admission store {where}: {exc.strerror or exc}") from None
        try:
            _trusted_file(fd, where, self.uid)
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return fd
                except BlockingIOError:
                    pass
                except OSError as exc:
                    raise AdmissionError(
                        f"admission store {where}: flock failed: {exc.strerror or exc} "
                        "(mount the PFS with flock support, e.g. Lustre -o flock)"
                    ) from None
                if deadline is not None and self.clock() >= deadline:
                    raise AdmissionError(f"admission store {where}: still locked at the deadline")
                time.sleep(_LOCK_POLL_S)
        except BaseException:
            os.close(fd)
            raise

    # -- the state ----------------------------------------------------------------------
    def _read(self, dfd: int) -> SlotState:
        where = f"{self.directory}/{STATE_NAME}"
        for _attempt in range(8):
            try:
                fd = os.open(STATE_NAME, os.O_RDONLY | _O_FILE, dir_fd=dfd)
            except FileNotFoundError:
                return SlotState()
            except OSError as exc:
                raise AdmissionError(f"admission store {where}: {exc.strerror or exc}") from None
            try:
                st = _trusted_file(fd, where, self.uid)
                break
            except AdmissionError:
                # Replaced by a writer between our open and the check (a lock-free peek):
                # the old inode is unlinked (0 links), read the new one.
                replaced = os.fstat(fd).st_nlink == 0
                os.close(fd)
                if not replaced or _attempt == 7:
                    raise
        try:
            if st.st_size > _MAX_STATE:
                raise AdmissionError(f"admission store {where}: implausibly large")
            chunks = []
            while True:
                b = os.read(fd, 1 << 20)
                if not b:
                    break
                chunks.append(b)
        finally:
            os.close(fd)
        try:
            return SlotState.from_dict(json.loads(b"".join(chunks)))
        except (ValueError, UnicodeDecodeError) as exc:
            # Only this store's owner writes it, so this is a torn disk, not an attack:
            # start over. Holders that were in it flush on, uncounted, until they finish.
            log.warning(
                "admission store %s unreadable (%s): starting with an empty one", where, exc
            )
            return SlotState(dirty=True)

    def _write(self, dfd: int, state: SlotState) -> None:
        blob = json.dumps(state.to_dict(), separators=(",", ":"), allow_nan=False).encode()
        # Under the store lock: no other writer has a temp file in flight. Not durable:
        # losing the last write to a crash of the PFS costs a moment of over-admission,
        # never data (leases bound it).
        fsio.remove_stale_temps(dfd, STATE_NAME)
        fsio.atomic_replace(dfd, STATE_NAME, blob, 0o600, durable=False)
        self.writes += 1

    def transact(self, fn: Callable[[SlotState], T], deadline: Optional[float] = None) -> T:
        dfd = check_store_dir(self.directory)
        try:
            lfd = self._lock(dfd, deadline)
            try:
                self.ops += 1
                state = self._read(dfd)
                result = fn(state)
                if state.dirty:
                    try:
                        self._write(dfd, state)
                    except OSError as exc:
                        raise AdmissionError(
                            f"admission store {self.directory}: cannot write: {exc.strerror or exc}"
                        ) from None
                return result
            finally:
                fcntl.flock(lfd, fcntl.LOCK_UN)
                os.close(lfd)
        finally:
            os.close(dfd)

    def peek(self) -> SlotState:
        self.peeks += 1
        dfd = check_store_dir(self.directory, create=False)
        try:
            return self._read(dfd)
        finally:
            os.close(dfd)

    def snapshot(self) -> Any:
        """``(holders, waiters)`` as plain dicts, for ``status``/``doctor`` and metrics."""
        st = self.peek()
        return st.to_dict()
