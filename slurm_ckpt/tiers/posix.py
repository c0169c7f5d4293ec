"""A tier that is a POSIX directory tree: node-local NVMe, a parallel filesystem, an archive.

Implements :class:`~slurm_ckpt.tiers.base.Tier`. Everything it does - list, read a
manifest, verify, write, delete, sweep debris - goes through directory file descriptors
opened with ``O_NOFOLLOW`` below the (trusted) root, so the same code is safe when root
runs it over user-owned trees. Writes and commits are :mod:`slurm_ckpt.core.commit`.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
import time
from contextlib import contextmanager
from typing import Any, Iterator, List, Optional, Tuple

from slurm_ckpt.core import fsio, trust
from slurm_ckpt.core.chunks import PIECE, BandwidthLimiter
from slurm_ckpt.core.commit import CheckpointWriter, read_manifest
from slurm_ckpt.core.hashing import DEFAULT_CHUNK_SIZE
from slurm_ckpt.core.layout import (
    LOCK_PREFIX,
    PARTIAL_PREFIX,
    TMP_PREFIX,
    TRASH_PREFIX,
    lock_name,
    parse_step_dirname,
    step_dirname,
)
from slurm_ckpt.core.lease import LEASE_FILE
from slurm_ckpt.core.manifest import DAMAGED_MANIFEST_NAME, MANIFEST_NAME, Manifest
from slurm_ckpt.core.names import validate_key, validate_user
from slurm_ckpt.core.progress import ProgressFn
from slurm_ckpt.core.verify import VerifyReport, open_payload, verify_files
from slurm_ckpt.errors import InvalidName, NotFound, StepLocked, TierError, VerifyError
from slurm_ckpt.tiers.base import StepInfo
from slurm_ckpt.tiers.posix_files import adopt_file
from slurm_ckpt.tiers.posix_guard import (
    check_step_files,
    check_user_dir,
    read_committed_manifest,
)


class PosixTier:
    """One storage tier rooted at a directory (see the module docstring)."""

    kind = "posix"

    def __init__(
        self,
        name: str,
        root: str,
        *,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        streams: int = 4,
        bandwidth: Optional[float] = None,
        buffer_size: int = PIECE,
    ) -> None:
        self.name = name
        self.buffer_size = buffer_size
        self.root = os.path.abspath(root)
        self.chunk_size = chunk_size
        self.streams = streams
        self.limiter = BandwidthLimiter(bandwidth) if bandwidth else None
        #: How long :meth:`lock` waits for a step's lock (None: as long as it takes).
        #: Root's children working as a checkpoint's owner set it: a lock the owner holds
        #: must not stall root's work (:class:`~slurm_ckpt.errors.StepLocked`).
        self.lock_wait: Optional[float] = None

    def __repr__(self) -> str:
        return f"PosixTier({self.name!r}, {self.root!r})"

    # -- paths and fds ---------------------------------------------------------
    def where(self, user: str, key: str, step: Optional[int] = None) -> str:
        tail = f"/{step_dirname(step)}" if step is not None else ""
        return f"{self.name}:{self.root}/{user}/{key}{tail}"

    def step_path(self, user: str, key: str, step: int) -> str:
        return os.path.join(self.root, user, key, step_dirname(step))

    def location(self, user: str, key: str, step: Optional[int] = None) -> str:
        tail = [step_dirname(step)] if step is not None else []
        return os.path.join(self.root, user, key, *tail)

    def _root_fd(self) -> int:
        try:
            return fsio.open_dir(self.root)
        except OSError as exc:
            raise fsio.tier_error(exc, f"{self.name} tier root {self.root}") from None

    @contextmanager
    def key_fd(self, user: str, key: str, create: bool = False) -> Iterator[int]:
        validate_user(user)
        validate_key(key)
        root = self._root_fd()
        try:
            fd = trust.open_user_subdir(root, user, [key], create, f"{self.name}:{self.root}")
        except FileNotFoundError:
            raise NotFound(f"{self.where(user, key)}: no such series") from None
        except OSError as exc:
            raise fsio.tier_error(exc, self.where(user, key)) from None
        finally:
            os.close(root)
        try:
            yield fd
        finally:
            os.close(fd)

    @contextmanager
    def step_fd(self, user: str, key: str, step: int) -> Iterator[int]:
        with self.key_fd(user, key) as kfd:
            try:
                fd = os.open(step_dirname(step), fsio.O_DIR, dir_fd=kfd)
            except OSError as exc:
                if exc.errno == errno.ENOENT:
                    raise NotFound(f"{self.where(user, key, step)}: no such checkpoint") from None
                raise fsio.tier_error(exc, self.where(user, key, step)) from None
            try:
                yield fd
            finally:
                os.close(fd)

    # -- root's questions (tiers/base.py): the POSIX guards -----------------------------
    def directory(self) -> PosixTier:
        """A POSIX tier is its directories (:class:`~slurm_ckpt.tiers.base.KeyDirs`)."""
        return self

    def guard_user(self, user: str, uid: int) -> None:
        """``<root>/<user>`` must be the user's own (:func:`.posix_guard.check_user_dir`)."""
        check_user_dir(self, user, uid)

    def guard_step(self, user: str, key: str, step: int, uid: int) -> None:
        """Regular files of the user with one link each (:func:`.posix_guard.check_step_files`)."""
        check_step_files(self, user, key, step, uid)

    def committed_manifest(self, user: str, key: str, step: int) -> Optional[bytes]:
        """Read below the step's directory without following a link."""
        return read_committed_manifest(self, user, key, step)

    @contextmanager
    def lock(self, user: str, key: str, step: int, wait: bool = True) -> Iterator[bool]:
        """Exclusive per-step lock (flock on a node-local file) held by copies and deletes.

        Yields False when ``wait`` is False and someone else holds it.
        """
        with self.key_fd(user, key, create=True) as kfd:
            fd = os.open(
                lock_name(step),
                os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
                dir_fd=kfd,
            )
            try:
                try:
                    if wait and self.lock_wait is not None:
                        self._flock_within(fd, self.lock_wait, user, key, step)
                    else:
                        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
                except BlockingIOError:
                    yield False
                    return
                yield True
            finally:
                os.close(fd)

    def _flock_within(self, fd: int, limit: float, user: str, key: str, step: int) -> None:
        """``flock(LOCK_EX)`` on ``fd``, tried until ``limit`` seconds have passed;
        :class:`StepLocked` when someone else still holds it then."""
        end = time.monotonic() + max(0.0, limit)
        pause = 0.005
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= end:
                    raise StepLocked(
                        f"{self.where(user, key, step)}: its lock file is held by another "
                        f"process of the owner's (gave up after {limit:g}s)"
                    ) from None
                time.sleep(pause)
                pause = min(0.1, pause * 2)

    # -- checks ----------------------------------------------------------------
    def check(self, write: bool = False) -> None:
        """Raise a one-line TierError unless the root exists (and is writable)."""
        if not os.path.isabs(self.root):
            raise TierError(f"{self.name} tier root {self.root}: must be an absolute path")
        fd = self._root_fd()
        os.close(fd)
        if write and not os.access(self.root, os.W_OK | os.X_OK):
            raise TierError(f"{self.name} tier root {self.root}: permission denied")

    def check_user(self, user: str) -> None:
        """Raise a one-line TierError unless ``user`` can write checkpoints here: into
        ``<root>/<user>`` when it exists (as a secure site's prolog makes it, below a root
        only root may write), else by creating it in a writable root (plain directories,
        a mode-1777 scratch root)."""
        validate_user(user)
        self.check()
        udir = os.path.join(self.root, user)
        try:
            st = os.lstat(udir)
        except FileNotFoundError:
            if not os.access(self.root, os.W_OK | os.X_OK):
                raise TierError(
                    f"{self.name} tier: {udir} does not exist and {self.root} is not writable"
                    " (the prolog creates it on SLURM nodes)"
                ) from None
            return
        if not stat.S_ISDIR(st.st_mode) or not os.access(udir, os.W_OK | os.X_OK):
            raise TierError(f"{self.name} tier {udir}: not a directory you can write")
        owner = trust.squatter(st, user)  # another user made it first: refuse, as root does
        if owner is not None:
            raise trust.Squatted(trust.squat_message(f"{self.name}:{udir}", user, owner))

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.root).free

    # -- writing ---------------------------------------------------------------
    def writer(
        self, user: str, key: str, step: int, *, copy_of: Optional[Manifest] = None, **kw: Any
    ) -> CheckpointWriter:
        """A commit-on-close writer (fresh, or a copy of ``copy_of``; see the Tier protocol)."""
        kw.setdefault("chunk_size", self.chunk_size)
        kw.setdefault("streams", self.streams)
        return CheckpointWriter(self.root, user, key, step, where=self.name, copy_of=copy_of, **kw)

    def adopt_file(self, sfd: int, dfd: int, rel: str) -> Optional[Tuple[int, int]]:
        """Put the file ``rel`` of directory ``sfd`` (a framework's checkpoint) below
        ``dfd`` (inside an open writer of this tier): a reflink, else a hard link, else a
        copy (:func:`slurm_ckpt.tiers.posix_files.adopt_file`, which says what the result
        means). A method of the tier: copying files is the tiers' business alone."""
        return adopt_file(sfd, dfd, rel)

    # -- reading ---------------------------------------------------------------
    def reader(self, user: str, key: str, step: int) -> PosixReader:
        """The committed checkpoint open for reading (a context manager)."""
        return PosixReader(self, user, key, step)

    # -- listing ---------------------------------------------------------------
    def series(self) -> Iterator[Tuple[str, str]]:
        """Every ``(user, key)`` below the root (dot-names are the toolkit's own)."""
        for user in self.users():
            try:
                keys = self.keys(user)
            except (TierError, NotFound):
                continue
            for key in keys:
                yield user, key

    def users(self) -> List[str]:
        """Directories below the root named like users (``lost+found`` and dot-names are
        not)."""
        return sorted(n for n in _listdir(self.root) if _is_name(n, validate_user))

    def keys(self, user: str) -> List[str]:
        validate_user(user)
        return sorted(
            n for n in _listdir(os.path.join(self.root, user)) if _is_name(n, validate_key)
        )

    def steps(self, user: str, key: str) -> List[StepInfo]:
        """Committed checkpoints, oldest first; uncommitted or malformed ones are skipped."""
        out = []
        try:
            ctx = self.key_fd(user, key)
            kfd = ctx.__enter__()
        except (TierError, NotFound):
            return []
        try:
            for name in os.listdir(kfd):
                step = parse_step_dirname(name)
                if step is None:
                    continue
                try:
                    m = self._manifest_at(kfd, user, key, step)
                except (VerifyError, OSError):
                    continue
                out.append(StepInfo(self.name, user, key, step, m))
        finally:
            ctx.__exit__(None, None, None)
        return sorted(out, key=lambda s: s.step)

    def _manifest_at(self, kfd: int, user: str, key: str, step: int) -> Manifest:
        where = self.where(user, key, step)
        sfd = os.open(step_dirname(step), fsio.O_DIR, dir_fd=kfd)
        try:
            m = read_manifest(sfd, where)
        finally:
            os.close(sfd)
        if (m.user, m.key, m.step) != (user, key, step):
            raise VerifyError(f"{where}: manifest belongs to {m.user}/{m.key}/step {m.step}")
        return m

    def manifest(self, user: str, key: str, step: int) -> Manifest:
        with self.key_fd(user, key) as kfd:
            try:
                return self._manifest_at(kfd, user, key, step)
            except FileNotFoundError:
                raise NotFound(f"{self.where(user, key, step)}: no such checkpoint") from None

    def manifest_bytes(self, user: str, key: str, step: int) -> bytes:
        """The committed manifest's exact bytes; NotFound when the step has none."""
        try:
            with self.step_fd(user, key, step) as sfd:
                return fsio.read_small(sfd, MANIFEST_NAME)
        except FileNotFoundError:
            raise NotFound(f"{self.where(user, key, step)}: not committed") from None
        except OSError as exc:
            raise fsio.tier_error(exc, self.where(user, key, step)) from None

    def verify(
        self, user: str, key: str, step: int, progress: Optional[ProgressFn] = None
    ) -> VerifyReport:
        """Re-hash every byte; a bad manifest is reported the same way as bad payload.
        ``progress(nbytes)`` is told about every hashed chunk (for progress bars)."""
        where = self.where(user, key, step)
        try:
            m = self.manifest(user, key, step)
        except VerifyError as exc:
            return VerifyReport(where, step, False, problems=[str(exc)])
        with self.step_fd(user, key, step) as sfd:
            return verify_files(
                sfd, m, where, self.streams, self.limiter, self.buffer_size, progress=progress
            )

    def latest_verified(
        self, user: str, key: str, max_step: Optional[int] = None
    ) -> Tuple[Optional[StepInfo], List[VerifyReport]]:
        """Newest checkpoint that verifies, and the reports of the newer ones that did not."""
        failed = []
        for info in reversed(self.steps(user, key)):
            if max_step is not None and info.step > max_step:
                continue
            rep = self.verify(user, key, info.step)
            if rep.ok:
                return info, failed
            failed.append(rep)
        return None, failed

    # -- damage ----------------------------------------------------------------
    def uncommit(self, user: str, key: str, step: int, expect: bytes) -> bool:
        """Take a committed checkpoint found damaged out of the tier's listing: its
        manifest is renamed to ``manifest.json.damaged`` (atomic; the bytes stay for
        inspection until the step is written again or swept). Only while the manifest is
        still ``expect`` - the one found damaged, never a copy committed again since.
        True when it was uncommitted here and now."""
        try:
            with self.step_fd(user, key, step) as sfd:
                try:
                    if fsio.read_small(sfd, MANIFEST_NAME) != expect:
                        return False
                except FileNotFoundError:
                    return False
                os.rename(MANIFEST_NAME, DAMAGED_MANIFEST_NAME, src_dir_fd=sfd, dst_dir_fd=sfd)
                os.fsync(sfd)
                return True
        except NotFound:
            return False
        except OSError as exc:
            raise fsio.tier_error(exc, self.where(user, key, step)) from None

    def uncommitted(self, user: str, key: str, step: int) -> bool:
        """Was this step found damaged and uncommitted here (and not written again)?"""
        try:
            with self.step_fd(user, key, step) as sfd:
                os.stat(DAMAGED_MANIFEST_NAME, dir_fd=sfd, follow_symlinks=False)
        except (NotFound, OSError):
            return False
        return True

    # -- the series' lease record ---------------------------------------------
    def read_lease(self, user: str, key: str) -> Optional[bytes]:
        """The series' lease record (:mod:`slurm_ckpt.core.lease`), or None when there is
        none. A regular file, opened without following links, at most 64 KiB."""
        try:
            with self.key_fd(user, key) as kfd:
                return fsio.read_regular(kfd, LEASE_FILE, limit=65536)[0]
        except (NotFound, FileNotFoundError):
            return None
        except OSError as exc:
            raise fsio.tier_error(exc, f"{self.where(user, key)}/{LEASE_FILE}") from None

    def write_lease(self, user: str, key: str, data: bytes) -> None:
        """Replace the series' lease record atomically (the series directory is made)."""
        with self.key_fd(user, key, create=True) as kfd:
            try:
                fsio.atomic_replace(kfd, LEASE_FILE, data)
            except OSError as exc:
                raise fsio.tier_error(exc, f"{self.where(user, key)}/{LEASE_FILE}") from None

    # -- deleting and sweeping -------------------------------------------------
    def delete(self, user: str, key: str, step: int) -> None:
        """Remove one checkpoint: the manifest first (so it stops counting), then the data."""
        with self.lock(user, key, step), self.key_fd(user, key) as kfd:
            name = step_dirname(step)
            try:
                sfd = os.open(name, fsio.O_DIR, dir_fd=kfd)
            except FileNotFoundError:
                return
            try:
                os.unlink("manifest.json", dir_fd=sfd)
                os.fsync(sfd)
            except FileNotFoundError:
                pass
            finally:
                os.close(sfd)
            fsio.remove_tree(kfd, name)
            fsio.unlink_quiet(kfd, lock_name(step))

    def sweep(
        self, user: str, key: str, max_age_s: float = 3600.0, partials: bool = False
    ) -> List[str]:
        """Remove debris of crashed writers: ``.tmp-*`` of dead processes (or older than
        ``max_age_s``), ``.trash-*``, ``step-N`` without a valid manifest, and with
        ``partials`` also interrupted copies (every writer's ``.partial-step-N.<writer>``
        and the old ``.partial-step-N``). Returns the names removed."""
        removed = []
        try:
            ctx = self.key_fd(user, key)
            kfd = ctx.__enter__()
        except (TierError, NotFound):
            return removed
        try:
            now = time.time()
            for name in os.listdir(kfd):
                st = os.stat(name, dir_fd=kfd, follow_symlinks=False)
                old = now - st.st_mtime > max_age_s
                drop = False
                if name.startswith(TRASH_PREFIX):
                    drop = True
                elif name.startswith(TMP_PREFIX):
                    drop = old or not _pid_alive(name)
                elif name.startswith(PARTIAL_PREFIX):
                    drop = partials
                elif name.startswith(LOCK_PREFIX):
                    continue
                elif parse_step_dirname(name) is not None:
                    try:
                        self._manifest_at(kfd, user, key, parse_step_dirname(name))  # type: ignore[arg-type]
                    except (VerifyError, OSError):
                        drop = old
                if drop:
                    fsio.remove_tree(kfd, name)
                    removed.append(name)
        finally:
            ctx.__exit__(None, None, None)
        return removed


