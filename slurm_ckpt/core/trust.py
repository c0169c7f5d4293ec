"""What root may trust, decided in one place.

Root-run code (the hooks, the stager, root's ``ckpt-slurm``) reads and writes in places
users can reach: a PFS root that is mode 1777, per-user directories, admin paths that a
careless ``chmod`` opened up. It acts only on what no other user can have changed:

* a **private directory** (:func:`ensure_private_dir`): a real directory owned by this
  process's user and writable by no one else. Anything else sitting at that name - a
  user's directory made first, a symlink, a file - is moved aside (renamed, never
  followed, never deleted) and a fresh one is made. The ledger directory and
  ``<pfs>/.slurm_ckpt`` are such directories;
* a **trusted path** (:func:`path_problems`): every directory from ``/`` down to it is
  root's and writable by no one else - the rule ``sudo`` and ``sshd`` apply to their
  files. One relaxation, exact for the kernel's semantics: a world-writable directory
  with the sticky bit (``/tmp``, a 1777 PFS root) is fine *for an entry owned by root*,
  since no one else may rename or remove that entry. Config files, hook directories,
  the ``ckpt-slurm`` executable and hook log files must be trusted paths;
* a **user directory** ``<tier root>/<name>`` (:func:`squatter`): owned by the user
  ``name`` (or by root). On a root every user may write, another user can create the
  directory first ("squatting") and then read or replace what lands in it; such a
  directory is refused, by root and by the user's own job alike, and reported.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import pwd
import secrets
import stat
import time
from typing import List, Optional

from slurm_ckpt.core import fsio
from slurm_ckpt.errors import TierError

log = logging.getLogger(__name__)

__all__ = [
    "ROOT_UID",
    "Squatted",
    "check_user_dir_fd",
    "ensure_private_dir",
    "mode_of",
    "open_log",
    "open_user_subdir",
    "path_problems",
    "squat_message",
    "squatter",
    "uid_of",
    "unsafe_dir",
]

ROOT_UID = 0
#: Symlinks followed while checking one path (as the kernel's own limit).
_MAX_LINKS = 40


class Squatted(TierError):
    """``<tier root>/<user>`` belongs to someone else: refused (it may hold planted
    checkpoints, and whatever is written there its owner can read or replace)."""


def mode_of(st: os.stat_result) -> str:
    return f"{stat.S_IMODE(st.st_mode):04o}"


def unsafe_dir(st: os.stat_result, uid: Optional[int] = None) -> Optional[str]:
    """Why a directory (lstat result) is not private to ``uid`` (default: this process's
    user), or None when it is."""
    uid = os.geteuid() if uid is None else uid
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if st.st_uid != uid:
        return f"owned by uid {st.st_uid}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by group or others (mode {mode_of(st)})"
    return None


def ensure_private_dir(parent_fd: int, name: str, where: str, mode: int = 0o755) -> int:
    """Open ``name`` below ``parent_fd`` as a directory private to this process's user
    (see the module docstring), creating it with ``mode`` when missing and moving aside
    anything else found there. Returns an open fd (the caller closes it); raises
    :class:`TierError` when it keeps changing under us."""
    uid = os.geteuid()
    for _attempt in range(4):
        try:
            st: Optional[os.stat_result] = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None:
            why = unsafe_dir(st, uid)
            if why is not None:
                aside = (
                    f".{name.lstrip('.')}.untrusted-{int(time.time())}-{os.getpid()}-"
                    f"{secrets.token_hex(3)}"
                )
                try:
                    os.rename(name, aside, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
                except FileNotFoundError:
                    continue
                log.warning("%s was %s; moved it aside to %s", where, why, aside)
                st = None
        if st is None:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, mode, dir_fd=parent_fd)
        try:
            fd = os.open(name, fsio.O_DIR, dir_fd=parent_fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
                continue  # swapped meanwhile: look again
            raise
        fst = os.fstat(fd)
        if fst.st_uid == uid:
            if stat.S_IMODE(fst.st_mode) != mode:
                os.fchmod(fd, mode)  # ours (just made, under a umask): set the mode
            return fd
        os.close(fd)  # someone else's directory appeared in between: look again
    raise TierError(f"{where}: keeps changing under us; refusing to use it")


# --------------------------------------------------------------------------- paths


def _parent_ok(parent: os.stat_result, child_uid: Optional[int]) -> Optional[str]:
    """Why a non-root user could replace an entry of ``parent`` owned by ``child_uid``
    (None: the entry is missing and root would create it)."""
    if parent.st_uid != ROOT_UID:
        return f"owned by uid {parent.st_uid}"
    group_w = parent.st_mode & stat.S_IWGRP and parent.st_gid != ROOT_UID
    other_w = parent.st_mode & stat.S_IWOTH
    if not group_w and not other_w:
        return None
    sticky = parent.st_mode & stat.S_ISVTX
    if sticky and child_uid == ROOT_UID:
        return None  # no one else may rename or remove root's entry here
    # (a missing entry is no better: anyone could create it first - a symlink, say)
    return f"writable by {'others' if other_w else 'its group'} (mode {mode_of(parent)})"


def path_problems(path: str, what: str, *, must_exist: bool = True) -> List[str]:
    """Why a non-root user could change what ``path`` names: each a one-line problem
    with the fix; empty when the path is trusted (see the module docstring). ``path``
    itself must be root's and writable by no one else; a missing path (``must_exist``
    False) is judged by the directory it would be created in."""
    out: List[str] = []
    _check(os.path.abspath(path), what, must_exist, out, 0)
    return out


def _check(path: str, what: str, must_exist: bool, out: List[str], links: int) -> None:
    if links > _MAX_LINKS:
        out.append(f"{what} {path}: too many levels of symbolic links")
        return
    parts = [p for p in path.split("/") if p]
    cur = "/"
    try:
        parent = os.lstat("/")
    except OSError as exc:  # pragma: no cover - there is always a /
        out.append(f"{what}: / unreadable: {exc.strerror}")
        return
    for i, part in enumerate(parts):
        here = os.path.join(cur, part)
        last = i == len(parts) - 1
        try:
            st = os.lstat(here)
        except FileNotFoundError:
            if must_exist:
                out.append(f"{what} {path}: {here} does not exist")
                return
            why = _parent_ok(parent, None)
            if why:
                out.append(
                    f"{what} {path}: {cur} is {why}: another user could put their own "
                    f"{part} there (fix: chown root {cur} && chmod go-w {cur})"
                )
            return  # root creates the rest, its own and private
        except OSError as exc:
            out.append(f"{what} {path}: {here}: {exc.strerror or exc}")
            return
        why = _parent_ok(parent, st.st_uid)
        if why:
            out.append(
                f"{what} {path}: {cur} is {why}: another user could replace {here} "
                f"(fix: chown root {cur} && chmod go-w {cur})"
            )
            return
        if stat.S_ISLNK(st.st_mode):
            target = os.readlink(here)
            rest = "/".join(parts[i + 1 :])
            full = os.path.normpath(os.path.join(cur, target, rest))
            _check(full, what, must_exist, out, links + 1)
            return
        if last:
            if st.st_uid != ROOT_UID:
                out.append(
                    f"{what} {path}: owned by uid {st.st_uid}, not root (fix: chown root {path})"
                )
            elif st.st_mode & stat.S_IWOTH or (st.st_mode & stat.S_IWGRP and st.st_gid):
                out.append(
                    f"{what} {path}: writable by others (mode {mode_of(st)}) "
                    f"(fix: chmod go-w {path})"
                )
            return
        if not stat.S_ISDIR(st.st_mode):
            out.append(f"{what} {path}: {here} is not a directory")
            return
        cur, parent = here, st


def open_log(path: str, mode: int = 0o640) -> int:
    """Open a log file for appending, as root may: never through a symlink
    (``O_NOFOLLOW``), never blocking on a FIFO, only a regular file with one link that
    this process's user owns. Returns the fd; OSError otherwise."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(path, flags, mode)
    try:
        st = fsio.check_file(fd, path)
        if st.st_uid != os.geteuid():
            raise fsio.UnsafeFile(f"{path} is owned by uid {st.st_uid}")
        return fd
    except BaseException:
        os.close(fd)
        raise


