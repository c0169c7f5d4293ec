"""An exclusive lock file that no other user can hold.

``flock()`` works on any open descriptor, a read-only one included: a lock file that
another user can *open* is a lock that user can hold forever, and every writer of the
ledger behind it then fails after its timeout (a root epilog among them, with a
checkpoint left unflushed). So the lock file here is created mode 0600, and one that
anyone else could open - an older 0644 one, a file of another owner, a hard link, a
special file - is unlinked and replaced before it is used: whoever holds the old inode
then holds nothing anyone waits for. After the lock is taken the path is checked to still
name the locked inode (a replacement in between means: take the new one).

Each :meth:`LockFile.acquire` opens its own descriptor, so threads of one process
exclude each other as processes do (``flock`` locks belong to the open file).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import threading
import time
from pathlib import Path
from typing import Optional

from slurm_ckpt.core import fsio

__all__ = ["LockBusy", "LockFile"]

_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_POLL_MIN_S = 0.001
_POLL_MAX_S = 0.05
#: How long an old, openable lock file is waited for before it is replaced.
_REPLACE_WAIT_S = 1.0


class LockBusy(Exception):
    """Someone else held the lock for the whole timeout."""


def _try_lock(fd: int, wait_s: float) -> bool:
    end = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError:
            if time.monotonic() >= end:
                return False
            time.sleep(_POLL_MAX_S)


def _private(st: os.stat_result) -> bool:
    return (
        stat.S_ISREG(st.st_mode)
        and st.st_uid == os.geteuid()
        and st.st_nlink == 1
        and not st.st_mode & 0o077
    )


class LockFile:
    """``directory/name`` as an exclusive lock (see the module docstring)."""

    def __init__(self, directory: Path, name: str, timeout: float) -> None:
        self.directory = Path(directory)
        self.name = name
        self.timeout = float(timeout)
        self._held = threading.local()

    def _open(self, dfd: int) -> int:
        for _attempt in range(8):
            try:
                fd = os.open(self.name, _FLAGS, 0o600, dir_fd=dfd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                    raise
                fd = -1  # a symlink, a FIFO or socket, a directory: not ours to open
            if fd >= 0:
                if _private(os.fstat(fd)):
                    return fd
                # An old lock file others can open: wait briefly for whoever of ours may
                # hold it now (so two of us never both think they hold the lock), then
                # replace it - whoever still holds it after that is not one of us.
                _try_lock(fd, _REPLACE_WAIT_S)
                os.close(fd)
            # Someone else could open (or already holds) this one: replace it.
            try:
                os.unlink(self.name, dir_fd=dfd)
            except IsADirectoryError:
                fsio.remove_tree(dfd, self.name)
            except FileNotFoundError:
                pass
        raise OSError(errno.EAGAIN, f"{self.directory / self.name} keeps being replaced")

    def acquire(self) -> None:
        """Take the lock, waiting up to the timeout (:class:`LockBusy` then)."""
        deadline = time.monotonic() + self.timeout
        poll = _POLL_MIN_S
        dfd = fsio.open_dir(str(self.directory))
        try:
            while True:
                fd = self._open(dfd)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    if time.monotonic() >= deadline:
                        raise LockBusy(str(self.directory / self.name)) from None
                    time.sleep(poll)
                    poll = min(_POLL_MAX_S, poll * 2)
                    continue
                except BaseException:
                    os.close(fd)
                    raise
                try:
                    now = os.stat(self.name, dir_fd=dfd, follow_symlinks=False)
                    mine = os.fstat(fd)
                    same = (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)
                except FileNotFoundError:
                    same = False
                if same:
                    self._held.fd = fd
                    return
                os.close(fd)  # replaced while we waited: lock the one that is there now
        finally:
            os.close(dfd)

    def release(self) -> None:
        fd: Optional[int] = getattr(self._held, "fd", None)
        if fd is None:
            return
        self._held.fd = None
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