class PosixSource:
    """One payload file open for ranged reads (``preadv``), with its fd for fast paths."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd: Optional[int] = fd
        self.size = size

    def readinto(self, buf: memoryview, offset: int) -> int:
        return os.preadv(self.fd, [buf], offset)  # type: ignore[arg-type]

    def fileno(self) -> Optional[int]:
        return self.fd

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class PosixReader:
    """A committed checkpoint open for reading: the step directory stays open (by fd) for
    as long as the reader, so a concurrent delete cannot swap files under it."""

    def __init__(self, tier: PosixTier, user: str, key: str, step: int) -> None:
        self.where = tier.where(user, key, step)
        self._ctx = tier.step_fd(user, key, step)
        self.step_fd = self._ctx.__enter__()
        try:
            try:
                self.manifest_bytes = fsio.read_small(self.step_fd, MANIFEST_NAME)
            except FileNotFoundError:
                raise NotFound(f"{self.where}: not committed") from None
            except OSError as exc:
                raise fsio.tier_error(exc, self.where) from None
            self.manifest = Manifest.from_bytes(self.manifest_bytes, self.where)
            if (self.manifest.user, self.manifest.key, self.manifest.step) != (user, key, step):
                raise VerifyError(f"{self.where}: manifest names another checkpoint")
        except BaseException:
            self._ctx.__exit__(None, None, None)
            raise

    def open(self, relpath: str) -> PosixSource:
        size = self.manifest.file(relpath).size
        try:
            return PosixSource(open_payload(self.step_fd, relpath), size)
        except FileNotFoundError:
            raise VerifyError(f"{self.where}/{relpath}: missing") from None
        except OSError as exc:
            raise fsio.tier_error(exc, f"{self.where}/{relpath}") from None

    def close(self) -> None:
        self._ctx.__exit__(None, None, None)

    def __enter__(self) -> PosixReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pid_alive(tmp_name: str) -> bool:
    """``.tmp-step-N-<pid>-<rand>``: is that writer still running on this node?"""
    try:
        pid = int(tmp_name.rsplit("-", 2)[-2])
    except (ValueError, IndexError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_name(name: str, check: Any) -> bool:
    try:
        check(name)
    except InvalidName:
        return False
    return True


def _listdir(path: str) -> List[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise fsio.tier_error(exc, path) from None


__all__ = ["PosixReader", "PosixSource", "PosixTier", "StepInfo"]