# --------------------------------------------------------------------------- squatting


@functools.lru_cache(maxsize=4096)
def uid_of(name: str) -> Optional[int]:
    """The uid of user ``name``, None when this node does not know the name."""
    try:
        return pwd.getpwnam(name).pw_uid
    except (KeyError, UnicodeEncodeError):
        return None


def squatter(st: os.stat_result, name: str) -> Optional[int]:
    """The uid of whoever squats ``<root>/<name>`` (its fstat/lstat ``st``): the owner,
    when that is neither user ``name`` nor root; None when it is fine or ``name`` is not
    a user this node knows (then nothing can be told)."""
    want = uid_of(name)
    if want is None or st.st_uid in (want, ROOT_UID):
        return None
    return st.st_uid


def squat_message(where: str, name: str, owner: int) -> str:
    """One line for the admin and the user: what is wrong and the fix."""
    try:
        who = f"{pwd.getpwuid(owner).pw_name} (uid {owner})"
    except KeyError:
        who = f"uid {owner}"
    return (
        f"{where} is owned by {who}, not by {name}: squatted, refusing to use it "
        f"(fix, as root: inspect it, then mv {where} {where}.squatted-by-{owner}; "
        f"{name}'s next flush makes a new one)"
    )


def check_user_dir_fd(fd: int, where: str, name: str) -> None:
    """Refuse (:class:`Squatted`) an open ``<root>/<name>`` directory that another user
    owns."""
    owner = squatter(os.fstat(fd), name)
    if owner is not None:
        raise Squatted(squat_message(where, name, owner))


def open_user_subdir(root_fd: int, user: str, parts: List[str], create: bool, where: str) -> int:
    """Open ``<root>/<user>/<parts...>`` (:func:`~slurm_ckpt.core.fsio.open_beneath`,
    no symlinks followed), refusing a squatted ``<root>/<user>`` (:class:`Squatted`)."""
    ufd = fsio.open_beneath(root_fd, [user], create=create)
    try:
        check_user_dir_fd(ufd, f"{where}/{user}", user)
        return fsio.open_beneath(ufd, parts, create=create)
    finally:
        os.close(ufd)
